"""Sweeps for fair optimizer comparisons: every optimizer at its own best settings.

    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --optimizers AdamW,AdamMini --lrs 3e-4,1e-3,3e-3 \\
        [--seeds 0,1,2] [--vary-data-seed] [--axis [OPTIMIZER:]SECTION.KEY=V1,V2 ...] \\
        [--search grid | coordinate [--start [OPTIMIZER:]SECTION.KEY=V ...]] [--budgets 2e8,4e8 | 1x,2x] \\
        [--warmup-fraction F] [--baseline AdamW] [--nproc N] [--parallel K] [--config-file X.toml] \\
        [--last-k 10] -- [train.py options]
    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --report-only [--baseline AdamW]

Every (optimizer, lr, seed) runs once through ``run_llama_train.sh`` with the same config and options, in its own
folder ``{dump}/runs/{Optimizer}_lr{lr}_seed{seed}`` (its TensorBoard logs, checkpoints and ``train.log``); with
``--axis`` once per value of every axis, ``..._{option}{value}``, and with ``--budgets`` once per budget,
``..._tokens{budget}``, its training.steps the whole steps that fit in the budget and its warmup a share of them
(docs/study-runs.md). ``--search coordinate`` trains only the points a coordinate descent from a start point visits
(``sweep_search``). ``--parallel K`` trains K runs at once, each on GPUs of its own. Each run's folder keeps the
command it ran with (``command.sh``) and, from train.py, its resolved config (``job_config.toml``); after a run ends
the sweep writes ``sweep_status.json`` into that folder: the exit code, the command, its environment and the outcome:

* ``finished`` - exit 0 with finite losses;
* ``diverged`` - exit 3 (train.py stopped on non-finite loss or gradients) or a non-finite logged loss;
* ``failed``   - any other exit. The sweep goes on with the other runs and exits 1 at the end (2 for a mistake in
  the options, which stops it at once).

Finished and diverged runs are never run again: running the same command again resumes an interrupted sweep where
it stopped (failed and interrupted runs start again; with checkpointing on they resume from their own checkpoint),
and adding optimizers, lrs or seeds extends it. The report - ``sweep.png``, ``sweep.md``, ``sweep.json`` and the
self-contained page ``study.html`` in the dump folder - ranks each setting by the last ``validation/loss`` when
every run logs one, else by the mean of the last k logged training losses; with several seeds it gives their mean
± a 95% confidence interval. Each optimizer's best setting is the one with the lowest mean among those where no seed
diverged or failed; it is compared with the baseline's best (difference with Welch's interval and a verdict, speedup
at matched loss; across three or more budgets a power-law fit). docs/optimizer-study.md says how each number is
computed.

Modules: ``sweep_plan`` (the runs, their folders and options, the checks before any starts), ``sweep_runner`` (the
launcher processes K at a time, their slots and outcomes), ``sweep_search`` (coordinate descent), ``runs`` (reading
logged scalars), ``summary`` (the numbers, shared with ``compare_runs``), ``statistics`` (t, Welch, speedup, the
fit), ``sweep_plot`` (the figures), ``study_report`` (tables and the page); this one writes the report and reads the
command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError, exit_code
from torchtitan.files import write_text_atomically
from torchtitan.tools.runs import load_sweep_runs
from torchtitan.tools.study_report import format_html, format_markdown
from torchtitan.tools.summary import DEFAULT_BASELINE, summarize_sweep
from torchtitan.tools.sweep_plan import (
    FAILED,
    RUNS_FOLDER,
    check_axes,
    check_settings,
    check_train_options,
    fit_budgets,
    items,
    job_warmup_fraction,
    lock_sweep,
    parse_axis,
    parse_budgets,
    parse_lrs,
    parse_seeds,
    plan,
    preflight_jobs,
    tokens_per_step,
)
from torchtitan.tools.sweep_plot import plot_budgets, plot_main, plot_sensitivity, plot_sweep
from torchtitan.tools.sweep_runner import Runner, plan_slots, run_all, visible_gpus
from torchtitan.tools.sweep_search import (
    descent_report,
    parse_starts,
    read_search,
    run_descents,
    search_spaces,
    specs_of,
    write_search,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "./train_configs/debug_model.toml"
SEARCHES = ("grid", "coordinate")
REPORT_NAME = "sweep"  # sweep.png, sweep.md, sweep.json
PAGE_NAME = "study.html"  # the one self-contained page: tables and every figure
INTERIM_REPORT_SECONDS = 600.0  # while training, the report is rewritten at most this often


# ----------------------------------------------------------------------------------------------------------------
# The report


def write_report(dump: Path, last_k: int, baseline: Optional[str] = None) -> Optional[dict]:
    """sweep.png, sweep.md, sweep.json and study.html in the dump folder; None when no run has ended yet.

    ``baseline`` None compares with AdamW where the sweep has it; a named baseline must be in the sweep."""
    runs = load_sweep_runs(dump)
    if not runs:
        return None
    report = summarize_sweep(runs, last_k, baseline or DEFAULT_BASELINE)
    report["descents"] = descent_report(read_search(dump), report["runs"])
    if baseline is not None and not report["baseline_found"]:
        raise UserError(
            f"--baseline {baseline} is not an optimizer of this sweep ({', '.join(report['best'])}); name one of them"
        )
    plot_sweep(runs, report, dump / f"{REPORT_NAME}.png")
    (dump / f"{REPORT_NAME}.md").write_text(format_markdown(report))
    (dump / f"{REPORT_NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    figures = {
        "main": plot_main(runs, report),
        "sensitivity": plot_sensitivity(report),
        "budgets": plot_budgets(report),
        "overview": (dump / f"{REPORT_NAME}.png").read_bytes(),
    }
    write_text_atomically(dump / PAGE_NAME, format_html(report, figures, f"Optimizer study: {dump.name}"))
    return report


class InterimReport:
    """The report rewritten while a sweep trains, after a run ends and at most every ``INTERIM_REPORT_SECONDS``, so
    that ``study.html`` shows a long study as it stands. A report that cannot be written yet (runs on other data, or
    any other failure) is one line, and the runs go on; the final report says it again and fails."""

    def __init__(self, dump: Path, last_k: int, baseline: Optional[str]):
        self.dump, self.last_k, self.baseline = dump, last_k, baseline
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last < INTERIM_REPORT_SECONDS:
            return
        try:
            write_report(self.dump, self.last_k, self.baseline)
            print(f"report so far: {self.dump / PAGE_NAME}", flush=True)
        except Exception as e:  # noqa: BLE001 - a report that fails must not stop the runs; the final one raises
            print(f"note: no report yet: {e}", flush=True)
        self.last = time.monotonic()


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
        "--vary-data-seed",
        action="store_true",
        help="give each run its seed as training.data_seed too, so that seeds vary the data order as well as the "
        "initial weights (for data that has a seed)",
    )
    p.add_argument(
        "--axis",
        action="append",
        default=[],
        metavar="[OPTIMIZER:]SECTION.KEY=V1,V2",
        help="sweep a train.py option over these values, for every optimizer or for one (AdamW:optimizer.beta2="
        "0.95,0.99); repeat for more axes; every combination is a cell, named by each value",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="token budgets, each its own run with its own training.steps and schedule: tokens (2e8,4e8) or "
        "multiples of 20 tokens per non-embedding parameter of the model (1x,2x); default: the job's training.steps",
    )
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=None,
        help="with --budgets: each budget warms up this share of its steps (default: the job's training.warmup_steps "
        "/ training.steps)",
    )
    p.add_argument(
        "--search",
        choices=SEARCHES,
        default="grid",
        help="grid: train every combination of the swept settings; coordinate: coordinate descent from a start "
        "point per optimizer, one setting at a time, to a point no single step improves (default grid)",
    )
    p.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="[OPTIMIZER:]SECTION.KEY=VALUE",
        help="with --search coordinate: where the descent starts on a swept setting (optimizer.lr or an --axis "
        "option), for every optimizer or for one; default: the middle of its values",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per run (NGPU of run_llama_train.sh; default: the GPUs present / --parallel, else 1)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at once, each on GPUs of its own (CUDA_VISIBLE_DEVICES; --parallel x --nproc at most the GPUs "
        "present), or as K processes on a machine without GPUs (default 1)",
    )
    p.add_argument("--config-file", default=DEFAULT_CONFIG, help=f"job config of every run (default {DEFAULT_CONFIG})")
    p.add_argument(
        "--last-k", type=int, default=10, help="final training loss = mean of the last k logged values (default 10)"
    )
    p.add_argument(
        "--baseline",
        default=None,
        help=f"the optimizer every other is compared with: difference, verdict, speedup (default {DEFAULT_BASELINE})",
    )
    p.add_argument("--report-only", action="store_true", help="write the report from the runs there, train nothing")
    p.add_argument(
        "--launcher",
        default=str(REPO_ROOT / "run_llama_train.sh"),
        help="command that trains one run, given NGPU and CONFIG_FILE in its environment and the train.py "
        "options as arguments (default: the repository's run_llama_train.sh)",
    )
    return p


def _default_nproc(gpus: list[str], parallel: int) -> int:
    return max(1, len(gpus) // parallel)


def _budgets(args, config_file: str, nproc: int, train_args: list[str]) -> tuple[list, Optional[float]]:
    """The runs' budgets, each fitted to the job's tokens per step, and their warmup share; ``[None], None``
    without --budgets (every run the job's own length)."""
    if args.budgets is None:
        if args.warmup_fraction is not None:
            raise UserError("--warmup-fraction applies to --budgets; add --budgets, or set --training.warmup_steps")
        return [None], None
    budgets = parse_budgets(args.budgets)
    if not budgets:
        raise UserError("--budgets is empty; give BUDGETS like '2e8,4e8' or '1x,2x', or leave it out")
    fraction = args.warmup_fraction
    if fraction is None:
        fraction = job_warmup_fraction(config_file, train_args)
    elif not 0 <= fraction < 1:
        raise UserError(f"--warmup-fraction must be at least 0 and below 1; got {fraction:g}")
    per_step, params = tokens_per_step(config_file, nproc, train_args)
    return fit_budgets(budgets, per_step, params, fraction), fraction


def _search_spaces(specs, lrs, axes, train_args, starts) -> dict:
    """Each optimizer's grid and start for a coordinate descent (one line for a grid with nothing to descend)."""
    optimizers = list(dict.fromkeys(s.optimizer for s in specs))
    spaces = search_spaces(optimizers, lrs, check_axes(axes, optimizers, train_args), parse_starts(starts))
    if all(len(c.values) == 1 for space in spaces.values() for c in space.coordinates):
        raise UserError(
            "--search coordinate has nothing to descend: every swept setting has one value; give --lrs or an "
            "--axis two or more values, or drop --search coordinate"
        )
    return spaces


def _to_check(specs, spaces) -> list:
    """The runs whose jobs preflight checks before any run starts: all of a grid; for a descent, every value of
    each setting once (from the start point), since the points it visits are not known in advance."""
    if spaces is None:
        return specs
    budgets = list(dict.fromkeys(s.budget for s in specs))
    seed = specs[0].seed
    checked = []
    for optimizer, space in spaces.items():
        points = {space.start}
        for n, c in enumerate(space.coordinates):
            points |= {space.start[:n] + (i,) + space.start[n + 1 :] for i in range(len(c.values))}
        for budget in budgets:
            checked += [spec for p in sorted(points) for spec in specs_of(optimizer, budget, space, p, [seed])]
    return checked


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
        gpus = visible_gpus(dict(os.environ))
        nproc = args.nproc or _default_nproc(gpus, args.parallel)
        slots = plan_slots(args.parallel, nproc, gpus)
        config_file = str(Path(args.config_file).resolve())
        check_train_options(train_args, args.vary_data_seed, budgets=args.budgets is not None)
        if args.start and args.search != "coordinate":
            raise UserError("--start sets where a coordinate descent starts; add --search coordinate or drop --start")
        budgets, warmup_fraction = _budgets(args, config_file, nproc, train_args)
        axes = [parse_axis(raw, args.budgets is not None, args.vary_data_seed) for raw in args.axis]
        optimizers, lrs, seeds = items(args.optimizers), parse_lrs(args.lrs), parse_seeds(args.seeds)
        specs = plan(optimizers, lrs, seeds, budgets, axes, train_args)
        spaces = None
        if args.search == "coordinate":
            spaces = _search_spaces(specs, lrs, axes, train_args, args.start)
        preflight_jobs(_to_check(specs, spaces), config_file, nproc, train_args, args.vary_data_seed)
        settings = {"config_file": config_file, "nproc": nproc, "train_args": train_args}
        if args.vary_data_seed:  # recorded only when set, so that sweeps started before the flag resume
            settings["vary_data_seed"] = True
        if warmup_fraction is not None:  # the budgets themselves may grow: new budgets extend the sweep
            settings["warmup_fraction"] = warmup_fraction
        with lock_sweep(dump):
            check_settings(dump, settings)
            launcher = shlex.split(args.launcher)
            interim = InterimReport(dump, args.last_k, args.baseline)
            runner = Runner(dump, config_file, nproc, train_args, launcher, slots, args.vary_data_seed, interim)
            write_search(dump, args.search, spaces or {}, seeds, budgets)
            if spaces is None:
                statuses = run_all(runner, specs)
                failed = [s for s in statuses if s["outcome"] == FAILED]
                failed_text = f"{len(failed)} of {len(statuses)} runs failed (see their train.log)"
            else:
                found = run_descents(runner, read_search(dump), budgets, args.last_k)
                failed = [d for _, _, _, d in found if d.state == "blocked"]
                failed_text = f"{len(failed)} of {len(found)} descents stopped at a run that failed (see its train.log)"
    report = write_report(dump, args.last_k, args.baseline)
    if report is None:
        raise UserError(f"no run in '{dump}' has ended yet; run the sweep first")
    print(format_markdown(report))
    print(f"wrote {dump / REPORT_NAME}.png, .md, .json and {dump / PAGE_NAME}")
    if args.report_only:
        return 0
    if failed:
        print(f"error: {failed_text}; run the same command again to retry", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return exit_code(
        lambda: sweep(sys.argv[1:] if argv is None else argv),
        interrupted="sweep interrupted; run the same command again to resume it",
    )


if __name__ == "__main__":
    sys.exit(main())
