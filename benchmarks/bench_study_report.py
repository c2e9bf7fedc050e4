"""How long ``--report-only`` takes over a big finished sweep: the study page must come back in seconds.

    python benchmarks/bench_study_report.py                      # 200 runs x 1,000 logged steps, metrics.jsonl
    python benchmarks/bench_study_report.py --event-files        # the same runs also as TensorBoard event files

Builds a made-up sweep folder (4 optimizers x 10 lrs x 5 seeds by default; every step logs the trainer's tags,
validation every 50 steps; each run has its dataset.json and sweep_status.json), then times
``python -m torchtitan.tools.sweep --dump-folder DIR --report-only`` in a fresh process, as a user runs it (Python
start, imports, reading, statistics, four figures, study.html). The target is 30 s on a 2-core machine. With
``--event-files`` the same runs are written as event files only and timed again: the ratio is what reading
metrics.jsonl saves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("AdamW", "AdamMini", "Muon", "AdamW8bit")
TOKENS_PER_STEP = 2048


def run_scalars(optimizer: int, lr_index: int, seed: int, steps: int) -> list[dict]:
    """The trainer's tags at every step of one made-up run: loss falling as a power of the step, best at lr 5."""
    floor = 2.0 + 0.05 * optimizer + 0.02 * abs(lr_index - 5) + 0.003 * seed
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss_metrics/global_avg_loss": floor + 8.0 * step**-0.5 + 0.01 * math.sin(step + seed),
            "grad_norm": 1.0 + 1.0 / step,
            "lr": 1e-3,
            "throughput/tps": 1000.0 + 10.0 * seed,
            "throughput/tokens_seen": float(step * TOKENS_PER_STEP),
            "memory/rss(GiB)": 0.6,
        }
        if step == 1:
            record["optimizer/state_bytes"] = float(2**20 * (optimizer + 1))
        if step % 50 == 0:
            record["validation/loss"] = floor + 8.0 * step**-0.5
        records.append(record)
    return records


def build(dump: Path, runs: int, steps: int, event_files: bool) -> None:
    lrs = [10 ** (-4 + 0.25 * i) for i in range(10)]
    cells = [(o, i, s) for o in range(len(OPTIMIZERS)) for i in range(len(lrs)) for s in range(5)][:runs]
    for o, i, s in cells:
        from torchtitan.study.plan import RunSpec

        spec = RunSpec(OPTIMIZERS[o], lrs[i], s)
        log_dir = dump / "runs" / spec.name / "tb" / f"20260101-000000_{spec.optimizer}"
        log_dir.mkdir(parents=True)
        records = run_scalars(o, i, s, steps)
        if event_files:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(log_dir), max_queue=10000)
            for record in records:
                for tag, value in record.items():
                    if tag != "step":
                        writer.add_scalar(tag, value, record["step"])
            writer.close()
        else:
            (log_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (log_dir / "dataset.json").write_text(
            json.dumps({"fingerprint": "f" * 16, "source": "made up", "data_seed": 0})
        )
        status = {"optimizer": spec.optimizer, "lr": spec.lr, "seed": s, "outcome": "finished", "exit_code": 0}
        status.update(command="made up", seconds=1.0, ended=float(o))
        (dump / "runs" / spec.name / "sweep_status.json").write_text(json.dumps(status))


def time_report(dump: Path) -> tuple[float, float]:
    """Wall-clock seconds and CPU seconds (user + system) of one --report-only process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torchtitan.tools.sweep", "--dump-folder", str(dump), "--report-only"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not (dump / "study.html").is_file():
        sys.exit(f"--report-only failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=1000, help="logged steps per run")
    parser.add_argument("--event-files", action="store_true", help="also time the same runs as event files only")
    parser.add_argument("--target", type=float, default=30.0, help="seconds the report may take (default 30)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "jsonl"
        build(jsonl, args.runs, args.steps, event_files=False)
        seconds, cpu = time_report(jsonl)
        load = os.getloadavg()[0]
        print(
            f"--report-only over {args.runs} runs x {args.steps} logged steps (metrics.jsonl): {seconds:.1f} s wall, "
            f"{cpu:.1f} s CPU ({seconds / args.target:.2f} of the {args.target:.0f} s target; load average "
            f"{load:.1f} on {os.cpu_count()} cores: a loaded machine stretches the wall time, not the CPU time)"
        )
        if args.event_files:
            events = Path(tmp) / "events"
            build(events, args.runs, args.steps, event_files=True)
            event_seconds, event_cpu = time_report(events)
            print(
                f"the same runs as event files only: {event_seconds:.1f} s wall, {event_cpu:.1f} s CPU "
                f"({event_cpu / cpu:.1f}x the CPU time)"
            )


if __name__ == "__main__":
    main()
