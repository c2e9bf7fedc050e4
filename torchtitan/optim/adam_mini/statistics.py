"""Adam-mini's block statistics, shared by its back ends: mean(g**2) over every block, completed over the mesh
where a block is split between ranks, and a block's step scale broadcast onto the parameter's rows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchtitan.optim.adam_mini.layout import BlockLayout
from torchtitan.optim.adam_mini.partition import PER_HEAD, PER_ROW, PER_TENSOR
from torchtitan.optim.state.storage import at_least_float32


@dataclass(frozen=True)
class Hyper:
    """One step's hyperparameters, as every back end takes them."""

    lr: Union[float, Tensor]
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def stat_dtype(t: Tensor) -> torch.dtype:
    # Sums of squares in at least float32, whatever the gradient's dtype.
    return at_least_float32(t.dtype)


def _local_block_sums(grad: Tensor, layout: BlockLayout) -> Tensor:
    """This rank's sums of squared gradient entries: per local row (per_row) or per head (per_head), 1-D."""
    plan = layout.plan
    rows_2d = grad if grad.dim() == 2 else grad.flatten(1)
    row_sums = torch.linalg.vector_norm(rows_2d, dim=1, dtype=stat_dtype(grad)).square_()
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
    norms = torch._foreach_norm(grads, 2, dtype=stat_dtype(grads[0]))
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


def block_means(grads: list[Tensor], layouts: Sequence[BlockLayout]) -> list[Tensor]:
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


def per_row(scale: Tensor, param: Tensor, layout: BlockLayout) -> Tensor:
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
