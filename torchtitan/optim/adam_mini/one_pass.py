"""Adam-mini's step for all its plain float tensors as one operator, ``torchtitan::adam_mini_step_``.

Registered through ``torch.library``: a fake kernel (so fake and meta tensors, estimation and ``torch.compile``
see it), a C++/OpenMP kernel for the CPU (``csrc/adam_mini_step.cpp``, built at first use, see ``cpu_build.py``) and
a Triton kernel for CUDA (``triton_step.py``). One call steps every float32 (or float64) parameter of a step with
plain momentum: per tensor, ``v`` of K entries is either K runs of consecutive entries whose mean of g**2 the kernel
takes itself, or updated from given block means (blocks partial on this rank, completed over the mesh beforehand)
with each row of the parameter reading its block's scale (``row_blocks[r]``, or block r). The fused back end
(``fused.py``) hands it what it covers and compiles graphs for the rest (bfloat16 or quantized momentum, bfloat16
weights, or a CPU without a C++ compiler).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from torchtitan.optim.adam_mini.layout import BlockLayout
from torchtitan.optim.adam_mini.statistics import Hyper
from torchtitan.optim.state.storage import is_quantized

logger = logging.getLogger(__name__)

OP_NAME = "torchtitan::adam_mini_step_"
DTYPES = (torch.float32, torch.float64)

_library = torch.library.Library("torchtitan", "FRAGMENT")
_library.define(
    "adam_mini_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] second_moments, "
    "Tensor?[] means, Tensor?[] row_blocks, int[] decays, Tensor scalars, float beta1, float beta2, float eps) -> ()"
)


@torch.library.register_fake(OP_NAME)
def _fake_step(params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps):
    return None  # in place: nothing to make


@torch.library.impl(OP_NAME, "CUDA")
def _cuda_step(params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps):
    from torchtitan.optim.adam_mini.triton_step import triton_step

    triton_step(params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps)


def adam_mini_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    means: list[Optional[Tensor]],
    row_blocks: list[Optional[Tensor]],
    decays: list[int],
    scalars: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """The operator: ``scalars`` holds lr, 1 - beta1**t, 1 - beta2**t and 1 - lr * weight_decay (float64)."""
    torch.ops.torchtitan.adam_mini_step_(
        params, grads, exp_avgs, second_moments, means, row_blocks, decays, scalars, beta1, beta2, eps
    )


_enabled = True


@contextlib.contextmanager
def compiled_graphs_only() -> Iterator[None]:
    """Within it, the fused back end leaves every tensor to its compiled graphs (benchmarks, tests of that path)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _dataless(t: Tensor) -> bool:
    return t.is_meta or isinstance(t, FakeTensor)


def kernel_available(device: torch.device) -> bool:
    """Whether the operator has a real kernel for ``device`` here (the CPU's is built, once, on first asking)."""
    if device.type == "cpu":
        from torchtitan.optim.adam_mini.cpu_build import load_cpu_kernel

        return load_cpu_kernel()
    if device.type == "cuda":
        from torchtitan.optim.adam_mini.triton_step import triton_available

        return triton_available()
    return False


def _covers(p: Tensor, g: Tensor, m: Tensor, v: Tensor, mean: Optional[Tensor]) -> bool:
    return (
        p.dtype in DTYPES
        and not is_quantized(m)
        and all(t.dtype == p.dtype for t in (g, m, v))
        and (mean is None or mean.dtype == p.dtype)
        and p.is_contiguous()
        and m.is_contiguous()
        and v.is_contiguous()
    )


def step_scalars(hyper: Hyper, count: float, device: torch.device) -> Tensor:
    """lr, 1 - beta1**t, 1 - beta2**t and 1 - lr * weight_decay, float64 on ``device``."""
    corrections = [1 - hyper.beta1**count, 1 - hyper.beta2**count]
    lr = hyper.lr
    if isinstance(lr, Tensor):
        lr_t = lr.detach().to(device=device, dtype=torch.float64).reshape(1)
        rest = torch.tensor(corrections, dtype=torch.float64).to(device)
        return torch.cat([lr_t, rest, 1 - lr_t * hyper.weight_decay])
    return torch.tensor([lr, *corrections, 1 - lr * hyper.weight_decay], dtype=torch.float64).to(device)


def one_pass_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    second_moments: Sequence[Tensor],
    means: Sequence[Optional[Tensor]],
    row_blocks: Sequence[Optional[Tensor]],
    layouts: Sequence[BlockLayout],
    step_counts: Sequence[float],
    hyper: Hyper,
) -> list[int]:
    """Step every parameter the operator covers, one call per (dtype, device, step); the indices it left.

    ``means[i]`` are given block means (else None) and ``row_blocks[i]`` each local row's block (per-head blocks
    on split rows), as the fused back end works them out; everything is local (plain tensors).
    """
    if not _enabled:
        return list(range(len(params)))
    groups: dict[tuple, list[int]] = defaultdict(list)
    left = []
    usable: dict[torch.device, bool] = {}
    for i, (p, g, m, v, mean) in enumerate(zip(params, grads, exp_avgs, second_moments, means)):
        if not _covers(p, g, m, v, mean):
            left.append(i)
            continue
        if not _dataless(p) and p.device not in usable:
            usable[p.device] = kernel_available(p.device)
        if _dataless(p) or usable[p.device]:
            groups[(p.dtype, p.device, step_counts[i])].append(i)
        else:
            left.append(i)
    for (_, device, count), members in groups.items():
        adam_mini_step_(
            [params[i] for i in members],
            [grads[i].contiguous() for i in members],
            [exp_avgs[i] for i in members],
            [second_moments[i] for i in members],
            [means[i] for i in members],
            [row_blocks[i] for i in members],
            [int(hyper.weight_decay != 0 and layouts[i].plan.decay) for i in members],
            step_scalars(hyper, count, device),
            hyper.beta1,
            hyper.beta2,
            hyper.eps,
        )
    return left
