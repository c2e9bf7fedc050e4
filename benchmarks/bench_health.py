"""The step-time cost of optimizer health (``metrics.health_freq``) at its default frequency, as one ratio.

    python benchmarks/bench_health.py                       # the debug model (train_configs/debug_model.toml)
    python benchmarks/bench_health.py --rounds 20 --health-freq 10
    python benchmarks/bench_health.py --job.config_file train_configs/llama3_8b.toml ...   # any train.py options

One process, the job's model and optimizer, random batches, the very training step train.py runs. Each round
times one plain step and one measured step (health due: per-group sums, a copy of the weights around the optimizer
step, attention logits, their reduction), in alternating order; the extra time of a measured step, spread over the
``health_freq`` steps it stands for, plus the loss-spike bookkeeping (every step, and its reduction every
``metrics.log_freq`` steps), gives the overhead:

    ratio = 1 + (median measured - median plain + spikes per step x health_freq) / (health_freq x median plain)

With health off (``metrics.health_freq 0``) nothing is measured: no collective, no copy, ratio 1 by construction.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.config.preflight import preflight  # noqa: E402
from torchtitan.errors import UserError, exit_code  # noqa: E402
from torchtitan.optim import build_optimizers  # noqa: E402
from torchtitan.telemetry.health import LossSpikes, OptimizerHealth  # noqa: E402
from torchtitan.training.step import build_model, init_model, train_step  # noqa: E402

DEBUG_CONFIG = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_model.toml")


def batches(job: JobConfig, vocab_size: int, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    t = job.training
    while True:
        tokens = torch.randint(0, vocab_size, (t.batch_size, t.seq_len + 1), generator=generator)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def measure(job: JobConfig, rounds: int, device: torch.device) -> dict[str, float]:
    dims, model_args, _ = preflight(job, 1)
    model = init_model(build_model(job, model_args, dims, None), device, job.training.seed)
    optimizers = build_optimizers([model], job)
    freq = job.metrics.health_freq or JobConfig().metrics.health_freq
    health = OptimizerHealth([model], freq, job.metrics.health_max_layers, device)
    spikes = LossSpikes(job.metrics.loss_spike_factor, job.metrics.loss_spike_window, device)
    data = batches(job, model_args.vocab_size, device)

    def timed(step: int, probe) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss, _, updated = train_step(model, optimizers, data, dims, job, device, None, step, probe)
        if probe is not None:
            probe.metrics(job.optimizer.lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    for step in range(1, 3):  # warm-up: first-step allocations and the optimizer's state
        timed(step, None)
    plain, measured = [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for on in order:
            (measured if on else plain).append(timed(freq if on else freq + 1, health if on else None))
    loss = torch.tensor(3.0, dtype=torch.float64, device=device)
    started = time.perf_counter()
    for _ in range(rounds):
        for _ in range(job.metrics.log_freq):
            spikes.record(loss, True)
        spikes.metrics()
    spikes_per_step = (time.perf_counter() - started) / (rounds * job.metrics.log_freq)
    plain_s, measured_s = statistics.median(plain), statistics.median(measured)
    extra = measured_s - plain_s + spikes_per_step * freq
    return {
        "freq": freq,
        "plain_s": plain_s,
        "measured_s": measured_s,
        "spikes_per_step_s": spikes_per_step,
        "ratio": 1 + extra / (freq * plain_s),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="plain and measured steps timed, each")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, train_args = parser.parse_known_args(argv)
    if args.rounds < 1:
        raise UserError("--rounds must be at least 1")
    if not any(a.startswith("--job.config_file") for a in train_args):
        train_args = ["--job.config_file", DEBUG_CONFIG, "--metrics.log_freq", "10", *train_args]
    job = JobConfig.parse_args(train_args)
    device = torch.device(args.device)
    result = measure(job, args.rounds, device)
    print(
        f"health every {result['freq']} steps ({device.type}, {job.model.flavor}, batch {job.training.batch_size} x "
        f"{job.training.seq_len}): plain step {result['plain_s'] * 1e3:.1f} ms, measured step "
        f"{result['measured_s'] * 1e3:.1f} ms, loss spikes {result['spikes_per_step_s'] * 1e6:.1f} us/step"
    )
    print(f"step-time overhead at health_freq {result['freq']}: ratio {result['ratio']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(lambda: main(sys.argv[1:])))
