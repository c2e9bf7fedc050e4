"""AdEMAMix's math: the warm-up schedules and the element-wise update, as pure functions.

With ``g`` the gradient at step ``t`` (counted from 1), the paper's Algorithm 1:

    m1 = beta1 m1 + (1 - beta1) g                       fast momentum
    m2 = beta3(t) m2 + (1 - beta3(t)) g                 slow momentum
    nu = beta2 nu + (1 - beta2) g^2                     second moment
    p  = p (1 - lr wd) - lr (m1 / (1 - beta1^t) + alpha(t) m2) / (sqrt(nu / (1 - beta2^t)) + eps)

The slow momentum is not bias-corrected (the paper: its warm-up does that work). ``alpha(t)`` rises linearly from 0
to ``alpha`` over ``warmup_steps``; ``beta3(t)`` rises from ``beta1`` to ``beta3`` so that the slow momentum's
half-life grows linearly (the paper's ``f_beta3``). ``warmup_steps`` 0 holds both at their final values.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from torchtitan.optim.state.storage import write_state


def alpha_schedule(step: Tensor, alpha: float, warmup_steps: int) -> Tensor:
    """alpha(t) = min(t alpha / T, alpha) for float64 step counts ``step``; ``alpha`` throughout for T = 0."""
    if warmup_steps == 0:
        return torch.full_like(step, alpha)
    return torch.clamp(step * alpha / warmup_steps, max=alpha)


def beta3_schedule(step: Tensor, beta1: float, beta3: float, warmup_steps: int) -> Tensor:
    """beta3(t) = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + (t/T) ln b1)), b3) for float64 step counts ``step``:
    the decay whose half-life ``ln(1/2) / ln beta`` moves linearly from beta1's to beta3's; ``beta3`` for T = 0."""
    if warmup_steps == 0:
        return torch.full_like(step, beta3)
    log_beta1, log_beta3 = math.log(beta1), math.log(beta3)
    progress = step / warmup_steps
    interpolated = torch.exp(log_beta1 * log_beta3 / ((1 - progress) * log_beta3 + progress * log_beta1))
    return torch.clamp(interpolated, max=beta3)


class StepFactors(NamedTuple):
    """One parameter's factors for one step, 0-d tensors in the math dtype on the parameter's device."""

    lr: Tensor
    decay: Tensor  # 1 - lr weight_decay
    bias_correction1: Tensor  # 1 - beta1^t
    bias_correction2_sqrt: Tensor  # sqrt(1 - beta2^t)
    alpha: Tensor  # alpha(t)
    slow_weight: Tensor  # 1 - beta3(t)
    salt: Tensor  # int64 step count: salts the stochastic rounding of bfloat16 state


def ademamix_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_slows: list[Tensor],
    exp_avg_sqs: list[Tensor],
    factors: list[StepFactors],
    *,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """One AdEMAMix step over local tensors (a DTensor's shard, or a plain tensor), in place.

    The math runs in the factors' dtype (at least float32); the moments are read from their storage, used
    unrounded and written back through it (bfloat16 rounds stochastically). Element-wise: any shard of a parameter
    steps exactly as that part of the whole parameter would.
    """
    for p, g, m1, m2, nu, f in zip(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs, factors):
        dtype = f.lr.dtype
        g = g.to(dtype)
        # In place: ``.to`` returns the state itself when it is stored in the math dtype (no copy, and writing it
        # back is a no-op); a bfloat16 state is read into a float32 copy and written back rounded.
        fast = m1.to(dtype).lerp_(g, 1 - beta1)
        slow = m2.to(dtype).lerp_(g, f.slow_weight)
        second = nu.to(dtype).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        write_state(m1, fast, f.salt)
        write_state(m2, slow, f.salt)
        write_state(nu, second, f.salt)
        denominator = second.sqrt().div_(f.bias_correction2_sqrt).add_(eps)
        update = fast.div(f.bias_correction1).addcmul_(slow, f.alpha).div_(denominator).mul_(f.lr)
        p.copy_(p.to(dtype).mul(f.decay).sub_(update))
