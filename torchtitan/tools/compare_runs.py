"""Compare training runs (say AdamW against AdamMini) from their TensorBoard logs.

    python -m torchtitan.tools.compare_runs outputs/tb --out compare.png [--last-k 20] [--labels a,b] [--json [PATH]]

Each RUN_DIR is a run folder written by ``train.py`` (``{dump_folder}/tb/{YYYYmmdd-HHMMSS}_{Optimizer}``) or a folder
holding several of them. The tool writes one PNG with loss against steps, loss against tokens seen and the gradient
norm against steps, and prints a table per run: final loss (mean over the last k logged steps), mean tokens/s, peak
memory and optimizer-state bytes; a run whose loss became non-finite shows as diverged at its first such step
(the numbers are ``torchtitan.study.summary.summarize``'s, the very ones an lr sweep ranks by). When a run logged
optimizer health (``metrics.health_freq``), a second PNG beside the first (``compare_health.png`` for
``compare.png``) shows update RMS and update/weight per group of weights and the largest attention logit.
``--json`` writes the same numbers as JSON (to a file, or to stdout when no path is given, in which case the table
is not printed). Reading runs is ``runs.py``; ``python -m torchtitan.tools.sweep`` runs lr sweeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError, exit_code
from torchtitan.study.figures import plot_health
from torchtitan.study.run_folders import GRAD_NORM, LOSS, TOKENS_SEEN, Run, Series, load_runs
from torchtitan.study.summary import summarize


def summarize_run(run: Run, last_k: int) -> dict:
    """The numbers of one run's row in the table (see ``summary.summarize``), with its name and folder."""
    return {"name": run.name, "path": str(run.path), **summarize(run.scalars, last_k)}


# ----------------------------------------------------------------------------------------------------------------
# Table


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


def health_path(out: Path) -> Path:
    """Where the optimizer-health figure goes beside the comparison ``out`` (written when a run logged health)."""
    return out.with_name(f"{out.stem}_health.png")


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
    summaries = [summarize_run(run, args.last_k) for run in runs]
    for note in plot(runs, out):
        print(f"note: {note}", file=sys.stderr)
    health = plot_health([(run.name, [run.scalars]) for run in runs])
    health_out = health_path(out)
    if health is not None:
        health_out.write_bytes(health)
    if args.json == "-":
        print(json.dumps(summaries, indent=2))
        return summaries
    print(format_table(summaries, args.last_k))
    print(f"wrote {out}")
    if health is not None:
        print(f"wrote {health_out} (optimizer health)")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {args.json}")
    return summaries


def main(argv: Optional[Sequence[str]] = None) -> int:
    return exit_code(lambda: compare(argv))


if __name__ == "__main__":
    sys.exit(main())
