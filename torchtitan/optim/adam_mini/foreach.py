"""Adam-mini's reference back end: foreach kernels over the parameter lists, block statistics in their own pass."""

from __future__ import annotations

import torch
from torch import Tensor

from torchtitan.optim.adam_mini.layout import BlockLayout
from torchtitan.optim.adam_mini.partition import PER_ELEMENT
from torchtitan.optim.adam_mini.statistics import Hyper, block_means, per_row
from torchtitan.optim.state.storage import at_least_float32, read_state, write_state


def foreach_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    step_counts: list[float],
    layouts: list[BlockLayout],
    hyper: Hyper,
) -> None:
    """The reference back end: foreach kernels over the lists, block statistics in their own pass."""
    beta1, beta2, eps, lr = hyper.beta1, hyper.beta2, hyper.eps, hyper.lr
    # bfloat16 weights: the math runs on float32 copies, written back (rounded to nearest) at the end.
    weights = params
    params = [p if p.dtype == at_least_float32(p.dtype) else p.float() for p in weights]
    grads = [g.to(p.dtype) for g, p in zip(grads, params)]
    blocked = [i for i, layout in enumerate(layouts) if layout.plan.rule != PER_ELEMENT]
    elementwise = [i for i, layout in enumerate(layouts) if layout.plan.rule == PER_ELEMENT]
    bias_corrections1 = [1 - beta1**count for count in step_counts]
    bias_corrections2 = [1 - beta2**count for count in step_counts]

    # Second moments: block means of g**2 for matrices and vectors, g**2 itself for biases.
    if blocked:
        blocked_v = [second_moments[i] for i in blocked]
        torch._foreach_mul_(blocked_v, beta2)
        torch._foreach_add_(
            blocked_v, block_means([grads[i] for i in blocked], [layouts[i] for i in blocked]), alpha=1 - beta2
        )
    if elementwise:
        element_v, element_g = [second_moments[i] for i in elementwise], [grads[i] for i in elementwise]
        torch._foreach_mul_(element_v, beta2)
        torch._foreach_addcmul_(element_v, element_g, element_g, value=1 - beta2)

    # scale = lr / (bc1 * (sqrt(v / bc2) + eps)): tiny (blocks, 1) tensors except for biases.
    scales = list(torch._foreach_div(second_moments, bias_corrections2))
    torch._foreach_sqrt_(scales)
    torch._foreach_add_(scales, eps)
    torch._foreach_mul_(scales, bias_corrections1)
    torch._foreach_reciprocal_(scales)
    torch._foreach_mul_(scales, lr)
    for i in blocked:
        scales[i] = per_row(scales[i], params[i], layouts[i])

    # m <- lerp(m, g, 1 - beta1); p <- p * decay - scale * m, with m read from and written back to its storage.
    # The new m is used unrounded; the stored one is rounded by the storage (bf16: stochastically, salted by the step).
    decayed = [p for p, layout in zip(params, layouts) if hyper.weight_decay != 0 and layout.plan.decay]
    if decayed:
        torch._foreach_mul_(decayed, 1 - lr * hyper.weight_decay)
    momenta = [read_state(m, p.dtype) for m, p in zip(exp_avgs, params)]  # m itself when float32 (or float64)
    torch._foreach_lerp_(momenta, grads, 1 - beta1)
    salts: dict[tuple[int, torch.device], torch.Tensor] = {}  # one salt tensor per step count and device
    for stored, momentum, count in zip(exp_avgs, momenta, step_counts):
        if momentum is not stored:
            key = (int(count), momentum.device)
            if key not in salts:
                salts[key] = torch.tensor(key[0], device=key[1])
            write_state(stored, momentum, salts[key])
    torch._foreach_addcmul_(params, momenta, scales, value=-1.0)
    for weight, p in zip(weights, params):
        if p is not weight:
            weight.copy_(p)
