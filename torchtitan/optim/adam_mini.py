"""Adam-mini: Adam with one second moment per block of rows, about half of AdamW's optimizer memory.

Usable on its own, and a drop-in for the authors' ``Adam_mini`` (v1.1.1) constructor::

    from torchtitan.optim import AdamMini
    optimizer = AdamMini(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                         dim=4096, n_heads=32, n_kv_heads=8)

The update for a parameter ``p`` with gradient ``g``, step ``t`` and blocks ``B`` (see ``partition.py``)::

    p <- p * (1 - lr * weight_decay)                          (matrices only; never norms, biases, vectors)
    m <- lerp(m, g, 1 - beta1)
    v[B] <- beta2 * v[B] + (1 - beta2) * mean(g[B] ** 2)
    p <- p - lr * (m / (1 - beta1**t)) / (sqrt(v[B] / (1 - beta2**t)) + eps)

Distributed training needs no code of its own: state is created like the parameter (a DTensor exactly when the
parameter is one), per-row statistics are local wherever rows are whole on a rank (FSDP2's ``Shard(0)``,
column-wise tensor parallelism), and the only communication is DTensor summing the tiny per-block sums of squares
over the mesh dimensions that split a block (heads cut by uneven FSDP shards, norms, row-wise TP): one all-reduce
per step under FSDP2 (plus, at the first step, a gather of where each rank's query/key rows sit). The state holds
``m`` (the parameter's shape), ``v`` (``(blocks, 1)``, or the parameter's shape for biases) and ``step``: nothing
that depends on the world size, so distributed checkpoints reshard exactly. The keys follow the authors' Adam-mini 1.1.1
(``m``; ``v``, which it calls ``vmean`` when blocked), not torch's ``exp_avg``/``exp_avg_sq``: ``v`` holds one entry
per block, not a per-element second moment.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torchtitan.errors import UserError
from torchtitan.models.roles import KEY, QUERY
from torchtitan.optim.compiled_slices import repeating_slices
from torchtitan.optim.hyperparameters import check_adam_hyperparameters
from torchtitan.optim.partition import (
    PER_ELEMENT,
    PER_HEAD,
    PER_ROW,
    PER_TENSOR,
    VALUE_BLOCK_CHOICES,
    BlockPlan,
    partition_summary,
    plan_blocks,
    unmatched_matrices,
)
from torchtitan.optim.state_storage import (
    BFLOAT16,
    FLOAT32,
    INT4,
    INT8,
    is_quantized,
    keep_bfloat16_on_load,
    new_state,
    read_state,
)
from torchtitan.utils import local_tensor

logger = logging.getLogger(__name__)

__all__ = ["AdamMini", "BlockLayout", "adam_mini_update", "layout_for", "new_second_moment"]


# ----------------------------------------------------------------------------------------------------------------
# Where a parameter's blocks live
# ----------------------------------------------------------------------------------------------------------------


def _split_dim(placement: Any) -> Optional[int]:
    """The tensor dimension a placement splits (``Shard`` or FSDP's strided shard), or None."""
    if placement.is_replicate() or placement.is_partial():
        return None
    return getattr(placement, "dim", None)


@dataclass(eq=False)
class BlockLayout:
    """A parameter's block plan plus, for a DTensor, the mesh facts the update needs.

    ``row_placements`` lay out per-row tensors (``v`` of per-row blocks): the parameter's placements with every
    split of a non-row dimension replaced by ``Replicate``, so a rank's rows of ``v`` are its rows of the parameter.
    ``sum_dims`` are the mesh dimensions over which this rank's block sums of squares are partial.
    """

    plan: BlockPlan
    mesh: Any = None
    row_placements: tuple = ()
    sum_dims: tuple[int, ...] = ()
    rows_split: bool = False  # some mesh dimension splits the rows
    _local_rows: Optional[Tensor] = None  # per_head with split rows: global index of each local row
    _local_blocks: Optional[Tensor] = None  # ... and the block (head) each local row belongs to
    _fused_schedule: Optional[tuple] = None  # (key, schedule) of the last fused step led by this parameter

    def local_rows(self, local: Tensor) -> Tensor:
        """Global index of each row of ``local`` (this rank's shard), found once.

        Every rank tags its rows with its coordinates and DTensor gathers the tags: a gather follows the layout
        FSDP2 really uses, which DTensor's own slicing of strided shards (FSDP x TP) does not always match when
        shards are uneven. Meta and fake tensors have no values to gather; their indices only need the shape.
        """
        if self._local_rows is None or self._local_rows.device != local.device:
            self._local_rows = self._find_local_rows(local)
            self._local_blocks = torch.div(self._local_rows, self.plan.rows_per_block, rounding_mode="floor")
        return self._local_rows

    def local_blocks(self, local: Tensor) -> Tensor:
        self.local_rows(local)
        return self._local_blocks

    def _find_local_rows(self, local: Tensor) -> Tensor:
        n_local = local.shape[0]
        if local.is_meta or isinstance(local, FakeTensor):
            return torch.arange(n_local, device=local.device)
        tag = 0
        for size, coordinate in zip(self.mesh.shape, self.mesh.get_coordinate()):
            tag = tag * size + coordinate
        tags = torch.full((n_local,), tag, dtype=torch.int64, device=local.device)
        everyone = DTensor.from_local(
            tags, self.mesh, self.row_placements, run_check=False, shape=(self.plan.rows,), stride=(1,)
        ).full_tensor()
        rows = (everyone == tag).nonzero().flatten()
        if rows.numel() != n_local:
            raise RuntimeError(f"{self.plan.name}: found {rows.numel()} of this rank's {n_local} rows")
        return rows


def layout_for(param: Tensor, plan: BlockPlan) -> BlockLayout:
    """The BlockLayout of ``param`` (a plain tensor or a DTensor on any mesh)."""
    if not isinstance(param, DTensor):
        return BlockLayout(plan)
    split = [_split_dim(placement) for placement in param.placements]
    row_placements = tuple(pl if dim == 0 else Replicate() for pl, dim in zip(param.placements, split))
    if plan.rule == PER_ROW:
        # A row is whole on a rank unless a mesh dimension splits its columns (row-wise tensor parallelism).
        sum_dims = tuple(i for i, dim in enumerate(split) if dim is not None and dim != 0)
    elif plan.rule in (PER_HEAD, PER_TENSOR):
        # A head or a whole tensor may be cut by any split.
        sum_dims = tuple(i for i, dim in enumerate(split) if dim is not None)
    else:
        sum_dims = ()
    return BlockLayout(plan, param.device_mesh, row_placements, sum_dims, rows_split=0 in split)


def new_second_moment(param: Tensor, layout: BlockLayout) -> Tensor:
    """Zeros for ``v``: the parameter's shape for per_element, else ``(blocks, 1)`` laid out for the update."""
    plan = layout.plan
    if plan.rule == PER_ELEMENT:
        return torch.zeros_like(param, memory_format=torch.preserve_format)
    shape = (plan.rows if plan.rule == PER_ROW else plan.n_blocks, 1)
    if not isinstance(param, DTensor):
        return param.new_zeros(shape)
    local_param = param.to_local()
    if plan.rule == PER_ROW:
        local_shape, placements = (local_param.shape[0], 1), layout.row_placements
    else:
        # A few entries per tensor: every rank keeps them all.
        local_shape, placements = shape, (Replicate(),) * layout.mesh.ndim
    local = torch.zeros(local_shape, dtype=param.dtype, device=local_param.device)
    return DTensor.from_local(local, layout.mesh, placements, run_check=False, shape=shape, stride=(1, 1))


# ----------------------------------------------------------------------------------------------------------------
# The update, as a function over lists
# ----------------------------------------------------------------------------------------------------------------


def _stat_dtype(t: Tensor) -> torch.dtype:
    # Sums of squares in at least float32, whatever the gradient's dtype.
    return torch.promote_types(t.dtype, torch.float32)


def _local_block_sums(grad: Tensor, layout: BlockLayout) -> Tensor:
    """This rank's sums of squared gradient entries: per local row (per_row) or per head (per_head), 1-D."""
    plan = layout.plan
    rows_2d = grad if grad.dim() == 2 else grad.flatten(1)
    row_sums = torch.linalg.vector_norm(rows_2d, dim=1, dtype=_stat_dtype(grad)).square_()
    if plan.rule == PER_ROW:
        return row_sums
    if layout.rows_split:
        # Uneven shards can cut a head between ranks: put local rows in their global places (zeros elsewhere) so
        # that every rank contributes a partial sum to every head, summed over the mesh afterwards.
        row_sums = row_sums.new_zeros(plan.rows).index_copy_(0, layout.local_rows(grad), row_sums)
    return row_sums.view(plan.n_blocks, plan.rows_per_block).sum(dim=1)


def _local_tensor_sums(grads: list[Tensor]) -> list[Tensor]:
    """Sums of squares of whole (local) tensors, batched."""
    if not grads:
        return []
    norms = torch._foreach_norm(grads, 2, dtype=_stat_dtype(grads[0]))
    return [norm.square().reshape(1) for norm in norms]


def _sum_over_shards(sums: list[Tensor], layouts: Sequence[BlockLayout]) -> list[Tensor]:
    """Complete partial block sums: one DTensor all-reduce per (mesh, split dimensions), not one per parameter.

    Local sums of all parameters split over the same mesh dimensions are concatenated and summed as one
    ``Partial`` DTensor. Along the summed dimensions every rank holds the same number of entries; the other mesh
    dimensions are labelled ``Replicate`` so that DTensor leaves them alone (their ranks may hold different rows,
    even different numbers of rows, which a ``Shard`` label would make DTensor re-chunk).
    """
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for index, layout in enumerate(layouts):
        if layout.sum_dims:
            buckets[(layout.mesh, layout.sum_dims)].append(index)
    completed = list(sums)
    for (mesh, sum_dims), indices in buckets.items():
        flat = torch.cat([sums[i] for i in indices])
        partial = [Partial() if d in sum_dims else Replicate() for d in range(mesh.ndim)]
        summed = [Replicate()] * mesh.ndim
        total = DTensor.from_local(flat, mesh, partial, run_check=False).redistribute(mesh, summed).to_local()
        for i, part in zip(indices, total.split([sums[i].numel() for i in indices])):
            completed[i] = part
    return completed


def _block_means(grads: list[Tensor], layouts: Sequence[BlockLayout]) -> list[Tensor]:
    """mean(g**2) over every block of every (block-ruled) parameter, shaped like the local ``v``: (n, 1)."""
    if not grads:
        return []
    sums: list[Optional[Tensor]] = [None] * len(grads)
    whole = [i for i, layout in enumerate(layouts) if layout.plan.rule == PER_TENSOR]
    for i, tensor_sum in zip(whole, _local_tensor_sums([grads[i] for i in whole])):
        sums[i] = tensor_sum
    for i, layout in enumerate(layouts):
        if sums[i] is None:
            sums[i] = _local_block_sums(grads[i], layout)
    sums = _sum_over_shards(sums, layouts)
    means = torch._foreach_div(sums, [float(layout.plan.block_numel) for layout in layouts])
    return [mean.view(-1, 1) for mean in means]


def _per_row(scale: Tensor, param: Tensor, layout: BlockLayout) -> Tensor:
    """A block's step scale broadcast onto the parameter's local rows."""
    plan = layout.plan
    if plan.rule == PER_HEAD:
        if layout.rows_split:
            scale = scale.index_select(0, layout.local_blocks(param))
        else:
            scale = scale.repeat_interleave(plan.rows_per_block, dim=0)
    if plan.rule == PER_TENSOR:
        return scale.reshape((1,) * param.dim())
    return scale.view((scale.shape[0],) + (1,) * (param.dim() - 1))


FOREACH, FUSED = "foreach", "fused"
IMPLEMENTATIONS = (FOREACH, FUSED)
MOMENTUM_STORAGES = (FLOAT32, BFLOAT16, INT8, INT4)


def adam_mini_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    steps: list[Tensor],
    layouts: list[BlockLayout],
    *,
    lr: Union[float, Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    implementation: str = FOREACH,
) -> None:
    """One Adam-mini step, in place, for parameters (plain tensors or DTensors) and their state.

    ``second_moments[i]`` is ``v`` as made by :func:`new_second_moment`; ``steps`` are 0-D float tensors;
    ``exp_avgs`` may be stored in any of ``state_storage``'s forms (float32, bfloat16, 8-/4-bit). Block statistics
    that are partial on this rank (split blocks, see :class:`BlockLayout`) are completed first, in one batched
    DTensor all-reduce; everything else is local and runs as foreach kernels or as compiled code
    (``implementation``), where block means, ``v`` and the update of a parameter are one graph.
    """
    params, grads = [local_tensor(p) for p in params], [local_tensor(g) for g in grads]
    exp_avgs, second_moments = [local_tensor(m) for m in exp_avgs], [local_tensor(v) for v in second_moments]
    if isinstance(lr, Tensor) and params and lr.device != params[0].device:
        lr = lr.to(params[0].device)  # foreach kernels take a tensor factor only on the tensors' device
    torch._foreach_add_(steps, 1)
    # Steps are CPU scalars: reading them costs no device synchronisation.
    step_counts = [step.item() for step in steps]
    hyper = _Hyper(lr, beta1, beta2, eps, weight_decay)
    if implementation == FUSED:
        _fused_update(params, grads, exp_avgs, second_moments, step_counts, layouts, hyper)
    else:
        _foreach_update(params, grads, exp_avgs, second_moments, step_counts, layouts, hyper)


@dataclass(frozen=True)
class _Hyper:
    lr: Union[float, Tensor]
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def _foreach_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    step_counts: list[float],
    layouts: list[BlockLayout],
    hyper: _Hyper,
) -> None:
    """The reference back end: foreach kernels over the lists, block statistics in their own pass."""
    beta1, beta2, eps, lr = hyper.beta1, hyper.beta2, hyper.eps, hyper.lr
    blocked = [i for i, layout in enumerate(layouts) if layout.plan.rule != PER_ELEMENT]
    elementwise = [i for i, layout in enumerate(layouts) if layout.plan.rule == PER_ELEMENT]
    bias_corrections1 = [1 - beta1**count for count in step_counts]
    bias_corrections2 = [1 - beta2**count for count in step_counts]

    # Second moments: block means of g**2 for matrices and vectors, g**2 itself for biases.
    if blocked:
        blocked_v = [second_moments[i] for i in blocked]
        torch._foreach_mul_(blocked_v, beta2)
        torch._foreach_add_(
            blocked_v, _block_means([grads[i] for i in blocked], [layouts[i] for i in blocked]), alpha=1 - beta2
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
        scales[i] = _per_row(scales[i], params[i], layouts[i])

    # m <- lerp(m, g, 1 - beta1); p <- p * decay - scale * m, with m read from and written back to its storage.
    # The new m is used unrounded; the stored one is rounded by the storage (bf16: to nearest).
    decayed = [p for p, layout in zip(params, layouts) if hyper.weight_decay != 0 and layout.plan.decay]
    if decayed:
        torch._foreach_mul_(decayed, 1 - lr * hyper.weight_decay)
    momenta = [read_state(m, p.dtype) for m, p in zip(exp_avgs, params)]  # m itself when stored like p
    torch._foreach_lerp_(momenta, grads, 1 - beta1)
    for stored, momentum in zip(exp_avgs, momenta):
        if momentum is not stored:
            stored.copy_(momentum)
    torch._foreach_addcmul_(params, momenta, scales, value=-1.0)


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
    if plan.rule == PER_TENSOR:
        return t.reshape(1, -1)
    if plan.heads:
        return t.reshape(plan.heads, -1)
    return t.reshape(t.shape[0], -1)


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

    ``scalars`` holds lr, 1 - beta1**t, 1 - beta2**t and 1 - lr * weight_decay (values that change every step
    enter as a tensor, so the graph is compiled once). Per parameter, the same math as the foreach back end::

        mean  = mean(g**2) over each block (or given)      v = beta2 * v + (1 - beta2) * mean
        scale = lr / (bc1 * (sqrt(v / bc2) + eps))        m = lerp(m, g, 1 - beta1)  (rounded into m's storage)
        p     = p * decay - scale * m

    ``m.to(p.dtype)`` of a quantized state dequantizes (torchao's tensors); ``copy_`` writes back, rounding or
    quantizing, so every storage shares this one expression.
    """
    lr, bias_correction1, bias_correction2, decay = scalars.unbind()
    for p, g, m, v, mean, index, plan in zip(params, grads, exp_avgs, second_moments, means, indices, plans):
        if plan.rule == PER_ELEMENT:
            v.copy_(v * beta2 + (g * g) * (1 - beta2))
        else:
            if mean is None:
                rows = _as_block_rows(g, plan).to(_stat_dtype(g))
                mean = (rows * rows).sum(dim=1, keepdim=True) / rows.shape[1]
            v.copy_(v * beta2 + mean * (1 - beta2))
        if p.numel() == 0:
            continue  # an empty shard still keeps its (replicated) v in step with the other ranks
        scale = lr / (bias_correction1 * ((v / bias_correction2).sqrt() + eps))
        if index is not None:
            scale = scale.index_select(0, index)
        momentum = m.to(p.dtype).lerp(g, 1 - beta1)
        m.copy_(momentum)
        kept = p * decay if plan.decays else p
        if plan.rule == PER_ELEMENT:
            p.copy_(kept - scale * momentum)
        else:
            p.copy_(kept - (scale.to(p.dtype) * _as_block_rows(momentum, plan)).reshape(p.shape))


# Inductor would recompute each row's scale (a sqrt and two divisions) for every entry of the row unless told to
# store results of more than a few operations; and the shapes are static, so the inputs' sizes need no checking.
# Measured on a 2-core CPU (benchmarks/bench_optimizers.py): 1.15x -> 0.99x fused AdamW at 99.5M parameters.
_compiled_fused_steps = torch.compile(
    _fused_steps, fullgraph=True, dynamic=False, options={"realize_opcount_threshold": 4, "size_asserts": False}
)


def _fused_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    step_counts: list[float],
    layouts: list[BlockLayout],
    hyper: _Hyper,
) -> None:
    """Compiled local steps over parameters sharing dtype, device, step and momentum storage.

    Shapes are static (the fastest code). Parameters are passed in slices that repeat (``repeating_slices``:
    one of each weight of a transformer layer), so a model compiles one graph per distinct slice, a few layers'
    worth however deep it is, and never again. Meta and fake tensors (memory estimates) run the same function
    eagerly, as does a step under a user's dispatch mode (debugging, CommDebugMode), which torch.compile cannot run
    under.
    """
    if not params:
        return
    partial = [i for i, layout in enumerate(layouts) if layout.plan.rule != PER_ELEMENT and layout.sum_dims]
    means: list[Optional[Tensor]] = [None] * len(params)
    for i, mean in zip(partial, _block_means([grads[i] for i in partial], [layouts[i] for i in partial])):
        means[i] = mean
    indices = [
        layout.local_blocks(p) if layout.plan.rule == PER_HEAD and layout.rows_split else None
        for p, layout in zip(params, layouts)
    ]
    schedule, plans = _schedule(params, exp_avgs, second_moments, means, indices, layouts, step_counts, hyper)
    dataless = any(p.is_meta or isinstance(p, FakeTensor) for p in params)
    run = _fused_steps if dataless or _get_current_dispatch_mode() is not None else _compiled_fused_steps
    from torchtitan.optim.torchao_adapter import separate_compile_cache

    lr = hyper.lr
    with torch._dynamo.utils.disable_cache_limit(), separate_compile_cache("AdamMini"):
        for dtype, device, count, slices in schedule:
            scalar_dtype = torch.promote_types(dtype, torch.float32)
            host = [1 - hyper.beta1**count, 1 - hyper.beta2**count]
            if isinstance(lr, Tensor):
                lr_t = lr.detach().to(device=device, dtype=scalar_dtype).reshape(1)
                rest = torch.tensor(host, dtype=scalar_dtype).to(device)
                scalars = torch.cat([lr_t, rest, 1 - lr_t * hyper.weight_decay])
            else:
                scalars = torch.tensor([lr] + host + [1 - lr * hyper.weight_decay], dtype=scalar_dtype).to(device)
            for part in slices:
                # Detached: the compiled graph sees plain tensors sharing the parameters' memory.
                run(
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


def _schedule(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    means: list[Optional[Tensor]],
    indices: list[Optional[Tensor]],
    layouts: list[BlockLayout],
    step_counts: list[float],
    hyper: _Hyper,
) -> tuple[list[tuple], list[_FusedPlan]]:
    """Groups (dtype, device, step, slices of parameter indices) and per-parameter plans for a fused step.

    They depend only on the parameters' layouts and storage, so they are worked out once and kept on the first
    layout while its step keeps the same parameters (all on one step count, as usual): no per-step Python work
    proportional to the parameter count beyond building the lists.
    """
    uniform = len(set(step_counts)) == 1
    storage = tuple((p.dtype, type(m), m.dtype) for p, m in zip(params, exp_avgs))  # e.g. changed by a load
    key = (tuple(map(id, layouts)), storage, hyper.weight_decay)
    cached = layouts[0]._fused_schedule
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
        layouts[0]._fused_schedule = (key, ([(dtype, device, slices) for dtype, device, _, slices in groups], plans))
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


# ----------------------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------------------


class AdamMini(torch.optim.Optimizer):
    """Adam-mini over ``named_parameters`` (``(name, parameter)`` pairs, e.g. ``model.named_parameters()``).

    Args:
        lr, betas, eps, weight_decay: as for AdamW; ``lr`` may be a float or a 0-D tensor. Weight decay is
            decoupled and applies to matrices only (norms, biases and other vectors never decay).
        dim, n_heads: the model's hidden size and query heads (required); n_kv_heads: key/value heads (default
            n_heads).
        head_dim: rows per query/key head, when it is not ``dim // n_heads``.
        value_blocks: ``"per_row"`` (default) or ``"per_tensor"`` (one block for each value weight; the authors'
            advice for runs shorter than about 10k steps).
        param_roles: ``{name: role}`` from the model (our Llama's ``named_param_roles()``); roles are embedding,
            output, query, key, value, attn_out, mlp, norm and bias. Names it lacks fall back to name rules.
        momentum_storage: how ``m`` is stored: ``"float32"`` (default: like the parameter), ``"bfloat16"``
            (rounded to nearest at every step), ``"int8"`` or ``"int4"`` (torchao's block-quantized state, one
            scale per ``block_size`` entries; tensors under 4096 entries stay float32). ``v`` is never rounded.
        implementation: ``"fused"`` (compiled local update, one graph per group of same-shaped parameters) or
            ``"foreach"``; unset picks fused, except for float64 parameters, which run foreach (the reference
            precision of our tests, where compile time buys nothing).
        model_sharding, verbose: accepted for compatibility with the official constructor; sharding is always
            handled, and ``verbose`` also logs one line per parameter.

    The partition is logged once at construction and available as ``self.partition`` (one BlockPlan per
    parameter, in order).
    """

    def __init__(
        self,
        named_parameters: Union[Iterable[tuple[str, Tensor]], Mapping[str, Tensor]],
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        dim: Optional[int] = None,
        n_heads: Optional[int] = None,
        n_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        value_blocks: str = PER_ROW,
        param_roles: Optional[Mapping[str, str]] = None,
        momentum_storage: str = FLOAT32,
        block_size: Optional[int] = None,
        implementation: Optional[str] = None,
        model_sharding: Optional[bool] = None,
        verbose: bool = False,
    ):
        del model_sharding  # always handled
        if momentum_storage not in MOMENTUM_STORAGES:
            raise UserError(
                f"AdamMini momentum_storage must be one of {', '.join(MOMENTUM_STORAGES)}, not {momentum_storage!r}"
            )
        if implementation not in (None,) + IMPLEMENTATIONS:
            raise UserError(
                f"AdamMini implementation must be one of {', '.join(IMPLEMENTATIONS)}, not {implementation!r}"
            )
        if block_size is not None and (
            momentum_storage not in (INT8, INT4) or block_size <= 0 or (momentum_storage == INT4 and block_size % 2)
        ):
            raise UserError(
                f"AdamMini block_size must be a positive (for int4: even) number and applies to int8/int4 "
                f"momentum only; got {block_size} with {momentum_storage}"
            )
        _check_hyperparameters(lr, betas, eps, weight_decay)
        head_dim, n_kv_heads = _check_heads(dim, n_heads, n_kv_heads, head_dim)
        if value_blocks not in VALUE_BLOCK_CHOICES:
            raise UserError(f"value_blocks must be one of {', '.join(VALUE_BLOCK_CHOICES)}, not {value_blocks!r}")
        named = _named_trainable(named_parameters)
        plans = plan_blocks(
            ((name, tuple(p.shape)) for name, p in named),
            head_dim=head_dim,
            value_blocks=value_blocks,
            param_roles=param_roles,
        )
        params = [p for _, p in named]
        super().__init__(
            params, dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay)
        )
        self.partition: list[BlockPlan] = plans
        self.momentum_storage, self.block_size, self.implementation = momentum_storage, block_size, implementation
        if momentum_storage == BFLOAT16:
            keep_bfloat16_on_load(self, ("m",))
        self._layouts: dict[Tensor, BlockLayout] = {p: layout_for(p, plan) for p, plan in zip(params, plans)}
        _log_partition(plans, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, verbose=verbose)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, second_moments, steps, layouts = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                layout = self._layouts[p]
                if not state:
                    self._init_state(p, state, layout)
                params.append(p)
                grads.append(_grad_like_param(p))
                exp_avgs.append(state["m"])
                second_moments.append(state["v"])
                steps.append(state["step"])
                layouts.append(layout)
            if params:
                beta1, beta2 = group["betas"]
                adam_mini_update(
                    params,
                    grads,
                    exp_avgs,
                    second_moments,
                    steps,
                    layouts,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    implementation=self._implementation_for(params),
                )
        return loss

    def _implementation_for(self, params: list[Tensor]) -> str:
        if self.implementation is not None:
            return self.implementation
        return FOREACH if params[0].dtype == torch.float64 else FUSED

    def _init_state(self, p: Tensor, state: dict, layout: BlockLayout) -> None:
        # A CPU scalar like AdamW's: its value stays readable on meta and fake parameters.
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["m"] = new_state(p, self.momentum_storage, self.block_size)
        state["v"] = new_second_moment(p, layout)


def _grad_like_param(p: Tensor) -> Tensor:
    grad = p.grad
    if grad.is_sparse:
        raise UserError("AdamMini does not support sparse gradients; use a dense embedding")
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def _named_trainable(named_parameters: Any) -> list[tuple[str, Tensor]]:
    items = list(named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters)
    for item in items:
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)
        ):
            raise UserError("AdamMini takes (name, parameter) pairs: pass model.named_parameters()")
    named = [(name, p) for name, p in items if p.requires_grad]
    if not named:
        raise UserError("AdamMini got no trainable parameters")
    return named


def _check_hyperparameters(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    check_adam_hyperparameters(_scalar_value(lr), betas, eps, weight_decay, keys=_ARGUMENT_NAMES)


# How AdamMini's errors name its constructor arguments.
_ARGUMENT_NAMES = {
    "lr": "AdamMini lr",
    "betas": "AdamMini betas",
    "beta1": "AdamMini betas[0]",
    "beta2": "AdamMini betas[1]",
    "eps": "AdamMini eps",
    "weight_decay": "AdamMini weight_decay",
}


def _scalar_value(value: Any) -> Optional[float]:
    """A float for a number or a real 1-element tensor; None where the value cannot be read (meta, fake)."""
    if not isinstance(value, Tensor):
        return float(value)
    if value.numel() != 1:
        raise UserError(f"AdamMini lr must be a number or a 1-element tensor, not shape {tuple(value.shape)}")
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - meta or fake tensors have no value to check
        return None


def _check_heads(dim: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any) -> tuple[int, int]:
    """(head_dim, n_kv_heads) after checking the model shape arguments."""
    if dim is None or n_heads is None:
        raise UserError("AdamMini needs the model's dim= and n_heads= (they size the query/key blocks)")
    for label, value in (("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value <= 0):
            raise UserError(f"AdamMini {label} must be a positive integer, got {value!r}")
    n_kv_heads = n_heads if n_kv_heads is None else int(n_kv_heads)
    if n_heads % n_kv_heads:
        raise UserError(f"AdamMini: n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if head_dim is None:
        if dim % n_heads:
            raise UserError(f"AdamMini: dim {dim} is not divisible by n_heads {n_heads}; pass head_dim=")
        head_dim = dim // n_heads
    return int(head_dim), n_kv_heads


def _log_partition(plans: list[BlockPlan], *, n_heads: int, n_kv_heads: int, head_dim: int, verbose: bool) -> None:
    logger.info(partition_summary(plans))
    if verbose:
        for plan in plans:
            logger.info("  %s %s: %s, %d blocks", plan.name, plan.shape, plan.rule, plan.n_blocks)
    unmatched = unmatched_matrices(plans)
    if unmatched:
        logger.warning(
            "AdamMini: no role for %d matrices (%s); they get one block per row. Pass param_roles={name: role} "
            "to choose.",
            len(unmatched),
            ", ".join(unmatched[:5]) + (" ..." if len(unmatched) > 5 else ""),
        )
    expected = {QUERY: n_heads * head_dim, KEY: n_kv_heads * head_dim}
    for plan in plans:
        if plan.role in expected and plan.rows != expected[plan.role]:
            logger.warning(
                "AdamMini: %s has %d rows, not %d heads x %d; check n_heads/n_kv_heads/head_dim",
                plan.name,
                plan.rows,
                expected[plan.role] // head_dim,
                head_dim,
            )
