"""Device, process-group and gradient helpers shared by the entry points."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.errors import UserError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def split_dim(placement) -> Optional[int]:
    """The tensor dimension a DTensor placement splits (``Shard`` or FSDP's strided shard), or None."""
    if placement.is_replicate() or placement.is_partial():
        return None
    return getattr(placement, "dim", None)


def grad_like_param(p: torch.Tensor, optimizer_name: str) -> torch.Tensor:
    """``p``'s dense gradient laid out as ``p`` (a DTensor gradient may come back with other placements)."""
    grad = p.grad
    if grad.is_sparse:
        raise UserError(f"{optimizer_name} does not support sparse gradients; use a dense embedding")
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


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
        timeout = timedelta(seconds=timeout_seconds)
        kwargs: dict = {"device_id": device} if backend == "nccl" else {}
        store = restart_scoped_store(world_size, timeout)
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return device, rank, world_size


# TensorFloat-32 tensor cores: Ampere (compute capability 8.0) and newer.
TF32_MIN_CAPABILITY = (8, 0)


def set_float32_matmul_precision(tf32: bool, device: torch.device) -> str:
    """Let float32 matmuls use TF32 (torch's "high" precision) when ``tf32`` and ``device`` is a GPU that has it;
    full float32 ("highest") otherwise. Returns the precision set."""
    has_tf32 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= TF32_MIN_CAPABILITY
    precision = "high" if tf32 and has_tf32 else "highest"
    torch.set_float32_matmul_precision(precision)
    return precision


def restart_scoped_store(world_size: int, timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, the agent's store seen through a prefix of this restart attempt; None elsewhere.

    torchrun's workers connect to the store of its agent, which outlives them: after ``--max-restarts`` restarts
    the group, the store still holds the addresses (gloo) or unique ids (NCCL) the previous attempt's ranks
    published under the same keys, and the new ranks would read those and connect to processes that are gone.
    Every key of this attempt's process groups lives under ``torchtitan/restart-<TORCHELASTIC_RESTART_COUNT>/``,
    which no earlier attempt wrote. (Each node's agent counts its own restarts; they agree as long as every failure
    fails the whole group, which a dead rank does by stopping its peers' collectives.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"torchtitan/restart-{attempt}", agent_store)


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
