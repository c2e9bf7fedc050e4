"""A sweep end to end: the plan checked before any run starts, its runs trained (every cell of a grid, or the points
a coordinate descent visits) K at a time, and the report written from the run folders.

``python -m torchtitan.tools.sweep`` reads the command line and calls :func:`run_sweep`; the modules it joins are
``plan`` (the runs, their folders and options, the checks), ``scheduling`` (the launcher processes K at a time),
``search`` (coordinate descent), ``run_folders`` (reading what runs logged), ``summary`` and ``statistics`` (the
numbers), ``figures`` and ``report`` (the page).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

from torchtitan.errors import UserError
from torchtitan.study.confirmation import (
    close_call_specs,
    confirmation_specs,
    confirmation_windows,
    earlier_selection_seeds,
    parse_confirm_seeds,
    write_confirmation_windows,
)
from torchtitan.study.earlier_runs import adopt_earlier_runs, current_axes
from torchtitan.study.plan import (
    DEFAULT_LAST_K,
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
    recorded_settings,
    tokens_per_step,
)
from torchtitan.study.report import PAGE_NAME, REPORT_NAME, InterimReport, format_markdown, write_report
from torchtitan.study.scheduling import Runner, first_failure, is_done, plan_slots, run_all, visible_gpus
from torchtitan.study.search import parse_starts, read_search, run_descents, search_spaces, specs_of, write_search
from torchtitan.study.slurm import (
    SlurmRunner,
    check_cluster,
    check_time_limit,
    checkpointing,
    print_states,
    slurm_settings,
)


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


def run_sweep(args: argparse.Namespace, train_args: list[str]) -> int:
    """Train what the sweep still lacks (nothing with ``--report-only``), write the report; the exit code."""
    sweep_started = time.time()
    dump = Path(args.dump_folder).resolve()
    last_k = args.last_k if args.last_k is not None else recorded_settings(dump).get("last_k", DEFAULT_LAST_K)
    if last_k < 1:
        raise UserError(f"--last-k must be at least 1; got {last_k}")
    slurm = slurm_settings(args)
    in_progress = None
    if args.report_only:
        if not (dump / RUNS_FOLDER).is_dir():
            raise UserError(f"'{dump}' holds no sweep runs ({RUNS_FOLDER}/); pass the dump folder of a sweep")
        if getattr(args, "selection_seeds_max", None) is not None:
            raise UserError("--selection-seeds-max trains more selection runs; drop it with --report-only")
    else:
        if args.nproc is not None and args.nproc < 1:
            raise UserError(f"--nproc must be at least 1; got {args.nproc}")
        if slurm is None:
            gpus = visible_gpus(dict(os.environ))
            nproc = args.nproc or _default_nproc(gpus, args.parallel)
            slots = plan_slots(args.parallel, nproc, gpus)
        else:  # each run on GPUs Slurm gives it: --slurm-gpus per node, one process per GPU
            nproc = args.nproc or slurm.gpus or 1
            check_cluster(slurm, args.parallel, nproc)
            check_time_limit(slurm, dump, checkpointing(str(Path(args.config_file).resolve()), train_args))
        config_file = str(Path(args.config_file).resolve())
        check_train_options(train_args, args.vary_data_seed, budgets=args.budgets is not None)
        if args.extend and args.search != "coordinate":
            raise UserError("--extend steps a coordinate descent past its grid; add --search coordinate or drop it")
        if args.extend < 0:
            raise UserError(f"--extend must be 0 or more; got {args.extend}")
        seeds_max = getattr(args, "selection_seeds_max", None)
        if seeds_max is not None and args.search == "coordinate":
            raise UserError(
                "--selection-seeds-max adds seeds to a grid's close calls; drop it with --search coordinate"
            )
        if seeds_max is not None and seeds_max <= len(items(args.seeds)):
            raise UserError(
                f"--selection-seeds-max {seeds_max} adds no seed to the {len(items(args.seeds))} of --seeds; give "
                "more than that, or leave it out"
            )
        if args.start and args.search != "coordinate":
            raise UserError("--start sets where a coordinate descent starts; add --search coordinate or drop --start")
        budgets, warmup_fraction = _budgets(args, config_file, nproc, train_args)
        axes = [parse_axis(raw, args.budgets is not None, args.vary_data_seed) for raw in args.axis]
        optimizers, lrs, seeds = items(args.optimizers), parse_lrs(args.lrs), parse_seeds(args.seeds)
        lrs = getattr(args, "carried_lrs", None) or lrs  # a size of a study over sizes: each optimizer's own grid
        recorded = (read_search(dump) or {}).get("confirm_seeds", [])
        earlier = earlier_selection_seeds(dump, recorded)
        confirm_seeds = parse_confirm_seeds(args.confirm_seeds, seeds, recorded, earlier)
        specs = plan(optimizers, lrs, seeds, budgets, axes, train_args)
        spaces = None
        if args.search == "coordinate":
            spaces = _search_spaces(specs, lrs, axes, train_args, args.start)
        preflight_jobs(_to_check(specs, spaces), config_file, nproc, train_args, args.vary_data_seed)
        # Confirmation scores validation windows that selection never scored, where the held-out data has room.
        windows = (
            confirmation_windows(dump, recorded, confirm_seeds, config_file, train_args) if confirm_seeds else None
        )
        settings = {"config_file": config_file, "nproc": nproc, "train_args": train_args}
        if args.vary_data_seed:  # recorded only when set, so that sweeps started before the flag resume
            settings["vary_data_seed"] = True
        if warmup_fraction is not None:  # the budgets themselves may grow: new budgets extend the sweep
            settings["warmup_fraction"] = warmup_fraction
        if last_k != DEFAULT_LAST_K:  # the descent and the report rank by it; --report-only reads it back
            settings["last_k"] = last_k
        with lock_sweep(dump):
            check_settings(dump, settings)
            launcher = shlex.split(args.launcher)
            interim = InterimReport(dump, last_k, args.baseline, args.family_correction)
            if slurm is None:
                runner = Runner(dump, config_file, nproc, train_args, launcher, slots, args.vary_data_seed, interim)
            else:
                runner = SlurmRunner(
                    dump, config_file, nproc, train_args, launcher, slurm, args.parallel, args.vary_data_seed, interim
                )
            specs = adopt_earlier_runs(dump, specs, axes, config_file, train_args)  # an axis added: theirs too
            write_search(
                dump, args.search, spaces or {}, seeds, budgets, confirm_seeds, current_axes(specs, axes, train_args)
            )
            then = (
                f"each optimizer's best settings train on confirmation seeds {', '.join(map(str, confirm_seeds))}"
                if confirm_seeds
                else ""
            )
            if spaces is None:
                interim.expect("selection" if confirm_seeds else "planned", specs, then)
                statuses = run_all(runner, specs)
                failed = [s for s in statuses if s["outcome"] == FAILED]
                failed_text = f"{len(failed)} of {len(statuses)} runs failed (see their train.log)"
            else:

                def check(spec) -> None:  # a value --extend adds, before it trains
                    preflight_jobs([spec], config_file, nproc, train_args, args.vary_data_seed)

                interim.say(
                    "the coordinate descents are training (each step's runs are known once the step before ended)"
                    + (f"; then {then}." if then else ".")
                )
                found = run_descents(runner, read_search(dump), budgets, last_k, args.extend, check)
                failed = [d for _, _, _, d in found if d.state == "blocked"]
                failed_text = f"{len(failed)} of {len(found)} descents stopped at a run that failed (see its train.log)"
            # Every selection run has ended (under Slurm the sweep may exit while they run): the best settings are
            # known, so train them on the confirmation seeds.
            if spaces is None:
                ended = all(is_done(s) for s in statuses)
            else:
                ended = all(d.state == "converged" for *_, d in found)
            # A close call first gets more selection seeds for its two contenders, up to --selection-seeds-max.
            while seeds_max is not None and not failed and ended:
                more = close_call_specs(dump, last_k, seeds, confirm_seeds, seeds_max)
                if not more:
                    break
                interim.expect("close-call selection", more, then)
                statuses = run_all(runner, more)
                failed = [s for s in statuses if s["outcome"] == FAILED]
                failed_text = f"{len(failed)} of {len(statuses)} close-call selection runs failed (see their train.log)"
                ended = all(is_done(s) for s in statuses)
            if confirm_seeds and not failed and ended:
                write_confirmation_windows(dump, windows)
                confirming = confirmation_specs(dump, last_k, confirm_seeds, windows)
                interim.expect("confirmation", confirming)
                statuses = run_all(runner, confirming)
                failed = [s for s in statuses if s["outcome"] == FAILED]
                failed_text = f"{len(failed)} of {len(statuses)} confirmation runs failed (see their train.log)"
                ended = all(is_done(s) for s in statuses)
            # Under Slurm the sweep may leave while runs train: the page says what is still pending.
            in_progress = None if ended or failed else interim.pending()
    report = write_report(dump, last_k, args.baseline, in_progress, args.family_correction)
    if report is None and not print_states(dump) and slurm is None:
        raise UserError(f"no run in '{dump}' has ended yet; run the sweep first")
    if report is not None:
        print(format_markdown(report))
        print(f"wrote {dump / REPORT_NAME}.png, .md, .json and {dump / PAGE_NAME}")
        print_states(dump)
    if args.report_only:
        return 0
    if failed:
        first = first_failure(dump, since=sweep_started)
        print(f"error: {failed_text}{first}; run the same command again to retry", file=sys.stderr)
        return 1
    return 0
