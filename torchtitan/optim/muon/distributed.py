"""Newton–Schulz for sharded matrices: each matrix made whole on one rank, orthogonalised there once, sent back.

Muon orthogonalises every hidden matrix as a whole, while FSDP2, tensor parallelism or both leave each rank a piece
of it. This module owns all of Muon's communication. The ranks that split a matrix (its *group*: the mesh
dimensions whose placements shard it, e.g. FSDP's ranks, TP's, or both) share the work round-robin: the ``j``-th
matrix of a group (counting all its matrices, whether or not they have a gradient this step) is owned by group rank
``j mod S``, and the matrices go in rounds of at most ``S``, one per owner. In a round

1. every rank sends its pieces of the round's matrices to their owners (one ``all_to_all_single``),
2. each owner assembles its matrix and runs Newton–Schulz on it,
3. each owner sends every rank its piece of the result (a second ``all_to_all_single``).

SOAP sends its matrices through the same rounds (``transform_sharded``): its owner keeps the matrix's SOAP state
and returns the update's direction instead of an orthogonalised matrix.

So every matrix is orthogonalised once per group (not on every rank), a rank holds at most one whole matrix (plus
the iteration's temporaries) at a time, and a step costs ``2 * ceil(M / S)`` collectives for the ``M`` matrices of
a group, each rank sending and receiving about ``2 N / S`` entries for the group's ``N`` entries in all, in the
Newton–Schulz dtype (bfloat16 by default: casting a piece commutes with assembling the matrix). Gathering every
matrix on every rank instead would receive ``N (S - 1) / S`` entries per rank and repeat all ``M`` iterations on
each. HSDP replicas each hold the same pieces and do their group's work alike (their gradients are already equal).

Where a rank's rows and columns sit in the whole matrix is found once per matrix by gathering small tags (as
Adam-mini finds its query/key rows): that follows the layout FSDP2 really uses, uneven and strided shards
included. Every collective runs on the parameters' own device, so NCCL gets CUDA tensors.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.distributed.collectives import all_to_all
from torchtitan.distributed.utils import split_dim

__all__ = ["ShardedMatrix", "sharded_matrix", "transform_sharded"]


def _on_vector(placement: Any, dim: int) -> Any:
    """``placement`` for a vector indexing dimension ``dim`` of the matrix: the same split, or Replicate."""
    if split_dim(placement) != dim:
        return Replicate()
    if dim == 0:
        return placement
    split_factor = getattr(placement, "split_factor", None)
    return Shard(0) if split_factor is None else type(placement)(0, split_factor=split_factor)


@dataclass(eq=False)
class ShardedMatrix:
    """Where the pieces of one 2-D DTensor live: per rank of its group, the global rows and columns it holds."""

    shape: tuple[int, int]
    group: Any  # the process group of the ranks that split the matrix
    rows: list[Tensor]  # rows[k]: global row indices of group rank k's piece, ascending, on the parameter's device
    cols: list[Tensor]

    @property
    def group_size(self) -> int:
        return len(self.rows)

    def piece_numel(self, group_rank: int) -> int:
        return self.rows[group_rank].numel() * self.cols[group_rank].numel()


# Process groups over several mesh dimensions, made once per (mesh, dimensions).
_GROUPS: dict[tuple, Any] = {}


def _group_over(mesh: Any, dims: tuple[int, ...]) -> Any:
    """The process group of this rank's neighbours along mesh dimensions ``dims`` (all other coordinates equal)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    key = (mesh, dims)
    if key not in _GROUPS:
        others = [d for d in range(mesh.ndim) if d not in dims]
        with unset_fake_temporarily():  # the mesh's rank table is real, also in a memory estimate's fake mode
            ranks = mesh.mesh.permute(*others, *dims).reshape(-1, math.prod(mesh.mesh.shape[d] for d in dims))
            ranks = ranks.tolist()
        mine = None
        # Every rank creates every group, in the same order, as torch.distributed requires.
        for members in ranks:
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


def _coordinates(mesh: Any, global_rank: int) -> list[int]:
    with unset_fake_temporarily():
        return [int(c) for c in (mesh.mesh == global_rank).nonzero()[0]]


def _combined(coordinates: list[int], dims: list[int], mesh_shape: tuple[int, ...]) -> int:
    tag = 0
    for d in dims:
        tag = tag * mesh_shape[d] + coordinates[d]
    return tag


def sharded_matrix(param: DTensor) -> Optional[ShardedMatrix]:
    """Where ``param``'s pieces live, or None when no mesh dimension splits it (every rank holds it whole)."""
    mesh, placements = param.device_mesh, param.placements
    split = [split_dim(placement) for placement in placements]
    # A mesh dimension of one rank splits nothing.
    dims = tuple(d for d, s in enumerate(split) if s is not None and mesh.shape[d] > 1)
    if not dims:
        return None
    group = _group_over(mesh, dims)
    size = dist.get_world_size(group)
    local = param.to_local()
    if local.is_meta or is_fake(local):
        # No values to gather: every piece is taken to be this rank's shape (memory estimates need only sizes).
        rows = [torch.arange(local.shape[0], device=local.device)] * size
        cols = [torch.arange(local.shape[1], device=local.device)] * size
        return ShardedMatrix(tuple(param.shape), group, rows, cols)
    coordinates = [_coordinates(mesh, dist.get_global_rank(group, k)) for k in range(size)]
    rows = _pieces_along(param, 0, [d for d in dims if split[d] == 0], coordinates)
    cols = _pieces_along(param, 1, [d for d in dims if split[d] == 1], coordinates)
    return ShardedMatrix(tuple(param.shape), group, rows, cols)


def _pieces_along(param: DTensor, dim: int, dims: list[int], coordinates: list[list[int]]) -> list[Tensor]:
    """Per group rank, the global indices along ``dim`` that its piece holds (ascending)."""
    mesh = param.device_mesh
    local = param.to_local()
    length = param.shape[dim]
    if not dims:
        whole = torch.arange(length, device=local.device)
        return [whole] * len(coordinates)
    mine = _combined(_coordinates(mesh, dist.get_rank()), dims, mesh.shape)
    tags = torch.full((local.shape[dim],), mine, dtype=torch.int64, device=local.device)
    placements = [_on_vector(placement, dim) for placement in param.placements]
    everyone = DTensor.from_local(tags, mesh, placements, run_check=False, shape=(length,), stride=(1,)).full_tensor()
    by_tag: dict[int, Tensor] = {}
    pieces = []
    for coordinate in coordinates:
        tag = _combined(coordinate, dims, mesh.shape)
        if tag not in by_tag:
            by_tag[tag] = (everyone == tag).nonzero().flatten()
        pieces.append(by_tag[tag])
    found = (everyone == mine).sum().item()
    if found != local.shape[dim]:
        raise RuntimeError(f"found {found} of this rank's {local.shape[dim]} indices along dimension {dim}")
    return pieces


def transform_sharded(
    pieces: list[Tensor],
    matrices: list[ShardedMatrix],
    transform: Callable[[int, Tensor], Tensor],
    dtype: torch.dtype,
    ordinals: Optional[list[int]] = None,
) -> list[Tensor]:
    """``transform(i, whole)`` run by the owner of each whole matrix ``i`` whose local pieces are ``pieces[i]``;
    returns the local pieces of the results (in ``dtype``, shaped like ``pieces``).

    The owner rounds above; ``transform`` is called on the owning rank only, so state it keeps for matrix ``i``
    lives there alone (SOAP's preconditioners). Matrix ``i`` is owned by group rank ``ordinals[i] mod S``:
    ``ordinals[i]`` is its position among all the matrices of its group, so that its owner stays the same on a
    step where some of them have no gradient (None: the position among ``matrices``). Every rank of a group must
    pass that group's matrices in the same order, with the same ordinals.
    """
    results: list[Optional[Tensor]] = [None] * len(pieces)
    by_group: dict[Any, list[int]] = defaultdict(list)
    for index, matrix in enumerate(matrices):
        by_group[matrix.group].append(index)
    for group, indices in by_group.items():
        size = matrices[indices[0]].group_size
        by_owner: list[list[int]] = [[] for _ in range(size)]
        for position, index in enumerate(indices):
            ordinal = position if ordinals is None else ordinals[index]
            by_owner[ordinal % size].append(index)
        for round_index in range(max(len(owned) for owned in by_owner)):
            owners = [owned[round_index] if round_index < len(owned) else None for owned in by_owner]
            _round(owners, pieces, matrices, group, transform, dtype, results)
    return results


def _round(
    owners: list[Optional[int]],
    updates: list[Tensor],
    matrices: list[ShardedMatrix],
    group: Any,
    transform: Callable[[int, Tensor], Tensor],
    dtype: torch.dtype,
    results: list[Optional[Tensor]],
) -> None:
    """One round: group rank k owns matrix ``owners[k]`` (None: none this round); pieces go to owners, results
    come back."""
    me, size = dist.get_rank(group), dist.get_world_size(group)
    present = [i for i in owners if i is not None]
    device = updates[present[0]].device
    pieces_out = [updates[i].to(dtype).reshape(-1) for i in present]
    sent = [updates[i].numel() if i is not None else 0 for i in owners]
    owned = matrices[owners[me]] if owners[me] is not None else None
    received = [owned.piece_numel(q) for q in range(size)] if owned is not None else [0] * size
    inbox = all_to_all(torch.cat(pieces_out), sent, received, group)
    if owned is not None:
        whole = torch.empty(owned.shape, dtype=dtype, device=device)
        for q, piece in enumerate(inbox.split(received)):
            whole[owned.rows[q].unsqueeze(1), owned.cols[q]] = piece.view(owned.rows[q].numel(), owned.cols[q].numel())
        result = transform(owners[me], whole).to(dtype)
        del whole
        outbox = torch.cat([result[owned.rows[q].unsqueeze(1), owned.cols[q]].reshape(-1) for q in range(size)])
        del result
    else:
        outbox = torch.empty(0, dtype=dtype, device=device)
    returned = all_to_all(outbox, received, sent, group)
    for i, piece in zip(owners, returned.split(sent)):
        if i is not None:
            results[i] = piece.view(updates[i].shape)
