"""The Triton kernel of Adam-mini's one-pass operator, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``) at small shapes: every kind of block (means taken in the kernel, given means with and
without a row's block index, per-element, rows longer than a program's chunk, an empty shard) equals the CPU
kernel to a few ulp, for both of lerp's forms. The interpreter is chosen when Triton is imported, so the kernels run
in a process of their own. A GPU times the kernel in ``scripts/gpu_check.sh``."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.processes import run
from torchtitan.optim.adam_mini import cpu_build, one_pass

ULPS = 4  # float32 ulps of each tensor's largest entry
BETA1S = (0.9, 0.3)  # lerp's two forms


def _case(seed: int) -> tuple:
    """(params, grads, momenta, second moments, means, row blocks, decays) of every kind."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    def positive(*shape):
        return torch.rand(*shape, generator=generator) + 0.1

    shapes = [
        # (param shape, v shape, given means, row blocks)
        ((6, 10), (6, 1), False, None),  # per row
        ((8, 10), (2, 1), False, None),  # per head, heads whole
        ((10,), (1, 1), False, None),  # per tensor
        ((7,), (7,), False, None),  # per element
        ((2, 2500), (2, 1), False, None),  # rows longer than a program's chunk
        ((6, 10), (3, 1), True, [0, 0, 1, 1, 1, 2]),  # per head, rows split unevenly: given means
        ((4, 10), (4, 1), True, None),  # per row, columns split: given means
        ((10,), (1, 1), True, None),  # per tensor, split: given mean
        ((0, 10), (1, 1), True, None),  # an empty shard keeps v in step
    ]
    params, grads, momenta, seconds, means, row_blocks = [], [], [], [], [], []
    for shape, v_shape, given, blocks in shapes:
        params.append(rand(*shape))
        grads.append(rand(*shape))
        momenta.append(rand(*shape) * 0.1)
        seconds.append(positive(*v_shape) * 0.01)
        means.append(positive(*v_shape) if given else None)
        row_blocks.append(torch.tensor(blocks) if blocks else None)
    decays = [i % 2 for i in range(len(shapes))]
    return params, grads, momenta, seconds, means, row_blocks, decays


def _on(device: str, case: tuple) -> tuple:
    return tuple([t.to(device) if isinstance(t, torch.Tensor) else t for t in items] for items in case)


def compare(beta1: float, device: str = "cpu") -> dict:
    """Both kernels on the same case (Triton's on ``device``): the largest difference in ulps, and whether every
    parameter moved."""
    from torchtitan.optim.adam_mini.triton_step import triton_step

    assert cpu_build.load_cpu_kernel()
    scalars = torch.tensor([1e-2, 1 - beta1**3, 1 - 0.95**3, 1 - 1e-3], dtype=torch.float64)
    expected, actual = _case(0), _on(device, _case(0))
    one_pass.adam_mini_step_(*expected, scalars, beta1, 0.95, 1e-8)
    triton_step(*actual, scalars.to(device), beta1, 0.95, 1e-8)
    actual = _on("cpu", actual)
    worst = 0.0
    for kind in range(4):  # params, grads (unchanged), momenta, second moments
        for a, b in zip(actual[kind], expected[kind]):
            if b.numel():
                worst = max(worst, ((a - b).abs().max() / (b.abs().max() * torch.finfo(torch.float32).eps)).item())
    moved = all(not torch.equal(p, q) for p, q in zip(expected[0], _case(0)[0]) if p.numel())
    return {"ulps": worst, "moved": moved}


def test_triton_kernel_equals_the_cpu_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = run([sys.executable, "-m", "tests.optim.test_adam_mini_triton"], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    print(results)
    for beta1 in BETA1S:
        assert results[str(beta1)]["moved"]
        assert results[str(beta1)]["ulps"] <= ULPS, beta1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_on_a_gpu_equals_the_cpu_kernel():
    for beta1 in BETA1S:
        result = compare(beta1, "cuda")
        assert result["moved"] and result["ulps"] <= ULPS, (beta1, result)


if __name__ == "__main__":
    print(json.dumps({str(beta1): compare(beta1) for beta1 in BETA1S}))
