"""Where a parameter's Adam-mini blocks live: its block plan plus, for a DTensor, the mesh facts the update needs.

The partition (``partition.py``) decides which rows share a second moment; this module places those blocks on a
rank's shard of the parameter (which of them are whole here, which are partial sums completed over the mesh) and
makes ``v`` laid out to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.distributed.utils import split_dim
from torchtitan.optim.adam_mini.partition import PER_ELEMENT, PER_HEAD, PER_ROW, PER_TENSOR, BlockPlan
from torchtitan.optim.state.storage import at_least_float32

__all__ = ["BlockLayout", "layout_for", "new_second_moment"]


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
    split = [split_dim(placement) for placement in param.placements]
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
    """Zeros for ``v`` (float32, float64 for float64 weights): the parameter's shape for per_element, else
    ``(blocks, 1)`` laid out for the update."""
    plan = layout.plan
    dtype = at_least_float32(param.dtype)  # never rounded to the weights' dtype
    if plan.rule == PER_ELEMENT:
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    shape = (plan.rows if plan.rule == PER_ROW else plan.n_blocks, 1)
    if not isinstance(param, DTensor):
        return param.new_zeros(shape, dtype=dtype)
    local_param = param.to_local()
    if plan.rule == PER_ROW:
        local_shape, placements = (local_param.shape[0], 1), layout.row_placements
    else:
        # A few entries per tensor: every rank keeps them all.
        local_shape, placements = shape, (Replicate(),) * layout.mesh.ndim
    local = torch.zeros(local_shape, dtype=dtype, device=local_param.device)
    return DTensor.from_local(local, layout.mesh, placements, run_check=False, shape=shape, stride=(1, 1))
