"""Learning-rate sweeps for fair optimizer comparisons: every optimizer at its own best lr.

    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --optimizers AdamW,AdamMini --lrs 3e-4,1e-3,3e-3 \\
        [--seeds 0,1] [--nproc N] [--config-file X.toml] [--last-k 10] -- [train.py options]
    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --report-only

Every (optimizer, lr, seed) runs once through ``run_llama_train.sh`` with the same config and options, in its own
folder ``{dump}/runs/{Optimizer}_lr{lr}_seed{seed}`` (its TensorBoard logs, checkpoints and ``train.log``). After a
run ends the sweep writes ``sweep_status.json`` into that folder: the exit code, the command and the outcome:

* ``finished`` - exit 0 with finite losses;
* ``diverged`` - exit 3 (train.py stopped on non-finite loss or gradients) or a non-finite logged loss;
* ``failed``   - any other exit. The sweep goes on with the other runs and exits 1 at the end (2 for a mistake in
  the options, which stops it at once).

Finished and diverged runs are never run again: running the same command again resumes an interrupted sweep where
it stopped (failed and interrupted runs start again; with checkpointing on they resume from their own checkpoint),
and adding optimizers, lrs or seeds extends it. The report - ``sweep.png``, ``sweep.md``, ``sweep.json`` in the dump
folder - ranks each lr by the last ``validation/loss`` when every run logs one, else by the mean of the last k
logged training losses; with several seeds it gives their mean and standard deviation. Each optimizer's best lr is
the one with the lowest mean among those where no seed diverged or failed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.guard import DIVERGENCE_EXIT_CODE
from torchtitan.tools.compare_runs import (
    EVENT_FILE_PREFIX,
    GRAD_NORM,
    LOSS,
    MEMORY_TAGS,
    STATE_BYTES,
    TPS,
    Series,
    first_non_finite_step,
    read_scalars,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "./train_configs/debug_model.toml"
VALIDATION_LOSS = "validation/loss"
RUNS_FOLDER = "runs"
STATUS_FILE = "sweep_status.json"
SETTINGS_FILE = "sweep_settings.json"
LOCK_FILE = "sweep.lock"
LOG_FILE = "train.log"
REPORT_NAME = "sweep"  # sweep.png, sweep.md, sweep.json
DIVERGED_EXIT_CODE = DIVERGENCE_EXIT_CODE  # train.py stopped: the loss or the gradients became non-finite
USER_ERROR_EXIT_CODE = 2
FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
# Options each run gets from the sweep itself; setting them in the shared options would make every run the same.
SWEEP_OPTIONS = {
    "optimizer.name": "--optimizers",
    "optimizer.lr": "--lrs",
    "training.seed": "--seeds",
    "job.dump_folder": "--dump-folder",
}


# ----------------------------------------------------------------------------------------------------------------
# The plan


def lr_label(lr: float) -> str:
    """A short, exact name for a learning rate: 3e-4, 1e-3, 2.5e-4, 1e6."""
    mantissa, exponent = f"{lr:.12e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


@dataclass(frozen=True)
class RunSpec:
    optimizer: str  # canonical name, as train.py logs it
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{lr_label(self.lr)}_seed{self.seed}"


def _items(raw: str) -> list[str]:
    return [item for item in re.split(r"[,\s]+", raw.strip()) if item]


def parse_lrs(raw: str) -> list[float]:
    lrs = []
    for item in _items(raw):
        try:
            lr = float(item)
        except ValueError:
            raise UserError(f"learning rate '{item}' is not a number; give LRS like '3e-4 1e-3 3e-3'") from None
        if not (math.isfinite(lr) and lr > 0):
            raise UserError(f"learning rate '{item}' must be a positive number")
        lrs.append(lr)
    return lrs


def parse_seeds(raw: str) -> list[int]:
    if not all(item.isdigit() for item in _items(raw)):
        raise UserError(f"seeds '{raw}' must be non-negative integers, like '0 1 2'")
    return [int(item) for item in _items(raw)]


def plan(optimizers: Sequence[str], lrs: Sequence[float], seeds: Sequence[int]) -> list[RunSpec]:
    """Every combination, optimizer-major; names resolved as train.py does (``adam_mini`` is AdamMini)."""
    from torchtitan.optim.builder import resolve_optimizer_name

    for what, values in (("optimizers", optimizers), ("lrs", lrs), ("seeds", seeds)):
        if not values:
            raise UserError(f"the sweep needs at least one of {what}; set {what.upper()} (space- or comma-separated)")
    names = [resolve_optimizer_name(name).name for name in optimizers]
    specs = [RunSpec(o, lr, seed) for o in names for lr in lrs for seed in seeds]
    run_names = [s.name for s in specs]
    repeated = sorted({n for n in run_names if run_names.count(n) > 1})
    if repeated:
        raise UserError(f"the sweep lists a run twice ({', '.join(repeated)}); give each optimizer, lr and seed once")
    return specs


def check_train_options(train_args: Sequence[str]) -> None:
    for arg in train_args:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in SWEEP_OPTIONS:
            raise UserError(
                f"--{key} is set by the sweep for each run; remove it from the train.py options and use "
                f"{SWEEP_OPTIONS[key]} (or the matching variable of scripts/compare_optimizers.sh)"
            )


def _spec_options(spec: RunSpec) -> list[str]:
    """The train.py options a run's spec sets."""
    return ["--optimizer.name", spec.optimizer, "--optimizer.lr", repr(spec.lr), "--training.seed", str(spec.seed)]


def run_command(spec: RunSpec, run_dir: Path, train_args: Sequence[str], launcher: Sequence[str]) -> list[str]:
    options = ["--metrics.enable_tensorboard", "true", *_spec_options(spec), "--job.dump_folder", str(run_dir)]
    return [*launcher, *train_args, *options]


def preflight_jobs(specs: Sequence[RunSpec], config_file: str, nproc: int, train_args: Sequence[str]) -> None:
    """Check each optimizer's job as train.py will, so that a mistake stops the sweep before any run starts."""
    from torchtitan.config_manager import JobConfig
    from torchtitan.preflight import preflight

    checked = set()
    for spec in specs:
        if spec.optimizer in checked:
            continue
        checked.add(spec.optimizer)
        config = JobConfig.parse_args(["--job.config_file", config_file, *train_args, *_spec_options(spec)])
        preflight(config, nproc)  # the optimizer's name and options included


def check_settings(dump: Path, settings: dict) -> None:
    """A dump folder holds one sweep: the same config, process count and options for every run in it."""
    path = dump / SETTINGS_FILE
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded != settings:
            changed = ", ".join(k for k in settings if recorded.get(k) != settings[k])
            raise UserError(
                f"'{dump}' holds a sweep run with other settings ({changed} differ; see {path}); "
                "use a new dump folder, or the same config, process count and options to resume it"
            )
        return
    path.write_text(json.dumps(settings, indent=2) + "\n")


def lock_sweep(dump: Path):
    """Hold the dump folder for this sweep alone (two sweeps in one folder would train the same runs twice)."""
    dump.mkdir(parents=True, exist_ok=True)
    lock = open(dump / LOCK_FILE, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(
            f"another sweep is running in '{dump}'; wait for it to end, or use another dump folder"
        ) from None
    return lock


# ----------------------------------------------------------------------------------------------------------------
# Running


def read_status(run_dir: Path) -> Optional[dict]:
    path = run_dir / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def run_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar the run logged, over all its TensorBoard folders (a restarted run has several); later wins."""

    def started(folder: Path) -> int:
        # Event files are named events.out.tfevents.{unix time}.{host}...; the oldest one dates the folder.
        return min(int(p.name.split(".")[3]) for p in folder.iterdir() if p.name.startswith(EVENT_FILE_PREFIX))

    folders = {p.parent for p in run_dir.rglob(f"{EVENT_FILE_PREFIX}*") if p.is_file()}
    merged: dict[str, dict[int, float]] = {}
    for folder in sorted(folders, key=lambda f: (started(f), f.name)):
        for tag, series in read_scalars(folder).items():
            merged.setdefault(tag, {}).update(zip(series.steps, series.values))
    return {tag: Series(tuple(sorted(v)), tuple(v[s] for s in sorted(v))) for tag, v in merged.items()}


def diverged_at_step(scalars: dict[str, Series]) -> Optional[int]:
    """The first step with a non-finite training or validation loss, or where the non-finite gradient norms that a
    run ended with began (the divergence guard skipped its last updates: a saturated model can keep a finite loss
    while its gradients are NaN); None for a run that did not diverge."""
    steps = [first_non_finite_step(scalars[tag]) for tag in (LOSS, VALIDATION_LOSS) if tag in scalars]
    grad_norms = scalars.get(GRAD_NORM)
    if grad_norms is not None and grad_norms.values and not math.isfinite(grad_norms.values[-1]):
        start = len(grad_norms.values) - 1
        while start > 0 and not math.isfinite(grad_norms.values[start - 1]):
            start -= 1
        steps.append(grad_norms.steps[start])
    return min((step for step in steps if step is not None), default=None)


def outcome(exit_code: int, scalars: dict[str, Series]) -> str:
    if exit_code == DIVERGED_EXIT_CODE:
        return DIVERGED
    if exit_code != 0:
        return FAILED
    if diverged_at_step(scalars) is not None:
        return DIVERGED
    return FINISHED if LOSS in scalars else FAILED


def _last_error_line(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1].strip()


def _stop(process: subprocess.Popen) -> None:
    """End the launcher and everything it started (torchrun forwards SIGTERM to its workers)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def train_one(spec: RunSpec, run_dir: Path, command: list[str], env: dict) -> dict:
    """Run one job to its end, log to ``train.log``, and record the outcome in ``sweep_status.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(run_dir / LOG_FILE, "ab") as log:
        log.write(f"\n$ {shlex.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            exit_code = process.wait()
        except BaseException:  # interrupted: leave no marker, so that the next sweep runs it again
            _stop(process)
            raise
    scalars = run_scalars(run_dir)
    status = {
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        "outcome": outcome(exit_code, scalars),
        "exit_code": exit_code,
        "command": shlex.join(command),
        "seconds": round(time.time() - started, 1),
        "ended": time.time(),
    }
    if status["outcome"] == DIVERGED and exit_code == 0:
        status["message"] = f"non-finite loss logged at step {diverged_at_step(scalars)}"
    elif status["outcome"] != FINISHED:
        status["message"] = _last_error_line(run_dir / LOG_FILE)
    tmp = run_dir / f"{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(status, indent=2) + "\n")
    tmp.replace(run_dir / STATUS_FILE)
    return status


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_sweep(
    specs: Sequence[RunSpec],
    dump: Path,
    config_file: str,
    nproc: int,
    train_args: Sequence[str],
    launcher: Sequence[str],
) -> list[dict]:
    """Run every spec not yet finished or diverged; returns the status of each spec, in order."""
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": config_file}
    statuses = []
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for index, spec in enumerate(specs, 1):
            run_dir = dump / RUNS_FOLDER / spec.name
            head = f"[{index}/{len(specs)}] {spec.name}:"
            status = read_status(run_dir)
            if status is not None and status["outcome"] in (FINISHED, DIVERGED):
                print(f"{head} {status['outcome']} earlier, skipped", flush=True)
                statuses.append(status)
                continue
            print(f"{head} training (log: {run_dir / LOG_FILE})", flush=True)
            status = train_one(spec, run_dir, run_command(spec, run_dir, train_args, launcher), env)
            message = f" ({status['message']})" if "message" in status else ""
            print(
                f"{head} {status['outcome']}, exit {status['exit_code']}, {status['seconds']:.0f} s{message}",
                flush=True,
            )
            statuses.append(status)
            if status["exit_code"] == USER_ERROR_EXIT_CODE:
                raise UserError(f"{spec.name} stopped on a mistake in its options: {status['message']}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return statuses


# ----------------------------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    status: dict
    scalars: dict[str, Series]


def load_results(dump: Path) -> list[RunResult]:
    """Every run in the dump folder that ended (has a status); optimizers in the order they first ended (the
    sweep's order), then by lr and seed."""
    results = []
    for status_path in sorted((dump / RUNS_FOLDER).glob(f"*/{STATUS_FILE}")):
        status = json.loads(status_path.read_text())
        spec = RunSpec(status["optimizer"], float(status["lr"]), int(status["seed"]))
        results.append(RunResult(spec, status, run_scalars(status_path.parent)))
    first_ended: dict[str, float] = {}
    for r in results:
        first_ended[r.spec.optimizer] = min(first_ended.get(r.spec.optimizer, math.inf), r.status["ended"])
    return sorted(results, key=lambda r: (first_ended[r.spec.optimizer], r.spec.optimizer, r.spec.lr, r.spec.seed))


def _mean_std(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def run_summary(result: RunResult, last_k: int, by_validation: bool) -> dict:
    s, status = result.scalars, result.status
    loss = s.get(LOSS)
    memory_tag = next((t for t in MEMORY_TAGS if t in s), None)
    summary = {
        "name": result.spec.name,
        "optimizer": result.spec.optimizer,
        "lr": result.spec.lr,
        "seed": result.spec.seed,
        "outcome": status["outcome"],
        "exit_code": status["exit_code"],
        "message": status.get("message"),
        "last_step": loss.steps[-1] if loss else None,
        "diverged_at_step": diverged_at_step(s),
        "train_loss": None,
        "validation_loss": None,
        "rank_loss": None,
        "mean_tps": _mean_std(s[TPS].values)[0] if TPS in s else None,
        "peak_memory_gib": max(s[memory_tag].values) if memory_tag else None,
        "peak_memory_tag": memory_tag,
        "optimizer_state_bytes": int(round(s[STATE_BYTES].values[-1])) if STATE_BYTES in s else None,
    }
    if status["outcome"] == FINISHED:
        summary["train_loss"] = _mean_std(loss.values[-last_k:])[0]
        if VALIDATION_LOSS in s:
            summary["validation_loss"] = s[VALIDATION_LOSS].values[-1]
        summary["rank_loss"] = summary["validation_loss"] if by_validation else summary["train_loss"]
    return summary


def summarize_sweep(results: Sequence[RunResult], last_k: int) -> dict:
    """Per run, per (optimizer, lr) over seeds, and per optimizer its best lr."""
    finished = [r for r in results if r.status["outcome"] == FINISHED]
    by_validation = bool(finished) and all(VALIDATION_LOSS in r.scalars for r in finished)
    runs = [run_summary(r, last_k, by_validation) for r in results]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in runs))
    grid, best = [], {}
    for optimizer in optimizers:
        mine = [r for r in runs if r["optimizer"] == optimizer]
        cells = []
        for lr in sorted({r["lr"] for r in mine}):
            group = [r for r in mine if r["lr"] == lr]
            outcomes = [r["outcome"] for r in group]
            outcome_ = DIVERGED if DIVERGED in outcomes else FAILED if FAILED in outcomes else FINISHED
            mean, std = _mean_std([r["rank_loss"] for r in group if r["outcome"] == FINISHED])
            cells.append(
                {
                    "optimizer": optimizer,
                    "lr": lr,
                    "seeds": sorted(r["seed"] for r in group),
                    "outcome": outcome_,
                    "runs_diverged": outcomes.count(DIVERGED),
                    "runs_failed": outcomes.count(FAILED),
                    "loss_mean": mean if outcome_ == FINISHED else None,
                    "loss_std": std if outcome_ == FINISHED else None,
                }
            )
        grid.extend(cells)
        candidates = [c for c in cells if c["outcome"] == FINISHED and c["loss_mean"] is not None]
        winner = min(candidates, key=lambda c: c["loss_mean"], default=None)
        completed = [r for r in mine if r["outcome"] == FINISHED]
        tps = [r["mean_tps"] for r in completed if r["mean_tps"] is not None]
        memory = [r["peak_memory_gib"] for r in completed if r["peak_memory_gib"] is not None]
        state = [r["optimizer_state_bytes"] for r in mine if r["optimizer_state_bytes"] is not None]
        best[optimizer] = {
            "lr": winner["lr"] if winner else None,
            "loss_mean": winner["loss_mean"] if winner else None,
            "loss_std": winner["loss_std"] if winner else None,
            "seeds": winner["seeds"] if winner else [],
            # Throughput and memory do not depend on the lr: taken over all the optimizer's finished runs.
            "mean_tps": _mean_std(tps)[0],
            "min_tps": min(tps, default=None),
            "max_tps": max(tps, default=None),
            "peak_memory_gib": max(memory, default=None),
            "peak_memory_tag": next((r["peak_memory_tag"] for r in mine if r["peak_memory_tag"]), None),
            "optimizer_state_bytes": max(state, default=None),
        }
    ranked_by = f"last {VALIDATION_LOSS}" if by_validation else f"mean of the last {last_k} logged training losses"
    return {
        "ranked_by": ranked_by,
        "by_validation": by_validation,
        "last_k": last_k,
        "runs": runs,
        "grid": grid,
        "best": best,
    }


def _loss_text(mean: Optional[float], std: Optional[float], n: int) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f} ({n} seeds)"


def _cell_text(cell: dict, runs: Sequence[dict]) -> str:
    if cell["outcome"] == FINISHED:
        return _loss_text(cell["loss_mean"], cell["loss_std"], len(cell["seeds"]))
    bad = [
        r
        for r in runs
        if r["optimizer"] == cell["optimizer"] and r["lr"] == cell["lr"] and r["outcome"] == cell["outcome"]
    ]
    count = f" {len(bad)}/{len(cell['seeds'])} seeds" if len(cell["seeds"]) > 1 else ""
    if cell["outcome"] == DIVERGED:
        steps = sorted(r["diverged_at_step"] for r in bad if r["diverged_at_step"] is not None)
        return f"diverged{count}" + (f" (step {steps[0]})" if steps else "")
    return f"failed{count} (exit {', '.join(str(r['exit_code']) for r in bad)})"


def format_markdown(report: dict) -> str:
    best, grid, runs = report["best"], report["grid"], report["runs"]
    rss = any(b["peak_memory_tag"] == "memory/rss(GiB)" for b in best.values())
    lines = [
        f"Ranked by the {report['ranked_by']}; best lr = lowest mean over seeds among lrs where no seed diverged "
        "or failed.",
        "",
        f"| optimizer | best lr | loss | tokens/s per process | peak memory{' (RSS)' if rss else ''} | "
        "optimizer state |",
        "|---|---|---|---|---|---|",
    ]
    for optimizer, b in best.items():
        memory = "n/a" if b["peak_memory_gib"] is None else f"{b['peak_memory_gib']:.3f} GiB"
        state = "n/a" if b["optimizer_state_bytes"] is None else f"{b['optimizer_state_bytes'] / 2**30:.3f} GiB"
        tps = "n/a" if b["mean_tps"] is None else f"{b['mean_tps']:.1f}"
        lr = "none (every lr diverged or failed)" if b["lr"] is None else lr_label(b["lr"])
        lines.append(
            f"| {optimizer} | {lr} | {_loss_text(b['loss_mean'], b['loss_std'], len(b['seeds']))} | "
            f"{tps} | {memory} | {state} |"
        )
    lrs = sorted({c["lr"] for c in grid})
    lines += ["", "| optimizer | " + " | ".join(f"lr {lr_label(lr)}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    for optimizer, b in best.items():
        cells = {c["lr"]: c for c in grid if c["optimizer"] == optimizer}
        row = []
        for lr in lrs:
            text = _cell_text(cells[lr], runs) if lr in cells else "not run"
            row.append(f"**{text}**" if lr == b["lr"] else text)
        lines.append(f"| {optimizer} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _mean_curve(series: Sequence[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over runs at the steps every run logged."""
    steps = sorted(set.intersection(*(set(s.steps) for s in series)))
    columns = [[dict(zip(s.steps, s.values))[step] for s in series] for step in steps]
    return steps, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def plot_sweep(results: Sequence[RunResult], report: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(15, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (curves, by_lr), (memory, speed) = fig.subplots(2, 2)
    best, grid = report["best"], report["grid"]
    optimizers = list(best)
    colors = {o: f"C{i % 10}" for i, o in enumerate(optimizers)}
    # A line style per optimizer too: optimizers that train alike (AdamW and its 8-bit form) keep both curves visible.
    dashes = {o: ("-", "--", ":", "-.")[i % 4] for i, o in enumerate(optimizers)}

    # (a) each optimizer's loss curve at its best lr (mean over seeds, band from min to max).
    for optimizer, b in best.items():
        if b["lr"] is None:
            continue
        chosen = [r for r in results if r.spec.optimizer == optimizer and r.spec.lr == b["lr"]]
        seeds = f", {len(chosen)} seeds" if len(chosen) > 1 else ""
        for tag, marker, suffix in ((LOSS, "", ""), (VALIDATION_LOSS, "o", " (validation)")):
            series = [r.scalars[tag] for r in chosen if tag in r.scalars]
            if len(series) != len(chosen):
                continue
            steps, mean, low, high = _mean_curve(series)
            curves.plot(
                steps,
                mean,
                dashes[optimizer] + marker,
                color=colors[optimizer],
                markersize=3,
                label=f"{optimizer} lr {lr_label(b['lr'])}{seeds}{suffix}",
            )
            if len(series) > 1:
                curves.fill_between(steps, low, high, color=colors[optimizer], alpha=0.2)
    curves.set(title="loss at each optimizer's best lr", xlabel="step", ylabel="loss")

    # (b) the ranking loss against lr; diverged and failed lrs marked in a band above the finite values.
    top = by_lr.get_xaxis_transform()  # x in data, y in axes fractions
    for optimizer in optimizers:
        cells = [c for c in grid if c["optimizer"] == optimizer]
        ok = [c for c in cells if c["outcome"] == FINISHED]
        if ok:
            by_lr.errorbar(
                [c["lr"] for c in ok],
                [c["loss_mean"] for c in ok],
                yerr=[c["loss_std"] or 0.0 for c in ok],
                fmt=dashes[optimizer] + "o",
                capsize=3,
                color=colors[optimizer],
                label=optimizer,
            )
        if best[optimizer]["lr"] is not None:
            by_lr.plot(
                [best[optimizer]["lr"]], [best[optimizer]["loss_mean"]], "*", markersize=16, color=colors[optimizer]
            )
    unfinished = any(c["outcome"] != FINISHED for c in grid)
    if by_lr.lines and unfinished:  # keep the finite values in the lower 75% of the panel
        low, high = by_lr.get_ylim()
        by_lr.set_ylim(low, high + (high - low) / 3)
    for index, optimizer in enumerate(optimizers):
        for c in (c for c in grid if c["optimizer"] == optimizer and c["outcome"] != FINISHED):
            marker = "x" if c["outcome"] == DIVERGED else "s"
            # One row per optimizer, so that two optimizers diverging at one lr stay visible.
            by_lr.plot(
                [c["lr"]],
                [0.95 - 0.05 * index],
                marker,
                transform=top,
                color=colors[optimizer],
                markersize=10,
                label=f"{optimizer} lr {lr_label(c['lr'])} {c['outcome']}",
            )
    if unfinished:
        by_lr.plot([0, 1], [0.78, 0.78], ":", color="gray", transform=by_lr.transAxes)
        by_lr.text(0.01, 0.8, "diverged (x) / failed (■)", transform=by_lr.transAxes, fontsize="small", color="gray")
    by_lr.set_xscale("log")
    lrs = sorted({c["lr"] for c in grid})
    by_lr.set_xticks(lrs, [lr_label(lr) for lr in lrs])
    by_lr.minorticks_off()
    by_lr.set(title=f"final loss vs lr (★ best; {report['ranked_by']})", xlabel="peak lr", ylabel="final loss")

    # (c) peak memory and optimizer state; (d) tokens/s.
    x = list(range(len(optimizers)))
    mem_label = (
        "peak memory (RSS)" if any(b["peak_memory_tag"] == "memory/rss(GiB)" for b in best.values()) else "peak memory"
    )
    legend = []
    for offset, key, label, hatch in (
        (-0.2, "peak_memory_gib", mem_label, None),
        (0.2, "optimizer_state_bytes", "optimizer state", "//"),
    ):
        scale = 2**30 if key == "optimizer_state_bytes" else 1
        values = [(best[o][key] or 0.0) / scale for o in optimizers]
        bars = memory.bar(
            [i + offset for i in x],
            values,
            width=0.4,
            label=label,
            hatch=hatch,
            color=[colors[o] for o in optimizers],
            edgecolor="black",
        )
        memory.bar_label(bars, fmt="%.3f", fontsize="small")
        legend.append(Patch(facecolor="white", edgecolor="black", hatch=hatch, label=label))
    memory.set(
        title="peak memory per process; optimizer state over all processes",
        ylabel="GiB",
        xticks=x,
        xticklabels=optimizers,
    )
    memory.legend(handles=legend, fontsize="small")
    mean_tps = [best[o]["mean_tps"] or 0.0 for o in optimizers]
    spread = [
        [m - (best[o]["min_tps"] or m) for o, m in zip(optimizers, mean_tps)],
        [(best[o]["max_tps"] or m) - m for o, m in zip(optimizers, mean_tps)],
    ]
    bars = speed.bar(x, mean_tps, yerr=spread, capsize=4, color=[colors[o] for o in optimizers], edgecolor="black")
    speed.bar_label(bars, fmt="%.0f", fontsize="small", label_type="center")
    speed.set(
        title="tokens/s per process (mean over finished runs; bars: min to max)",
        ylabel="tokens/s",
        xticks=x,
        xticklabels=optimizers,
    )
    for ax in (curves, by_lr, speed):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    memory.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")


def write_report(dump: Path, last_k: int) -> Optional[dict]:
    """sweep.png, sweep.md and sweep.json in the dump folder; None when no run has ended yet."""
    results = load_results(dump)
    if not results:
        return None
    report = summarize_sweep(results, last_k)
    plot_sweep(results, report, dump / f"{REPORT_NAME}.png")
    (dump / f"{REPORT_NAME}.md").write_text(format_markdown(report))
    (dump / f"{REPORT_NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.sweep",
        description="Train every optimizer x lr x seed with one config, then compare each optimizer at its best lr. "
        "Options after '--' go to every train.py run.",
    )
    p.add_argument("--dump-folder", required=True, help="the sweep's folder: runs/, sweep.png, sweep.md, sweep.json")
    p.add_argument(
        "--optimizers",
        default="AdamW AdamMini",
        help="optimizer names, space- or comma-separated (default: AdamW AdamMini)",
    )
    p.add_argument(
        "--lrs",
        default="3e-4 1e-3 3e-3",
        help="peak learning rates, space- or comma-separated (default: 3e-4 1e-3 3e-3)",
    )
    p.add_argument("--seeds", default="0", help="training.seed values, space- or comma-separated (default 0)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per run (NGPU of run_llama_train.sh; default: the GPUs present, else 1)",
    )
    p.add_argument("--config-file", default=DEFAULT_CONFIG, help=f"job config of every run (default {DEFAULT_CONFIG})")
    p.add_argument(
        "--last-k", type=int, default=10, help="final training loss = mean of the last k logged values (default 10)"
    )
    p.add_argument("--report-only", action="store_true", help="write the report from the runs there, train nothing")
    p.add_argument(
        "--launcher",
        default=str(REPO_ROOT / "run_llama_train.sh"),
        help="command that trains one run, given NGPU and CONFIG_FILE in its environment and the train.py "
        "options as arguments (default: the repository's run_llama_train.sh)",
    )
    return p


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 1


def sweep(argv: Sequence[str]) -> int:
    argv = list(argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = _parser().parse_args(argv[: len(argv) - len(train_args) - (1 if "--" in argv else 0)])
    if args.last_k < 1:
        raise UserError(f"--last-k must be at least 1; got {args.last_k}")
    dump = Path(args.dump_folder).resolve()
    if args.report_only:
        if not (dump / RUNS_FOLDER).is_dir():
            raise UserError(f"'{dump}' holds no sweep runs ({RUNS_FOLDER}/); pass the dump folder of a sweep")
    else:
        if args.nproc is not None and args.nproc < 1:
            raise UserError(f"--nproc must be at least 1; got {args.nproc}")
        nproc = args.nproc or _default_nproc()
        config_file = str(Path(args.config_file).resolve())
        check_train_options(train_args)
        specs = plan(_items(args.optimizers), parse_lrs(args.lrs), parse_seeds(args.seeds))
        preflight_jobs(specs, config_file, nproc, train_args)
        with lock_sweep(dump):
            check_settings(dump, {"config_file": config_file, "nproc": nproc, "train_args": train_args})
            statuses = run_sweep(specs, dump, config_file, nproc, train_args, shlex.split(args.launcher))
    report = write_report(dump, args.last_k)
    if report is None:
        raise UserError(f"no run in '{dump}' has ended yet; run the sweep first")
    print(format_markdown(report))
    print(f"wrote {dump / REPORT_NAME}.png, .md and .json")
    if args.report_only:
        return 0
    failed = [s for s in statuses if s["outcome"] == FAILED]
    if failed:
        print(
            f"error: {len(failed)} of {len(statuses)} runs failed (see their train.log); run the same command "
            "again to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return sweep(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: sweep interrupted; run the same command again to resume it", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
