"""estimation.py's CUDA mode against a real training step on this machine's GPU (skipped, saying so, without one).

The GPU figures of docs/memory.md come from this mode. Here one process trains the debug model on the GPU and the CUDA
allocator's own peak (``torch.cuda.max_memory_allocated``) over one step is compared with the estimate of that step.
One GPU allows one rank only, so FSDP's bf16 mixed precision is not part of this check (it needs 2 or more ranks).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from tests.helpers import DEBUG_CONFIG, debug_model, job_config, random_batches
from torchtitan.config.job_config import JobConfig
from torchtitan.estimation import estimate_memory
from torchtitan.training.step import train_step

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the estimate is compared with the CUDA allocator's peak"
)

VOCAB = 2048
OPTIMIZERS = ["AdamW", "AdamMini"]
# Left out by the estimate and real here: cuBLAS workspaces and similar fixed buffers (a few MiB, allocated through
# the caching allocator). The step's peak is 4-6.5 GiB, so they stay well under 1%.
TOLERANCE = 0.01


def _job(*overrides: str) -> JobConfig:
    return job_config(
        "--job.config_file",
        DEBUG_CONFIG,
        "--memory_estimation.device",
        "cuda",
        "--memory_estimation.world_size",
        "1",
        "--memory_estimation.vocab_size",
        str(VOCAB),
        "--memory_estimation.optimizers",
        ",".join(OPTIMIZERS),
        "--training.batch_size",
        "16",
        "--training.seq_len",
        "2048",
        *overrides,
    )


def _measured_peaks(job: JobConfig) -> dict[str, int]:
    """Peak allocated bytes of a real step (after a warm-up step that creates the state), per optimizer."""
    from torchtitan.optim import build_optimizers
    from torchtitan.parallelisms import ParallelDims

    device = torch.device("cuda", torch.cuda.current_device())
    dims = ParallelDims.from_job_config(job, 1)
    model = debug_model(job, VOCAB, None, dims, device)
    data = random_batches(job, VOCAB, 0)
    peaks = {}
    for name in OPTIMIZERS:
        named = copy.deepcopy(job)
        named.optimizer.name = name
        optimizers = build_optimizers([model], named)
        train_step(model, optimizers, data, dims, named, device)  # warm-up: creates the optimizer state
        for p in model.parameters():
            p.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, optimizers, data, dims, named, device)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated(device)
        del optimizers
        for p in model.parameters():
            p.grad = None
        gc.collect()
    return peaks


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_cuda_estimate_matches_the_allocators_peak(param_dtype):
    job = _job("--training.param_dtype", param_dtype)
    estimate = estimate_memory(job)
    measured = _measured_peaks(job)
    for o in estimate.optimizers:
        real = measured[o.optimizer]
        error = (o.peak - real) / real
        print(
            f"cuda {param_dtype} {o.optimizer}: estimated peak {o.peak / 2**30:.3f} GiB, measured "
            f"{real / 2**30:.3f} GiB ({100 * error:+.2f}%)"
        )
        assert real > 2**30  # big enough that fixed buffers cannot dominate the comparison
        assert abs(error) <= TOLERANCE, f"{o.optimizer}: estimate {o.peak} vs measured {real} ({error:+.4f})"
