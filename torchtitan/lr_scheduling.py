"""Learning-rate schedules: linear warmup, then linear, cosine or no decay down to a floor.

The schedule is a pure function of the step; ``build_lr_schedulers`` wraps it in one ``LambdaLR`` per optimizer so
that checkpoints carry the scheduler position like any other state.
"""

from __future__ import annotations

import functools
import math

from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, lr_min: float) -> float:
    """Multiplier of the peak lr for training step ``step`` (1-based)."""
    if step <= warmup_steps:
        return step / warmup_steps
    if decay_type == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay type {decay_type!r}")
    return lr_min + (1.0 - lr_min) * shape


def _lambda(last_epoch: int, **kwargs) -> float:
    # LambdaLR counts completed scheduler steps from 0; the step about to run is one more.
    return lr_factor(last_epoch + 1, **kwargs)


class SchedulersContainer:
    """One LambdaLR per optimizer, stepped together."""

    def __init__(self, schedulers: list[LambdaLR]):
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


def build_lr_schedulers(optimizers, job_config) -> SchedulersContainer:
    t = job_config.training
    schedule = functools.partial(
        _lambda, warmup_steps=t.warmup_steps, total_steps=t.steps, decay_type=t.decay_type, lr_min=t.lr_min
    )
    return SchedulersContainer([LambdaLR(opt, schedule) for opt in optimizers.optimizers])
