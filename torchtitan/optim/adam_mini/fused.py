"""Adam-mini's fused back end: float32 (and float64) parameters with plain momentum in one call of its one-pass
operator (``one_pass.py``); the rest (bfloat16 weights, bfloat16 or quantized momentum, or no C++ compiler for the
CPU kernel) as one compiled graph per slice.

Block means, ``v``, the momentum and the parameter of each parameter are one graph (``torch.compile``). The
grouping, slices and per-parameter plans are worked out once per parameter set and kept (``_schedule``).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from torchtitan.optim.adam_mini.layout import BlockLayout
from torchtitan.optim.adam_mini.one_pass import one_pass_update
from torchtitan.optim.adam_mini.partition import PER_ELEMENT, PER_HEAD, PER_TENSOR
from torchtitan.optim.adam_mini.statistics import Hyper, block_means, stat_dtype
from torchtitan.optim.compiled_slices import CompiledStep, repeating_slices
from torchtitan.optim.state.storage import is_quantized, write_state


@dataclass(frozen=True)
class _FusedPlan:
    """What the compiled step needs to know of one parameter besides its tensors (a part of the graph's key).

    The local parameter is viewed as a matrix with one scale per row: ``heads`` rows (per_head blocks whole on
    this rank), one row (per_tensor) or its own rows (per_row, and per_head rows that pick their head's scale
    through an index). Where block means are given (partial statistics completed over the mesh) the graph uses
    them; otherwise the rows of the matrix are whole blocks and their means are taken in the same graph.
    """

    rule: str
    heads: int
    decays: bool


def _fused_plan(layout: BlockLayout, weight_decay: float) -> _FusedPlan:
    plan = layout.plan
    heads = plan.n_blocks if plan.rule == PER_HEAD and not layout.rows_split else 0
    return _FusedPlan(plan.rule, heads, weight_decay != 0 and plan.decay)


def _as_block_rows(t: Tensor, plan: _FusedPlan) -> Tensor:
    # Sizes spelt out rather than -1: an empty local shard (FSDP2 gives the last ranks none of a short tensor's rows)
    # has 0 rows of a known width.
    if plan.rule == PER_TENSOR:
        return t.reshape(1, t.numel())
    if plan.heads:
        return t.reshape(plan.heads, t.numel() // plan.heads)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _fused_steps(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    means: list[Optional[Tensor]],
    indices: list[Optional[Tensor]],
    plans: tuple[_FusedPlan, ...],
    scalars: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The whole local step for parameters of one dtype and momentum storage: what ``torch.compile`` fuses.

    ``scalars`` holds lr, 1 - beta1**t, 1 - beta2**t, 1 - lr * weight_decay and t (values that change every step
    enter as a tensor, so the graph is compiled once; its dtype, at least float32, is the dtype of the math). Per
    parameter, the same math as the foreach back end::

        mean  = mean(g**2) over each block (or given)      v = beta2 * v + (1 - beta2) * mean
        scale = lr / (bc1 * (sqrt(v / bc2) + eps))        m = lerp(m, g, 1 - beta1)  (rounded into m's storage)
        p     = p * decay - scale * m

    ``m.to(dtype)`` of a quantized state dequantizes (torchao's tensors); ``write_state`` writes back, rounding
    (bfloat16: stochastically, salted by t) or quantizing, so every storage shares this one expression.
    """
    lr, bias_correction1, bias_correction2, decay, step = scalars.unbind()
    for p, g, m, v, mean, index, plan in zip(params, grads, exp_avgs, second_moments, means, indices, plans):
        g = g.to(scalars.dtype)  # the math in at least float32, whatever the weights' dtype
        if plan.rule == PER_ELEMENT:
            v.copy_(v * beta2 + (g * g) * (1 - beta2))
        else:
            if mean is None:
                rows = _as_block_rows(g, plan).to(stat_dtype(g))
                mean = (rows * rows).sum(dim=1, keepdim=True) / rows.shape[1]
            v.copy_(v * beta2 + mean * (1 - beta2))
        if p.numel() == 0:
            continue  # an empty shard still keeps its (replicated) v in step with the other ranks
        scale = lr / (bias_correction1 * ((v / bias_correction2).sqrt() + eps))
        if index is not None:
            scale = scale.index_select(0, index)
        momentum = m.to(scalars.dtype).lerp(g, 1 - beta1)
        write_state(m, momentum, step.to(torch.int64))
        weights = p.to(scalars.dtype)
        kept = weights * decay if plan.decays else weights
        if plan.rule == PER_ELEMENT:
            p.copy_(kept - scale * momentum)
        else:
            p.copy_(kept - (scale * _as_block_rows(momentum, plan)).reshape(p.shape))


# Inductor would recompute each row's scale (a sqrt and two divisions) for every entry of the row unless told to
# store results of more than a few operations. Measured on a 2-core CPU (benchmarks/bench_optimizers.py): 1.15x ->
# 0.99x fused AdamW at 99.5M parameters.
_FUSED_STEP = CompiledStep(_fused_steps, "AdamMini", realize_opcount_threshold=4)


def fused_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    step_counts: list[float],
    layouts: list[BlockLayout],
    hyper: Hyper,
) -> None:
    """Compiled local steps over parameters sharing dtype, device, step and momentum storage.

    Shapes are static (the fastest code). Parameters are passed in slices that repeat (``repeating_slices``:
    one of each weight of a transformer layer), so a model compiles one graph per distinct slice, a few layers'
    worth however deep it is, and never again (``CompiledStep`` says when it runs eagerly).
    """
    if not params:
        return
    partial = [i for i, layout in enumerate(layouts) if layout.plan.rule != PER_ELEMENT and layout.sum_dims]
    means: list[Optional[Tensor]] = [None] * len(params)
    for i, mean in zip(partial, block_means([grads[i] for i in partial], [layouts[i] for i in partial])):
        means[i] = mean
    indices = [
        layout.local_blocks(p) if layout.plan.rule == PER_HEAD and layout.rows_split else None
        for p, layout in zip(params, layouts)
    ]
    # Plain float32/float64 tensors: one operator call for all (the CPU's C++ kernel, CUDA's Triton kernel).
    left = one_pass_update(params, grads, exp_avgs, second_moments, means, indices, layouts, step_counts, hyper)
    if len(left) < len(params):
        if not left:
            return
        kept = (params, grads, exp_avgs, second_moments, means, indices, layouts, step_counts)
        params, grads, exp_avgs, second_moments, means, indices, layouts, step_counts = (
            [items[i] for i in left] for items in kept
        )
    schedule, plans = _schedule(params, exp_avgs, second_moments, means, indices, layouts, step_counts, hyper)
    # One scalars tensor per dtype, device and step, shared by the groups (a quantized parameter is a group of its
    # own): each one made is a host-to-device copy that waits for the device.
    made: dict[tuple, Tensor] = {}
    for dtype, device, count, slices in schedule:
        scalar_dtype = torch.promote_types(dtype, torch.float32)
        key = (scalar_dtype, device, count)
        if key not in made:
            made[key] = _scalars(hyper, count, scalar_dtype, device)
        scalars = made[key]

        def arguments(part: list[int], scalars: Tensor = scalars) -> tuple:
            # Detached: the compiled graph sees plain tensors sharing the parameters' memory.
            return (
                [params[i].detach() for i in part],
                [grads[i] for i in part],
                [exp_avgs[i] for i in part],
                [second_moments[i] for i in part],
                [means[i] for i in part],
                [indices[i] for i in part],
                tuple(plans[i] for i in part),
                scalars,
                hyper.beta1,
                hyper.beta2,
                hyper.eps,
            )

        _FUSED_STEP.run(slices, arguments, params)


def _scalars(hyper: Hyper, count: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """lr, 1 - beta1**t, 1 - beta2**t, 1 - lr * weight_decay and t on ``device`` (see ``_fused_steps``)."""
    lr, host = hyper.lr, [1 - hyper.beta1**count, 1 - hyper.beta2**count]
    if not isinstance(lr, Tensor):
        return torch.tensor([lr, *host, 1 - lr * hyper.weight_decay, count], dtype=dtype).to(device)
    lr_t = lr.detach().to(device=device, dtype=dtype).reshape(1)
    rest = torch.tensor([*host, count], dtype=dtype).to(device)
    return torch.cat([lr_t, rest[:2], 1 - lr_t * hyper.weight_decay, rest[2:]])


# The last fused step's schedule, kept for the layout of the parameter that led it (forgotten with the layouts).
_schedules: "weakref.WeakKeyDictionary[BlockLayout, tuple]" = weakref.WeakKeyDictionary()


def _schedule(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    means: list[Optional[Tensor]],
    indices: list[Optional[Tensor]],
    layouts: list[BlockLayout],
    step_counts: list[float],
    hyper: Hyper,
) -> tuple[list[tuple], list[_FusedPlan]]:
    """Groups (dtype, device, step, slices of parameter indices) and per-parameter plans for a fused step.

    They depend only on the parameters' layouts and storage, so they are worked out once and kept for the
    first layout while its step keeps the same parameters (all on one step count, as usual): no per-step Python work
    proportional to the parameter count beyond building the lists.
    """
    uniform = len(set(step_counts)) == 1
    storage = tuple((p.dtype, type(m), m.dtype) for p, m in zip(params, exp_avgs))  # e.g. changed by a load
    key = (tuple(map(id, layouts)), storage, hyper.weight_decay)
    cached = _schedules.get(layouts[0])
    if uniform and cached is not None and cached[0] == key:
        groups, plans = cached[1]
        return [(dtype, device, step_counts[0], slices) for dtype, device, slices in groups], plans
    plans = [_fused_plan(layout, hyper.weight_decay) for layout in layouts]
    members: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, m) in enumerate(zip(params, exp_avgs)):
        # Quantizing code is large: one small graph per parameter (as torchao does) compiles far faster.
        members[(p.dtype, p.device, type(m), m.dtype, step_counts[i]) + ((i,) if is_quantized(m) else ())].append(i)
    groups = []
    for (dtype, device, _, _, count, *_), indexes in members.items():
        signatures = [_signature(params[i], second_moments[i], means[i], indices[i], plans[i]) for i in indexes]
        groups.append((dtype, device, count, repeating_slices(indexes, signatures)))
    if uniform:
        _schedules[layouts[0]] = (key, ([(dtype, device, slices) for dtype, device, _, slices in groups], plans))
    return groups, plans


def _signature(p: Tensor, v: Tensor, mean: Optional[Tensor], index: Optional[Tensor], plan: _FusedPlan) -> tuple:
    """What a compiled graph is specialised on for one parameter (besides dtypes, shared by a group)."""
    return (
        tuple(p.shape),
        tuple(v.shape),
        None if mean is None else tuple(mean.shape),
        None if index is None else tuple(index.shape),
        plan,
    )
