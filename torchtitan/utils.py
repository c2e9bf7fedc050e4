"""Device, process-group and gradient helpers shared by the entry points."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_distributed(timeout_seconds: int) -> tuple[torch.device, int, int]:
    """Pick CUDA + NCCL when GPUs are present, else CPU + gloo; returns (device, rank, world size).

    A plain ``python train.py`` (no torchrun) runs as a single process without a process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds), **kwargs)
    return device, rank, world_size


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensor or plain), clipping them to ``max_norm`` when it is positive.

    DTensor gradients yield a partial norm per shard; ``full_tensor`` turns it into the global norm.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def all_reduce_scalar(value: torch.Tensor, op: str, group: Optional[dist.ProcessGroup]) -> float:
    """Mean or max of a scalar over a process group (the value itself when there is none)."""
    if group is None or not dist.is_initialized():
        return float(value.item())
    t = value.detach().reshape(1).to(torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    if op == "mean":
        t /= dist.get_world_size(group)
    return float(t.item())


def set_collective_timeout(seconds: int, mesh) -> None:
    """From now on, ``seconds`` is the timeout of the default process group and of every group of ``mesh``.

    A barrier first, so that no rank still in its first step (under the longer start-up timeout) is cut short.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    groups = [dist.group.WORLD, *(mesh.get_all_groups() if mesh is not None else [])]
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
