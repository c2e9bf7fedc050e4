"""Training tokens/s and peak memory of the chunked loss (``loss.num_chunks``) against whole logits, in one process.

    python benchmarks/bench_loss.py                                   # debug model (train_configs/debug_model.toml)
    python benchmarks/bench_loss.py --chunks 1,4,8 --rounds 30
    python benchmarks/bench_loss.py --device cuda --job.config_file train_configs/llama3_8b.toml \\
        --n_layers 2                                                  # 8B shapes, 2 blocks (~1.5B parameters)

The whole training step (``torchtitan.training.step.train_step``: forward, loss, backward, clipping, AdamW step) of the
job's model on random tokens, one process, no parallelism. The variants take turns, one step each per round; the
ratio is the median over rounds of whole logits' step time divided by the variant's in the same round (> 1: faster).
Peak memory: on CUDA the allocator's peak allocated bytes of one step; on CPU the peak of live tensor bytes
(``torchtitan.estimation.LiveMemoryTracker``), each measured after every variant has run a step, so that the
optimizer state exists before (as in every step after the first) and no variant's peak includes its creation.
Other options are ``train.py``'s (``--section.key value``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.config.preflight import model_args_for  # noqa: E402
from torchtitan.estimation.simulate import vocab_size  # noqa: E402
from torchtitan.estimation.tracker import LiveMemoryTracker  # noqa: E402
from torchtitan.optim import build_optimizers  # noqa: E402
from torchtitan.parallelisms import ParallelDims  # noqa: E402
from torchtitan.parallelisms.parallelize_llama import mixed_precision_mode  # noqa: E402
from torchtitan.training.step import build_model, init_model, train_step  # noqa: E402

GIB = 2**30


def random_batches(job: JobConfig, vocab: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (job.training.batch_size, job.training.seq_len + 1)
    while True:
        tokens = torch.randint(0, vocab, shape, device=device, generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One model and optimizer; ``step(num_chunks)`` runs a training step with that many loss chunks."""

    def __init__(self, job: JobConfig, n_layers: Optional[int], device: torch.device) -> None:
        notes: list[str] = []
        vocab = vocab_size(job, notes)
        args = model_args_for(job, vocab)
        if n_layers is not None:
            args = dataclasses.replace(args, n_layers=n_layers)
        self.job, self.device = job, device
        self.dims = ParallelDims(1, 1, 1, 1)
        model = build_model(job, args, self.dims, None, compute_device_type=device.type)
        self.model = init_model(model, device, job.training.seed)
        self.optimizers = build_optimizers([self.model], job)
        self.batches = random_batches(job, vocab, device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.tokens = job.training.batch_size * job.training.seq_len * job.training.gradient_accumulation_steps

    def step(self, num_chunks: int) -> float:
        """Seconds of one training step."""
        self.job.loss.num_chunks = num_chunks
        _synchronize(self.device)
        start = time.perf_counter()
        train_step(self.model, self.optimizers, self.batches, self.dims, self.job, self.device)
        _synchronize(self.device)
        return time.perf_counter() - start

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            value
            for optimizer in self.optimizers.optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]

    def peak_bytes(self, num_chunks: int) -> int:
        """Peak memory of one step (see the module's docstring)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step(num_chunks)
            return torch.cuda.max_memory_allocated(self.device)
        tracker = LiveMemoryTracker()
        tracker.track_existing(self.model.parameters(), "params")
        tracker.track_existing(self.state_tensors(), "optimizer state")
        with tracker:
            self.step(num_chunks)
        return tracker.peak


def measure_peaks(trainer: Trainer, chunks: list[int]) -> dict[int, int]:
    """Each variant's peak of a steady step: one step of every variant first (creating the optimizer state)."""
    for n in chunks:
        trainer.step(n)
    return {n: trainer.peak_bytes(n) for n in chunks}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunks", default="1,8", help="comma-separated loss.num_chunks; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n_layers", type=int, default=None, help="override the flavor's number of blocks")
    options, job_argv = parser.parse_known_args(argv)
    if not any(a.startswith("--job.config_file") for a in job_argv):
        job_argv = ["--job.config_file", "train_configs/debug_model.toml", *job_argv]
    job = JobConfig.parse_args(job_argv, prog="bench_loss.py")
    chunks = [int(c) for c in options.chunks.split(",")]
    device = torch.device(options.device)
    trainer = Trainer(job, options.n_layers, device)
    t = job.training
    compute = t.mixed_precision_param if mixed_precision_mode(trainer.dims, job, device.type) else t.param_dtype
    print(
        f"{job.model.flavor} ({trainer.params / 1e9:.2f}B parameters), batch {t.batch_size} x {t.seq_len}, "
        f"{job.optimizer.name}, {t.param_dtype} weights, {compute} compute, "
        f"activation checkpointing {job.activation_checkpoint.mode}, on {device}"
    )
    peaks = measure_peaks(trainer, chunks)
    for _ in range(options.warmup):
        for n in chunks:
            trainer.step(n)
    times: dict[int, list[float]] = {n: [] for n in chunks}
    for _ in range(options.rounds):
        for n in chunks:
            times[n].append(trainer.step(n))
    baseline = chunks[0]
    print(f"{'loss.num_chunks':>15} {'tokens/s':>10} {'vs ' + str(baseline):>8} {'peak GiB':>9}")
    for n in chunks:
        ratio = statistics.median(b / x for b, x in zip(times[baseline], times[n]))
        tokens_per_s = trainer.tokens / statistics.median(times[n])
        print(f"{n:>15} {tokens_per_s:>10.0f} {ratio:>7.3f}x {peaks[n] / GIB:>9.3f}")


if __name__ == "__main__":
    main()
