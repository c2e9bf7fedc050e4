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

Modules: ``sweep_plan`` (the runs, their folders and options, the checks before any starts), ``sweep_runner`` (the
launcher processes and their outcomes), ``runs`` (reading logged scalars), ``summary`` (the numbers, shared with
``compare_runs``), ``sweep_plot`` (the figure); this one writes the report and reads the command line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError, exit_code
from torchtitan.tools.runs import load_sweep_runs
from torchtitan.tools.summary import summarize_sweep
from torchtitan.tools.sweep_plan import (
    DIVERGED,
    FAILED,
    FINISHED,
    RUNS_FOLDER,
    check_settings,
    check_train_options,
    items,
    lock_sweep,
    lr_label,
    parse_lrs,
    parse_seeds,
    plan,
    preflight_jobs,
)
from torchtitan.tools.sweep_plot import plot_sweep
from torchtitan.tools.sweep_runner import run_sweep

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "./train_configs/debug_model.toml"
REPORT_NAME = "sweep"  # sweep.png, sweep.md, sweep.json


# ----------------------------------------------------------------------------------------------------------------
# The report


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


def write_report(dump: Path, last_k: int) -> Optional[dict]:
    """sweep.png, sweep.md and sweep.json in the dump folder; None when no run has ended yet."""
    runs = load_sweep_runs(dump)
    if not runs:
        return None
    report = summarize_sweep(runs, last_k)
    plot_sweep(runs, report, dump / f"{REPORT_NAME}.png")
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
        specs = plan(items(args.optimizers), parse_lrs(args.lrs), parse_seeds(args.seeds))
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
    return exit_code(
        lambda: sweep(sys.argv[1:] if argv is None else argv),
        interrupted="sweep interrupted; run the same command again to resume it",
    )


if __name__ == "__main__":
    sys.exit(main())
