"""The CUDA kernel of ``torchtitan::adam_mini_step_``: one Triton launch for every tensor of a dtype.

The launch's programs are listed in a table of (tensor, row) pairs: a program steps one block of rows (its mean of
g**2 taken first, then the update; the second read of g comes from cache) or, for per-element tensors, one chunk of
entries. Each tensor's addresses and facts sit in a second table, so one launch reads any number of tensors.
Blocks with given means (partial on this rank) have ``v`` updated by two foreach calls before the launch, since
the programs that read a block's ``v`` cannot also be the ones that write it; their rows then read ``v`` only.
The arithmetic follows the foreach back end's order, as the CPU kernel's does. Under ``TRITON_INTERPRET=1`` the same
kernel runs on CPU tensors (tests/optim/test_adam_mini_triton.py); ``scripts/gpu_check.sh`` times it on a GPU.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

BLOCK = 1024  # entries a program reads at a time
# How each tensor's v is found (the kernel's `kind`): block means taken in the kernel, v already updated from given
# means, per-element.
BLOCK_MEANS, GIVEN_MEANS, ELEMENTS = 0, 1, 2
FIELDS = 8  # a tensor's facts: p, g, m, v, row_blocks (or 0), row width, kind, decays


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton imports and a CUDA device is present."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def triton_step(
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
    """The operator's arguments (all tensors of one dtype on one device), stepped in one launch."""
    import triton.language as tl

    if not params:
        return
    given = [i for i, mean in enumerate(means) if mean is not None]
    if given:
        vs = [second_moments[i] for i in given]
        torch._foreach_mul_(vs, beta2)
        torch._foreach_add_(vs, [means[i].reshape(vs[k].shape) for k, i in enumerate(given)], alpha=1 - beta2)
    facts, programs = [], []
    for i, (p, v) in enumerate(zip(params, second_moments)):
        numel, blocks = p.numel(), v.numel()
        index = row_blocks[i]
        if means[i] is None and numel == blocks:
            kind, rows, width = ELEMENTS, triton_cdiv(numel, BLOCK), numel
        elif means[i] is None:
            kind, rows, width = BLOCK_MEANS, blocks, numel // max(blocks, 1)
        else:
            rows = index.numel() if index is not None else blocks
            kind, width = GIVEN_MEANS, numel // max(rows, 1)
        if numel == 0:
            continue
        facts.append(
            [
                p.data_ptr(),
                grads[i].data_ptr(),
                exp_avgs[i].data_ptr(),
                v.data_ptr(),
                0 if index is None else index.data_ptr(),
                width,
                kind,
                decays[i],
            ]
        )
        programs.extend(x for row in range(rows) for x in (len(facts) - 1, row))
    if not programs:
        return
    device = params[0].device
    tensors = torch.tensor(facts, dtype=torch.int64).to(device)
    table = torch.tensor(programs, dtype=torch.int64).to(device)
    dtype = tl.float32 if params[0].dtype == torch.float32 else tl.float64
    # lr, 1 - beta1**t, 1 - beta2**t, 1 - lr * weight_decay, then beta2, 1 - beta2, 1 - beta1 and eps (float64).
    constants = torch.tensor([beta2, 1 - beta2, 1 - beta1, eps], dtype=torch.float64).to(device)
    all_scalars = torch.cat([scalars.to(torch.float64).reshape(-1), constants])
    from torchtitan.optim.adam_mini.triton_kernel import adam_mini_step_kernel

    adam_mini_step_kernel[(len(programs) // 2,)](
        table, tensors, all_scalars, FIELDS=FIELDS, DTYPE=dtype, BLOCK=BLOCK, SMALL=abs(1 - beta1) < 0.5
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
