"""Divergence guard: a step whose loss or gradients are not finite does not update the model; a run that keeps
diverging stops before it can write a broken checkpoint.

What a skipped step does, on every rank alike (the decision is all-reduced, so no rank steps alone):
- parameters and optimizer state are untouched: ``optimizer.step()`` is not called, so moments and the optimizer's
  own step count (Adam's bias correction) stay as they were;
- the batch is consumed and ``train_state.step``, ``tokens_seen`` and the lr schedule advance as on any step. A
  step is one global batch of the data stream: step N always sees the same data and the same lr, whether or not
  earlier steps were skipped, so a skipped run still lines up step for step (and token for token) with runs of
  other optimizers, a resumed run stays aligned with an uninterrupted one, and a batch that produced the
  non-finite values is not replayed;
- no checkpoint is written at that step (nor at the last step, if it is skipped).

After ``training.max_skipped_steps`` consecutive skipped steps (0: none allowed) the next non-finite step stops the
run with :class:`DivergenceError`, which ``train.py`` prints as one ``error:`` line on rank 0 and exits with
:data:`torchtitan.errors.DIVERGENCE_EXIT_CODE`. A step that is finite again resets the count.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.distributed.collectives import any_rank_each
from torchtitan.distributed.utils import local_tensor
from torchtitan.errors import DivergenceError
from torchtitan.logging import logger


def tensors_are_finite(tensors: Iterable[Any]) -> bool:
    """True if no floating-point tensor among ``tensors`` (this rank's shards) holds a NaN or an infinity.

    One foreach max-abs per device and dtype: it is NaN or infinite exactly when a value is, and never overflows.
    Float8 parts (an FP8 state's codes) have no norm kernel everywhere: each is widened to float32 alone.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    float8_maxima: list[torch.Tensor] = []
    for value in tensors:
        if not isinstance(value, torch.Tensor):
            continue
        for local in _plain_parts(local_tensor(value).detach()):
            if not (local.is_floating_point() and local.numel() > 0):
                continue
            if local.element_size() == 1:
                float8_maxima.append(torch.linalg.vector_norm(local.float(), ord=math.inf).cpu())
            else:
                groups.setdefault((local.device, local.dtype), []).append(local)
    all_maxima = [torch.stack(torch._foreach_norm(group, ord=math.inf)) for group in groups.values()]
    if float8_maxima:
        all_maxima.append(torch.stack(float8_maxima))
    return all(bool(torch.isfinite(maxima).all()) for maxima in all_maxima)


def _plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor, or the plain tensors inside a wrapper subclass: a quantized state's values (codes looked up in a
    finite table, times block scales) are finite exactly when its floating-point parts are."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    inner_names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in inner_names]
    return [part for t in inner if isinstance(t, torch.Tensor) for part in _plain_parts(t)]


def state_tensors(state: Any) -> Iterable[Any]:
    """Every leaf of a nested dict/list state (what DCP saves)."""
    if isinstance(state, dict):
        for value in state.values():
            yield from state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from state_tensors(value)
    else:
        yield state


def resume_hint(last_finite_step: Optional[int], folder: Optional[str]) -> str:
    """The part of a divergence message that says where to resume from."""
    if folder is None:
        return "checkpointing is off, so there is no checkpoint to resume from"
    if last_finite_step is None:
        return f"no checkpoint was written in {folder} before that, so there is none to resume from"
    return (
        f"the last finite checkpoint is step-{last_finite_step} in {folder}: resume from it with "
        f"--checkpoint.load_step {last_finite_step} and a lower optimizer.lr or training.max_norm"
    )


class DivergenceGuard:
    """Decides, the same way on every rank, whether a step's update is applied; counts consecutive skips.

    Its one all-reduce per step also carries ``stop_signal()`` (this rank's "a stop signal came", see
    ``torchtitan.training.preemption``): :attr:`stop_requested` says whether any rank had one by this step's
    decision, so that asking costs the loop no collective of its own."""

    def __init__(
        self, max_skipped_steps: int, device: torch.device, stop_signal: Callable[[], bool] = lambda: False
    ) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.device = device
        self.stop_signal = stop_signal
        self.stop_requested = False
        self.consecutive = 0
        self.stopped_at: Optional[int] = None  # the step that ran out of allowed skips

    def should_update(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> bool:
        """False if the loss on any rank or the (global) grad norm is not finite; logs which step was skipped.

        Sets :attr:`stopped_at` once more than ``max_skipped_steps`` steps in a row were not finite, and
        :attr:`stop_requested` once a rank has a stop signal.
        """
        # Kept on the device until the all-reduce: the decision costs one host sync per step. The stop flag joins
        # it as a fill value (a kernel argument, not a copy from the host).
        local_bad = ~(torch.isfinite(loss).all() & torch.isfinite(grad_norm).all())
        stop = torch.full((), self.stop_signal(), dtype=torch.bool, device=local_bad.device)
        any_bad, any_stop = any_rank_each(torch.stack([local_bad, stop]), self.device)
        self.stop_requested = self.stop_requested or any_stop
        if not any_bad:
            self.consecutive = 0
            return True
        self.consecutive += 1
        if self.consecutive > self.max_skipped_steps:
            self.stopped_at = step
        else:
            logger.warning(
                f"step {step}: loss or gradient norm is non-finite on at least one rank (local loss "
                f"{float(loss):.4g}, grad norm {float(grad_norm):.4g}); skipped the update "
                f"({self.consecutive} in a row, training.max_skipped_steps={self.max_skipped_steps})"
            )
        return False

    @property
    def first_skipped(self) -> int:
        """The first step of the current run of non-finite steps."""
        return (self.stopped_at or 0) - self.consecutive + 1

    def error(self, resume: str) -> DivergenceError:
        """The error that stops the run at :attr:`stopped_at`; ``resume`` says where to resume from
        (:func:`resume_hint`)."""
        streak = f" and stayed so through step {self.stopped_at}" if self.stopped_at != self.first_skipped else ""
        return DivergenceError(
            f"training diverged: the loss or gradients became non-finite at step {self.first_skipped}{streak} "
            f"(training.max_skipped_steps={self.max_skipped_steps}); " + resume
        )
