"""Measurements the steps share: a model built and trained for a few steps on the device, its peaks beside
estimation.py's estimate."""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.gpu_check.context import GIB, Sizes


def _job(sizes: Sizes, flavor: str, *extra: str) -> JobConfig:
    argv = [
        "--model.flavor",
        flavor,
        "--training.batch_size",
        str(sizes.batch_size),
        "--training.seq_len",
        str(sizes.seq_len),
        "--training.compile",
        "false",  # eager unless the step asks for compile
        "--training.max_norm",
        "1.0",
        "--memory_estimation.world_size",
        "1",
        "--memory_estimation.vocab_size",
        str(sizes.vocab_size),
        "--memory_estimation.device",
        sizes.device.type,
        *extra,
    ]
    return JobConfig.parse_args(argv, prog="gpu_check")


def _random_batches(sizes: Sizes, vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (sizes.batch_size, sizes.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peaks(device: torch.device) -> dict[str, Any]:
    """Peak allocated and reserved GiB since the last reset (None on CPU: the allocator keeps no peaks there)."""
    if device.type != "cuda":
        return {"peak allocated GiB": None, "peak reserved GiB": None}
    return {
        "peak allocated GiB": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
        "peak reserved GiB": round(torch.cuda.max_memory_reserved(device) / GIB, 2),
    }


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


@dataclass
class _Model:
    job: JobConfig
    model: torch.nn.Module
    args: Any
    parallel_dims: Any
    flops_per_token: float


def build(sizes: Sizes, flavor: str, *extra: str) -> _Model:
    from torchtitan.config.preflight import model_args_for
    from torchtitan.parallelisms import ParallelDims
    from torchtitan.telemetry.metrics import model_flops_per_token
    from torchtitan.training.step import build_model, init_model

    job = _job(sizes, flavor, *extra)
    args = model_args_for(job, sizes.vocab_size)
    dims = ParallelDims.from_job_config(job, 1)
    model = build_model(job, args, dims, None, compute_device_type=sizes.device.type)
    init_model(model, sizes.device, job.training.seed)
    params = sum(p.numel() for p in model.parameters())
    return _Model(job, model, args, dims, model_flops_per_token(params, args, job.training.seq_len))


def _error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def train(built: _Model, spec: str, sizes: Sizes, steps: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """Warm-up then timed steps of ``spec``'s optimizer on ``built``; tokens/s, MFU and peaks of the timed steps,
    or ``fits: no`` when the GPU runs out of memory. The row names the optimizer step's implementation."""
    from torchtitan.estimation.simulate import job_for_optimizer, optimizer_choices, simulated_implementation
    from torchtitan.optim import build_optimizers
    from torchtitan.telemetry.metrics import peak_flops
    from torchtitan.training.step import train_step

    warmup, timed = steps or (sizes.warmup_steps, sizes.timed_steps)
    device = sizes.device
    job = job_for_optimizer(built.job, optimizer_choices(spec)[0], [])
    batches = _random_batches(sizes, built.args.vocab_size)
    optimizers = None
    row: dict[str, Any] = {"optimizer": spec, "implementation": simulated_implementation(job, device.type)}
    try:
        built.model.init_weights(seed=job.training.seed)
        optimizers = build_optimizers([built.model], job)
        for _ in range(warmup):
            train_step(built.model, optimizers, batches, built.parallel_dims, job, device)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(timed):
            loss, _, _ = train_step(built.model, optimizers, batches, built.parallel_dims, job, device)
        _sync(device)
        seconds = time.perf_counter() - start
        tps = sizes.batch_size * sizes.seq_len * timed / seconds
        peak = peak_flops(device)
        row.update(
            {
                "fits": "yes",
                "loss": round(float(loss), 4),
                "tokens/s": round(tps),
                "MFU %": round(100 * tps * built.flops_per_token / peak, 1) if peak else None,
                **_peaks(device),
            }
        )
    except Exception as e:  # noqa: BLE001 - the row says what happened; the next optimizer still runs
        if is_oom(e):
            row.update({"fits": "no (out of memory)", **_peaks(device)})
        else:
            row["fits"] = f"error: {_error_text(e)}"
    finally:
        del optimizers
        for p in built.model.parameters():
            p.grad = None
        free_memory(device)
    return row


def estimates(job: JobConfig, specs: list[str]) -> dict[str, Any]:
    """estimation.py's peaks (GiB, allocated and reserved) of each spec's step, the same job simulated on one rank,
    with the implementation it simulated; a spec whose estimate fails gets its error instead, and the others are
    still estimated."""
    from torchtitan.estimation import estimate_memory

    def run(chosen: list[str]) -> dict[str, Any]:
        simulated = copy.deepcopy(job)
        simulated.memory_estimation.optimizers = ",".join(chosen)
        estimate = estimate_memory(simulated)
        return {
            spec: {
                "GiB": round(o.peak / GIB, 2),
                # the caching allocator's peak under this process's PYTORCH_CUDA_ALLOC_CONF (CUDA only)
                "reserved GiB": round(o.reserved[0].peak_reserved / GIB, 2) if o.reserved else None,
                "implementation": o.implementation,
            }
            for spec, o in zip(chosen, estimate.optimizers)
        }

    try:
        return run(specs)
    except Exception:  # noqa: BLE001 - one optimizer's failure must not hide the others' estimates
        labels: dict[str, Any] = {}
        for spec in specs:
            try:
                labels.update(run([spec]))
            except Exception as e:  # noqa: BLE001
                labels[spec] = {"GiB": None, "error": _error_text(e)}
        return labels
