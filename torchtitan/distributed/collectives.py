"""Small collectives the loop needs besides DTensor's own: a scalar's sum/mean/max, and "is this true on any rank".

The rule that keeps multi-GPU runs alive: a collective runs on a tensor its group's backend can take. On GPUs the
world group and every device-mesh group are NCCL, which reduces CUDA tensors only (a CPU tensor stops the run), and
torch builds mesh groups by splitting the NCCL communicator, so they would not inherit a CPU backend given to the
world. Hence every helper here takes the ``device`` of the group it talks on and puts its tensor there: the training
device for the world and mesh groups, ``cpu`` for a group created with ``backend="gloo"`` (the checkpoint
manager's). ``tests/parallelisms/test_collectives.py`` checks over the source that no other module calls a collective
on a group of the training device.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce_scalar(
    value: float | torch.Tensor, op: str, group: Optional[dist.ProcessGroup], device: torch.device
) -> float:
    """Sum, mean or max of a scalar over ``group``, reduced on ``device`` in float64; the value itself when
    ``group`` is None (nothing to reduce over, e.g. no data parallelism) or there is no process group."""
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; one of {sorted(_OPS)}")
    # A Python number goes straight to float64: through torch's default float32 a time stamp or a byte count
    # would lose its low digits (a time of day to within about two minutes).
    value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
    t = value.detach().reshape(1).to(device=device, dtype=torch.float64, copy=True)
    if group is None or not dist.is_initialized():
        return float(t.item())
    dist.all_reduce(t, op=_OPS[op], group=group)
    if op == "mean":
        t /= dist.get_world_size(group)
    return float(t.item())


def any_rank(flag: bool | torch.Tensor, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank if ``flag`` (a bool, or a 0-d bool tensor left on its device) is true on any rank of
    ``group`` (the world when None); one host sync, after the all-reduce."""
    value = torch.as_tensor(flag).reshape(1).to(device=device, dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def any_rank_each(flags: torch.Tensor, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> list[bool]:
    """For each of ``flags`` (a 1-d bool tensor, left on its device), whether it is true on any rank of ``group``
    (the world when None): several questions in one all-reduce and one host sync."""
    values = flags.reshape(-1).to(device=device, dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in values.tolist()]


def all_reduce_sum_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum ``tensor`` (already on its group's device) over ``group`` in place; nothing without a group."""
    if group is not None and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise max of ``tensor`` (already on its group's device) over ``group`` in place; nothing without one."""
    if group is not None and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_objects(value: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """``value`` (any picklable object) of every rank of ``group``, in rank order; ``[value]`` without a group.

    torch pickles the objects into tensors on the current CUDA device under NCCL (``init_distributed`` sets it to
    the rank's own GPU) and on the CPU under gloo, so this is right on either backend.
    """
    if group is None or not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def set_collective_timeout(seconds: int, mesh, *groups: Optional[dist.ProcessGroup]) -> None:
    """From now on, ``seconds`` is the timeout of the default process group, of every group of ``mesh`` and of
    ``groups`` (groups made from the mesh that it does not list itself, such as HSDP's flattened data-parallel one).

    A barrier first, so that no rank still in its first step (under the longer start-up timeout) is cut short.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    mesh_groups = mesh.get_all_groups() if mesh is not None else []
    for group in [dist.group.WORLD, *mesh_groups, *(g for g in groups if g is not None)]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def first_step_timeouts(comm, mesh, *groups: Optional[dist.ProcessGroup]) -> int:
    """From now until the first step ends, ``comm.first_step_timeout_seconds`` for the training collectives (see
    :func:`set_collective_timeout`): ranks compile the optimizer's step and the blocks before their first
    collectives, some from warm caches, some cold. Returns the timeout set."""
    set_collective_timeout(comm.first_step_timeout_seconds, mesh, *groups)
    return comm.first_step_timeout_seconds


def training_timeouts(comm, mesh, *groups: Optional[dist.ProcessGroup]) -> int:
    """After the first step: ``comm.train_timeout_seconds``, else ``comm.init_timeout_seconds``. Returns it."""
    seconds = comm.train_timeout_seconds or comm.init_timeout_seconds
    set_collective_timeout(seconds, mesh, *groups)
    return seconds


def all_to_all(outbox: torch.Tensor, send_counts: list[int], receive_counts: list[int], group) -> torch.Tensor:
    """Send ``outbox``'s consecutive pieces of ``send_counts`` entries to the ranks of ``group`` in order and return
    what they sent here, ``receive_counts`` entries from each, in a 1-D tensor on ``outbox``'s own device (the
    weights' device: a CUDA tensor under NCCL)."""
    inbox = torch.empty(sum(receive_counts), dtype=outbox.dtype, device=outbox.device)
    dist.all_to_all_single(inbox, outbox, receive_counts, send_counts, group=group)
    return inbox
