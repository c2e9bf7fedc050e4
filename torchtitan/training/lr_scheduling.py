"""Learning-rate schedules: linear warmup, an optional stable phase, then linear, cosine, sqrt or no decay down to a
floor.

The schedule is a pure function of the step; ``build_lr_schedulers`` wraps it in one ``LambdaLR`` per optimizer so
that checkpoints carry the scheduler position like any other state.

Conventions (steps count from 1 to ``total_steps``):

- warmup: step ``s <= warmup_steps`` gets ``s / warmup_steps`` of the peak lr (the first step already trains);
- warmup-stable-decay: with ``decay_ratio`` set, the last ``round(decay_ratio * total_steps)`` steps decay and the
  steps between warmup and them keep the peak lr; unset, every step after warmup decays;
- decay: the ``i``-th of ``D`` decaying steps is at ``progress = i / (D + 1)``, so the lr would reach ``lr_min``
  one step after the last one: with ``lr_min = 0`` the last step still trains (at ``1 / (D + 1)`` of the peak for
  linear decay);
- shapes of the decay from 1 to ``lr_min``: linear ``1 - progress``, cosine ``(1 + cos(pi * progress)) / 2``,
  sqrt ``1 - sqrt(progress)``.

This module imports torch only to build the schedulers, so that the job config can check a schedule
(:func:`check_schedule`) without it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

from torchtitan.errors import UserError

DECAY_TYPES = ("linear", "cosine", "sqrt", "constant")

_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def decay_steps(*, warmup_steps: int, total_steps: int, decay_ratio: Optional[float]) -> int:
    """How many of the last steps decay: ``round(decay_ratio * total_steps)``, or all after warmup when unset."""
    if decay_ratio is None:
        return max(0, total_steps - warmup_steps)
    return round(decay_ratio * total_steps)


def check_schedule(
    *, warmup_steps: int, total_steps: int, decay_type: str, lr_min: float, decay_ratio: Optional[float]
) -> None:
    """UserError (one line) for a schedule whose options contradict each other or would change nothing."""
    if decay_ratio is None:
        return
    if decay_type == "constant":
        raise UserError("training.decay_ratio has no effect with training.decay_type constant; remove one of them")
    decaying = decay_steps(warmup_steps=warmup_steps, total_steps=total_steps, decay_ratio=decay_ratio)
    if decaying < 1:
        raise UserError(f"training.decay_ratio {decay_ratio} of {total_steps} steps leaves no step to decay; raise it")
    if warmup_steps + decaying > total_steps:
        raise UserError(
            f"training.warmup_steps {warmup_steps} plus {decaying} decay steps (training.decay_ratio {decay_ratio}) "
            f"exceed training.steps {total_steps}; lower one of them"
        )


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_type: str,
    lr_min: float,
    decay_ratio: Optional[float] = None,
) -> float:
    """Multiplier of the peak lr for training step ``step`` (1-based); see the module's conventions."""
    if step <= warmup_steps:
        return step / warmup_steps
    if decay_type == "constant":
        return 1.0
    shape = _SHAPES.get(decay_type)
    if shape is None:
        raise ValueError(f"unknown decay type {decay_type!r}")
    decaying = decay_steps(warmup_steps=warmup_steps, total_steps=total_steps, decay_ratio=decay_ratio)
    into_decay = step - (total_steps - decaying)
    if into_decay <= 0:
        return 1.0  # the stable phase
    progress = min(1.0, into_decay / (decaying + 1))
    return lr_min + (1.0 - lr_min) * shape(progress)


def _lambda(last_epoch: int, **kwargs) -> float:
    # LambdaLR counts completed scheduler steps from 0; the step about to run is one more.
    return lr_factor(last_epoch + 1, **kwargs)


class SchedulersContainer:
    """One LambdaLR per optimizer, stepped together."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        return _as_float(self.schedulers[0].get_last_lr()[0])

    def state_dict(self) -> dict:
        # Every scheduler sees the same steps, so one state describes them all (and survives a change of parts).
        state = self.schedulers[0].state_dict()
        return {"last_epoch": state["last_epoch"], "_step_count": state["_step_count"]}

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = int(state["last_epoch"])
            scheduler._step_count = int(state["_step_count"])
            # Re-apply the lr for the restored position.
            for group, base_lr, schedule in zip(
                scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas
            ):
                _set_lr(group, _as_float(base_lr) * schedule(scheduler.last_epoch))
            scheduler._last_lr = [_as_float(g["lr"]) for g in scheduler.optimizer.param_groups]


def _as_float(lr) -> float:
    return float(lr.item()) if hasattr(lr, "item") else float(lr)


def _set_lr(group: dict, value: float) -> None:
    # torchao's low-bit optimizers keep lr as a tensor and must be updated in place.
    if hasattr(group["lr"], "fill_"):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def schedule_options(training: Any) -> dict[str, Any]:
    """``lr_factor``'s keyword arguments from ``[training]``."""
    return dict(
        warmup_steps=training.warmup_steps,
        total_steps=training.steps,
        decay_type=training.decay_type,
        lr_min=training.lr_min,
        decay_ratio=training.decay_ratio,
    )


def build_lr_schedulers(optimizers, job_config) -> SchedulersContainer:
    from torch.optim.lr_scheduler import LambdaLR

    schedule = functools.partial(_lambda, **schedule_options(job_config.training))
    return SchedulersContainer([LambdaLR(opt, schedule) for opt in optimizers.optimizers])
