"""Compare training runs (say AdamW against AdamMini) from their TensorBoard logs.

    python -m torchtitan.tools.compare_runs outputs/tb --out compare.png [--last-k 20] [--labels a,b] [--json [PATH]]

Each RUN_DIR is a run folder written by ``train.py`` (``{dump_folder}/tb/{YYYYmmdd-HHMMSS}_{Optimizer}``) or a folder
holding several of them. The tool writes one PNG with loss against steps, loss against tokens seen and the gradient
norm against steps, and prints a table per run: final loss (mean over the last k logged steps), mean tokens/s, peak
memory and optimizer-state bytes; a run whose loss became non-finite shows as diverged at its first such step.
``--json`` writes the same numbers as JSON (to a file, or to stdout when no path is given, in which case the table
is not printed). ``python -m torchtitan.tools.sweep`` builds on this module for lr sweeps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError

LOSS = "loss_metrics/global_avg_loss"
GRAD_NORM = "grad_norm"
TPS = "throughput/tps"
TOKENS_SEEN = "throughput/tokens_seen"
# GPU runs log the allocator's peak (max_active in runs of older versions); CPU runs log the process RSS. The
# first one present is used.
MEMORY_TAGS = ("memory/max_allocated(GiB)", "memory/max_active(GiB)", "memory/rss(GiB)")
STATE_BYTES = "optimizer/state_bytes"
EVENT_FILE_PREFIX = "events.out.tfevents"


@dataclass(frozen=True)
class Series:
    """One scalar tag of one run: steps in increasing order and the value logged at each."""

    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Run:
    name: str
    path: Path
    scalars: dict[str, Series]


# ----------------------------------------------------------------------------------------------------------------
# Finding and reading runs


def _has_event_files(folder: Path) -> bool:
    return any(p.is_file() and p.name.startswith(EVENT_FILE_PREFIX) for p in folder.iterdir())


def find_run_dirs(paths: Sequence[str]) -> list[Path]:
    """Each path as a run folder, or the run folders below it (sorted), without duplicates."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise UserError(f"run directory '{raw}' does not exist; pass a TensorBoard run folder such as outputs/tb")
        if _has_event_files(path):
            runs = [path]
        else:
            runs = sorted(d for d in path.rglob("*") if d.is_dir() and _has_event_files(d))
        if not runs:
            raise UserError(
                f"no TensorBoard event files ({EVENT_FILE_PREFIX}.*) in '{raw}' or below it; "
                "pass the folder of a run trained with metrics.enable_tensorboard"
            )
        found.extend(r for r in runs if r not in found)
    return found


def _sorted_series(pairs: list[tuple[int, float]]) -> Series:
    # A resumed run may log a step twice; the later value wins.
    by_step = dict(pairs)
    steps = tuple(sorted(by_step))
    return Series(steps, tuple(by_step[s] for s in steps))


def read_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar tag in the event files of ``run_dir`` (classic ``simple_value`` and tensor-style scalars)."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {
        tag: _sorted_series([(e.step, float(e.value)) for e in accumulator.Scalars(tag)])
        for tag in tags.get(event_accumulator.SCALARS, [])
    }
    for tag in tags.get(event_accumulator.TENSORS, []):
        arrays = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
        if arrays and all(a.size == 1 for _, a in arrays):
            scalars.setdefault(tag, _sorted_series([(step, float(a.reshape(()))) for step, a in arrays]))
    return scalars


def _run_names(run_dirs: list[Path], labels: Optional[str]) -> list[str]:
    if labels is not None:
        names = [label.strip() for label in labels.split(",")]
        if len(names) != len(run_dirs) or not all(names):
            raise UserError(
                f"--labels gives {len(names)} names for {len(run_dirs)} runs "
                f"({', '.join(d.name for d in run_dirs)}); give one non-empty name per run, comma-separated"
            )
        return names
    names = [d.name for d in run_dirs]
    # Same folder name under different parents (e.g. two dump folders): add the parent to tell them apart.
    return [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in run_dirs]


def load_runs(paths: Sequence[str], labels: Optional[str] = None) -> list[Run]:
    run_dirs = find_run_dirs(paths)
    runs, empty = [], []
    for name, run_dir in zip(_run_names(run_dirs, labels), run_dirs):
        scalars = read_scalars(run_dir)
        if LOSS in scalars:
            runs.append(Run(name, run_dir, scalars))
        else:
            empty.append(run_dir)
    # A run with no training step (e.g. a finished job started again: it resumed at its last step and trained
    # nothing) has nothing to compare; it is left out when other runs remain, and named.
    if empty and (not runs or labels is not None):
        raise UserError(f"run '{empty[0]}' has no '{LOSS}' scalars; it did not log a training step yet")
    for run_dir in empty:
        print(f"note: left out run '{run_dir}': it logged no training step", file=sys.stderr)
    return runs


# ----------------------------------------------------------------------------------------------------------------
# Summaries


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def first_non_finite_step(series: Series) -> Optional[int]:
    """The first step whose value is NaN or infinite (a diverged run), or None."""
    return next((step for step, value in zip(series.steps, series.values) if not math.isfinite(value)), None)


def summarize(run: Run, last_k: int) -> dict:
    """The numbers of the comparison table for one run; None where the run did not log the tag.

    A run whose loss became non-finite has ``diverged_at_step`` set and no final loss.
    """
    loss = run.scalars[LOSS]
    tail = loss.values[-last_k:]
    diverged_at = first_non_finite_step(loss)
    memory_tag = next((t for t in MEMORY_TAGS if t in run.scalars), None)
    tps = run.scalars.get(TPS)
    state = run.scalars.get(STATE_BYTES)
    tokens = run.scalars.get(TOKENS_SEEN)
    return {
        "name": run.name,
        "path": str(run.path),
        "last_step": loss.steps[-1],
        "final_loss": None if diverged_at is not None else _mean(tail),
        "final_loss_steps": len(tail),
        "diverged_at_step": diverged_at,
        "mean_tps": _mean(tps.values) if tps else None,
        "peak_memory_gib": max(run.scalars[memory_tag].values) if memory_tag else None,
        "peak_memory_tag": memory_tag,
        "optimizer_state_bytes": int(round(state.values[-1])) if state else None,
        "tokens_seen": int(round(tokens.values[-1])) if tokens else None,
    }


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(summaries: list[dict], last_k: int) -> str:
    header = ("run", "last step", f"loss (last {last_k})", "tokens/s", "peak mem GiB", "opt state GiB")
    rows = []
    for s in summaries:
        memory = _fmt(s["peak_memory_gib"], ".3f")
        if s["peak_memory_tag"] == "memory/rss(GiB)":
            memory += " (rss)"
        state = s["optimizer_state_bytes"]
        loss = _fmt(s["final_loss"], ".4f")
        if s["diverged_at_step"] is not None:
            loss = f"diverged at step {s['diverged_at_step']}"
        rows.append(
            (
                s["name"],
                str(s["last_step"]),
                loss,
                _fmt(s["mean_tps"], ".1f"),
                memory,
                _fmt(None if state is None else state / 2**30, ".3f"),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Plot


def _tokens_at(steps: Sequence[int], tokens: Series) -> list[float]:
    """Tokens seen at each loss step; tokens grow linearly in the step, so interpolate between logged points."""
    import numpy as np

    return list(np.interp(steps, tokens.steps, tokens.values))


def plot(runs: list[Run], out: Path) -> list[str]:
    """Write the comparison figure to ``out`` (PNG); returns notes about what could not be drawn."""
    # The object-oriented API with the Agg canvas draws without touching pyplot's global backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_tokens, grad = fig.subplots(1, 3)
    notes = []
    for index, run in enumerate(runs):
        # One colour per run in every panel, even where a run has nothing to draw.
        style = {"label": run.name, "color": f"C{index % 10}"}
        loss = run.scalars[LOSS]
        by_step.plot(loss.steps, loss.values, **style)
        if TOKENS_SEEN in run.scalars:
            by_tokens.plot(_tokens_at(loss.steps, run.scalars[TOKENS_SEEN]), loss.values, **style)
        else:
            notes.append(f"run '{run.name}' logs no '{TOKENS_SEEN}'; its loss is plotted against steps only")
        if GRAD_NORM in run.scalars:
            g = run.scalars[GRAD_NORM]
            grad.plot(g.steps, g.values, **style)
        else:
            notes.append(f"run '{run.name}' logs no '{GRAD_NORM}'; it is missing from the gradient-norm panel")
    by_step.set(title="loss vs step", xlabel="step", ylabel="loss (global average)")
    by_tokens.set(title="loss vs tokens seen", xlabel="tokens", ylabel="loss (global average)")
    grad.set(title="gradient norm vs step", xlabel="step", ylabel="grad norm (before clipping)")
    if not any(TOKENS_SEEN in r.scalars for r in runs):
        by_tokens.text(0.5, 0.5, f"no run logs {TOKENS_SEEN}", ha="center", va="center", transform=by_tokens.transAxes)
    for ax in (by_step, by_tokens, grad):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return notes


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.compare_runs",
        description="Compare training runs from their TensorBoard logs: a PNG of the curves and a table.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run folder, or a folder holding run folders")
    p.add_argument("--out", default="compare.png", help="PNG to write (default: compare.png)")
    p.add_argument("--last-k", type=int, default=20, help="final loss = mean of the last k logged steps (default 20)")
    p.add_argument("--labels", default=None, help="comma-separated run names, one per run, in run order")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the numbers as JSON to PATH; without PATH, print JSON instead of the table",
    )
    return p


def compare(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = _parser().parse_args(argv)
    if args.last_k < 1:
        raise UserError(f"--last-k must be at least 1; got {args.last_k}")
    out = Path(args.out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out '{args.out}' must name a .png file")
    runs = load_runs(args.run_dirs, args.labels)
    summaries = [summarize(run, args.last_k) for run in runs]
    for note in plot(runs, out):
        print(f"note: {note}", file=sys.stderr)
    if args.json == "-":
        print(json.dumps(summaries, indent=2))
        return summaries
    print(format_table(summaries, args.last_k))
    print(f"wrote {out}")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {args.json}")
    return summaries


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        compare(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
