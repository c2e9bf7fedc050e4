"""Create an optimizer's lazily made state before its first step, so that it can be checkpointed or measured.

torch.optim optimizers create their state on the first ``step()``; a checkpoint can only be saved from, or loaded
into, state that exists. :func:`initialise_state` mirrors torch's own helper for this,
``torch.distributed.checkpoint.state_dict._init_optim_state`` (one ``step()`` with zero gradients at lr 0), and
differs from it where that helper would change training or fail on our optimizers:

- existing gradients are kept and put back (torch's returns early when any gradient exists, and drops them after);
- L2 weight decay (Adam's, added to the gradient) is switched off for the step, since at lr 0 it would still fill
  the moments from the weights; decoupled (AdamW-style) decay scales with lr and is left on;
- a tensor lr is zeroed in its own dtype and device (torchao's optimizers require that), and every lr and weight
  decay is restored to the very object it was;
- step counters are set back to 0, so that bias correction continues as if the zero step never happened;
- meta and fake parameters (memory estimates) run the step eagerly: they have no data to compile kernels for.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from torchtitan.distributed.utils import local_tensor


@torch.no_grad()
def initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state as a fresh optimizer would have it, changing no parameter (no-op once it exists)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params:
        return
    saved_grads = [p.grad for p in params]
    saved_groups = [(group["lr"], group.get("weight_decay")) for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            if "weight_decay" in group and not _decoupled_weight_decay(optimizer, group):
                group["weight_decay"] = 0.0
        dataless = any(_is_dataless(p) for p in params)
        with torch.compiler.set_stance("force_eager") if dataless else contextlib.nullcontext():
            optimizer.step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for group, (lr, weight_decay) in zip(optimizer.param_groups, saved_groups):
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
    for state in optimizer.state.values():
        _reset_step(state)


def _is_dataless(t: torch.Tensor) -> bool:
    local = local_tensor(t)
    return local.device.type == "meta" or is_fake(local)


def _decoupled_weight_decay(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether weight decay scales with lr (AdamW-style), so that lr 0 already stops it.

    Such decay may stay on during the zero step, so that the step compiles the graphs the training steps use (torchao's
    and ours), not a variant for a changed constant: torchao's low-bit AdamW compiles its step for the weight decay's
    value. Ours (AdamMini, LowPrecisionAdam) set ``decoupled_weight_decay``, torch's AdamW sets it in each group, and
    torchao's AdamW variants set ``is_adamw``.
    """
    return any(
        flag is True
        for flag in (
            group.get("decoupled_weight_decay"),
            getattr(optimizer, "decoupled_weight_decay", False),
            getattr(optimizer, "is_adamw", False),
        )
    )


def _reset_step(state: dict[str, Any]) -> None:
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        step.zero_()
    elif step is not None:
        state["step"] = type(step)(0)
