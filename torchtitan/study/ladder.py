"""One study over model sizes: each size a study of its own (its own search, confirmation and budgets, in
``DUMP/sizes/{flavor}/``, with its own batch size and process count where given), and the scale view over them in
``DUMP`` (``scale_report``).

The sizes run smallest first. With ``--carry-lrs`` the first two sizes search ``--lrs``; each later size waits for
every smaller one to be done (its best settings chosen and confirmed) and searches the ``--lrs`` grid moved to
centre on the lr the smaller sizes' power law predicts for it (``scale.carried_grid``); that grid is recorded in
``ladder.json`` and kept when the study resumes (an optimizer a later call adds gets its own carried grid; a size
that already trained on ``--lrs`` keeps them when a smaller size is added below it). A size named in a later call
joins the same study and page.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.files import strict_json, write_text_atomically
from torchtitan.study.plan import (
    DEFAULT_LAST_K,
    DIVERGED,
    FINISHED,
    RUNS_FOLDER,
    items,
    parse_lrs,
    recorded_settings,
    resolved_job,
)
from torchtitan.study.scale import carried_grid, fit_log_line

LADDER_FILE = "ladder.json"  # the study's sizes (flavor: non-embedding parameters), carried grids, --carry-lrs
SIZES_FOLDER = "sizes"
FLAVOR_OPTION = "model.flavor"


def is_ladder(dump: Path) -> bool:
    return (dump / LADDER_FILE).exists()


def read_ladder(dump: Path) -> dict:
    path = dump / LADDER_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def size_folder(dump: Path, flavor: str) -> Path:
    return dump / SIZES_FOLDER / flavor


def flavor_params(flavor: str) -> int:
    """The flavor's non-embedding parameters, the N of every law (budgets' 20 tokens per parameter count them)."""
    from torchtitan.models.llama import llama3_configs, non_embedding_params

    if flavor not in llama3_configs:
        raise UserError(
            f"--ladder size '{flavor}' is not a model flavor; give flavors like 'ladder-30M,ladder-60M' "
            f"(known: {', '.join(llama3_configs)})"
        )
    return non_embedding_params(llama3_configs[flavor])


def ladder_flavors(args: argparse.Namespace) -> list[str]:
    """The sizes of this call: ``--ladder A,B`` or ``--axis model.flavor=A,B`` (which it takes off the axes); empty
    when neither is given."""
    flavors = items(args.ladder) if args.ladder else []
    if args.ladder is not None and not flavors:
        raise UserError("--ladder is empty; give model flavors like 'ladder-30M,ladder-60M', or leave it out")
    kept = []
    for raw in args.axis:
        head, _, values = raw.partition("=")
        scope, _, key = head.rpartition(":")
        if key != FLAVOR_OPTION:
            kept.append(raw)
            continue
        if scope:
            raise UserError(
                f"--axis {raw}: model size is an axis of every optimizer's runs; give --axis {FLAVOR_OPTION}=... "
                "without an optimizer"
            )
        if flavors:
            raise UserError(f"the sizes are given twice (--ladder and --axis {FLAVOR_OPTION}); give them once")
        flavors = items(values)
    args.axis = kept
    if len(set(flavors)) < len(flavors):
        raise UserError(f"--ladder lists a size twice ({', '.join(flavors)}); give each once")
    return flavors


def parse_size_options(raw: Sequence[str], flavors: Sequence[str]) -> dict[str, list[str]]:
    """``--size-option FLAVOR:section.key=VALUE`` as each size's extra train.py options."""
    options: dict[str, list[str]] = {}
    for entry in raw:
        flavor, colon, rest = entry.partition(":")
        key, equals, value = rest.partition("=")
        if not colon or not equals or "." not in key or not value:
            raise UserError(
                f"--size-option '{entry}' is not a size's option; give one like 'ladder-520M:training.batch_size=16'"
            )
        if flavor not in flavors:
            raise UserError(f"--size-option {entry}: {flavor} is not among the sizes ({', '.join(flavors)})")
        if key == FLAVOR_OPTION:
            raise UserError(f"--size-option {entry}: a size's flavor is its name; drop the option")
        options.setdefault(flavor, []).extend([f"--{key}", value])
    return options


def parse_size_nproc(raw: Sequence[str], flavors: Sequence[str]) -> dict[str, int]:
    """``--size-nproc FLAVOR=N`` as each size's processes per run."""
    nproc = {}
    for entry in raw:
        flavor, equals, value = entry.partition("=")
        if not equals or not value.isdigit() or int(value) < 1:
            raise UserError(f"--size-nproc '{entry}' is not a size's process count; give one like 'ladder-1.2B=8'")
        if flavor not in flavors:
            raise UserError(f"--size-nproc {entry}: {flavor} is not among the sizes ({', '.join(flavors)})")
        nproc[flavor] = int(value)
    return nproc


def _last_k(args: argparse.Namespace, folder: Path) -> int:
    return args.last_k if args.last_k is not None else recorded_settings(folder).get("last_k", DEFAULT_LAST_K)


def size_reports(
    dump: Path, args: argparse.Namespace, baseline: Optional[str], written: Sequence[str] = ()
) -> list[dict]:
    """Each size's report: read back for the sizes in ``written`` (their sweep of this call has just written it),
    written again in its folder for the others (their runs may have ended since); sizes no run of which has ended
    are left out."""
    from torchtitan.study.report import REPORT_NAME, write_report

    record = read_ladder(dump)
    reports = []
    for flavor, params in record.get("sizes", {}).items():
        folder = size_folder(dump, flavor)
        if not (folder / RUNS_FOLDER).is_dir():
            continue
        if flavor in written and (folder / f"{REPORT_NAME}.json").exists():
            report = json.loads((folder / f"{REPORT_NAME}.json").read_text())
        else:
            report = write_report(folder, _last_k(args, folder), baseline)
        if report is not None:
            reports.append({"size": flavor, "params": params, "folder": f"{SIZES_FOLDER}/{flavor}", "report": report})
    return reports


def done(report: dict) -> bool:
    """A size whose every optimizer has best settings, confirmed where the study confirms."""
    return bool(report["best"]) and all(
        b["settings"] is not None and b.get("confirmation", FINISHED) == FINISHED for b in report["best"].values()
    )


def diverged_everywhere(report: dict) -> list[str]:
    """The optimizers whose every setting at the size's largest budget diverged: no best setting will ever come
    of these runs (a failed one trains again; a diverged one does not)."""
    budget = report["budgets"][-1] if report["budgets"] else None
    stuck = []
    for optimizer, b in report["best"].items():
        cells = [c for c in report["grid"] if c["optimizer"] == optimizer and c["budget"] == budget]
        if b["settings"] is None and cells and all(c["outcome"] == DIVERGED for c in cells):
            stuck.append(optimizer)
    return stuck


def check_size_jobs(args: argparse.Namespace, train_args: Sequence[str], options: dict, flavors: Sequence[str]):
    """Each size's job (the train.py options with its own) parsed before the first run trains, so that a mistake
    in a later size's option stops the study before the smaller sizes train, not after."""
    config_file = str(Path(args.config_file).resolve())
    for flavor in flavors:
        size_train = [*train_args, *options.get(flavor, []), f"--{FLAVOR_OPTION}", flavor]
        try:
            resolved_job(config_file, size_train)  # the very job the size's sweep reads again from the cache
        except UserError as e:
            raise UserError(f"size {flavor}: {e}") from None


def best_lrs(report: dict) -> dict[str, float]:
    return {o: b["settings"]["lr"] for o, b in report["best"].items() if b["settings"] is not None}


def carried_lrs(
    flavor: str, params: int, smaller: Sequence[dict], lrs: Sequence[float], optimizers: Sequence[str]
) -> dict:
    """Per optimizer: the lr the power law of the smaller sizes' best lrs predicts for this size and the grid of
    ``lrs`` centred on it."""
    grids = {}
    for optimizer in optimizers:
        known = [(s["params"], best_lrs(s["report"]).get(optimizer)) for s in smaller]
        known = [(p, lr) for p, lr in known if lr is not None]
        line = fit_log_line([p for p, _ in known], [lr for _, lr in known])
        if line is None:
            raise UserError(
                f"--carry-lrs: {optimizer} has a best lr at fewer than two sizes below {flavor}; run those sizes "
                "first, or drop --carry-lrs"
            )
        predicted = line.at(params)
        # A best lr at an end of its size's grid is a bound, not an optimum: carried, and marked as such.
        edges = {
            s["size"]: e["end"]
            for s in smaller
            for e in (s["report"]["best"].get(optimizer) or {}).get("edges") or []
            if e["setting"] == "lr"
        }
        grids[optimizer] = {
            "predicted": predicted,
            "lrs": carried_grid(lrs, predicted),
            "from": [s["size"] for s in smaller],
            "edges": edges,
        }
    return grids


def run_ladder(args: argparse.Namespace, train_args: list[str], run_sweep: Callable, flavors: Sequence[str]) -> int:
    """Train what each size still lacks, smallest first, then write every size's report and the scale view."""
    from torchtitan.optim.builder import resolve_optimizer_name
    from torchtitan.study.scale_report import write_scale_report
    from torchtitan.study.summary import DEFAULT_BASELINE

    dump = Path(args.dump_folder).resolve()
    target = args.target_params
    if target is not None and not (math.isfinite(target) and target > 0):
        raise UserError(f"--target-params must be a finite positive number of parameters, like 8e9; got {target:g}")
    if any(a.startswith(f"--{FLAVOR_OPTION}") for a in train_args):
        raise UserError(
            f"--{FLAVOR_OPTION} is set by the study for each size; remove it and list the sizes in --ladder"
        )
    record = read_ladder(dump)
    code, written = 0, []
    if target is None:  # the last one given: --report-only and a later call keep extrapolating to it
        target = record.get("target_params")
    if args.report_only:
        if not record:
            raise UserError(f"'{dump}' holds no study over sizes ({LADDER_FILE}); pass the folder of one")
    else:
        if not flavors:
            raise UserError(
                f"'{dump}' holds a study over sizes ({', '.join(record.get('sizes', {}))}); name the sizes to train "
                "with --ladder, or add --report-only"
            )
        if (dump / RUNS_FOLDER).is_dir():
            raise UserError(
                f"'{dump}' holds a study of one size ({RUNS_FOLDER}/); give the study over sizes a new dump folder"
            )
        sizes = {f: flavor_params(f) for f in flavors}
        options = parse_size_options(args.size_option, flavors)
        nprocs = parse_size_nproc(args.size_nproc, flavors)
        check_size_jobs(args, train_args, options, flavors)
        if args.carry_lrs and len(parse_lrs(args.lrs)) < 2:
            raise UserError(
                "--carry-lrs moves the --lrs grid to each size's predicted lr; give --lrs two or more values"
            )
        dump.mkdir(parents=True, exist_ok=True)
        record = {
            **record,
            "sizes": dict(sorted({**record.get("sizes", {}), **sizes}.items(), key=lambda fp: fp[1])),
            "carry_lrs": bool(args.carry_lrs or record.get("carry_lrs")),
            "target_params": target,
        }
        record.setdefault("grids", {})
        write_text_atomically(dump / LADDER_FILE, strict_json(record))
        optimizers = [resolve_optimizer_name(o).name for o in items(args.optimizers)]
        lrs = parse_lrs(args.lrs)
        waiting = []
        ordered = list(record["sizes"].items())
        for flavor in sorted(flavors, key=sizes.__getitem__):
            size_args = copy.copy(args)
            size_args.dump_folder = str(size_folder(dump, flavor))
            if flavor in nprocs:  # its own process count: as many GPUs in use at once as the others use
                base = args.nproc or getattr(args, "slurm_gpus", None) or 1
                size_args.nproc = nprocs[flavor]
                size_args.parallel = max(1, args.parallel * base // nprocs[flavor])
                if getattr(args, "scheduler", "local") == "slurm":
                    size_args.slurm_gpus = nprocs[flavor]
            index = [f for f, _ in ordered].index(flavor)
            # Carried up: a size from the third on, unless it already trained on --lrs (a smaller size added later).
            grids = record["grids"].get(flavor, {})
            carried = args.carry_lrs and index >= 2 and (grids or not size_folder(dump, flavor).exists())
            missing = [o for o in optimizers if o not in grids]  # an optimizer this call adds: its grid too
            if carried and missing:
                reports = size_reports(dump, args, args.baseline, written)
                smaller = [r for r in reports if r["params"] < sizes[flavor]]
                unready = {f for f, _ in ordered[:index]} - {r["size"] for r in smaller if done(r["report"])}
                stuck = [
                    (r["size"], o) for r in smaller if r["size"] in unready for o in diverged_everywhere(r["report"])
                ]
                if stuck:
                    size, optimizer = stuck[0]
                    raise UserError(
                        f"--carry-lrs: {optimizer} diverged at every lr of {size}, so there is no best lr to carry up "
                        f"to {flavor}; give --lrs smaller values (that size trains them on the next call) or drop "
                        f"{optimizer}"
                    )
                if unready:
                    waiting.append(f"{flavor} waits for {', '.join(sorted(unready))}")
                    continue
                grids = {**grids, **carried_lrs(flavor, sizes[flavor], smaller, lrs, missing)}
                record["grids"][flavor] = grids
                write_text_atomically(dump / LADDER_FILE, strict_json(record))
            if carried:
                size_args.carried_lrs = {o: grids[o]["lrs"] for o in optimizers}
            print(f"== size {flavor} ({sizes[flavor]:,} non-embedding parameters): {size_args.dump_folder}", flush=True)
            size_train = [*train_args, *options.get(flavor, []), f"--{FLAVOR_OPTION}", flavor]
            code = max(code, run_sweep(size_args, size_train))
            written.append(flavor)
        for line in waiting:
            print(f"note: {line} to be done (its lr grid is carried up from them); run the same command again")
    reports = size_reports(dump, args, args.baseline, [] if args.report_only else written)
    if not reports:
        raise UserError(f"no run in '{dump}' has ended yet; run the study first")
    write_scale_report(dump, reports, record, args.baseline or DEFAULT_BASELINE, target)
    print(f"wrote the scale view: {dump / 'study.html'}, sweep.md and scale.json")
    return code


def add_ladder_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ladder",
        default=None,
        metavar="FLAVOR,FLAVOR,...",
        help="one study over these model sizes (model flavors, e.g. ladder-30M,ladder-60M,ladder-130M; the same as "
        "--axis model.flavor=...): each size its own search and confirmation in DUMP/sizes/FLAVOR, --budgets in "
        "multiples of 20 tokens per parameter of each size, and the scale view in DUMP/study.html",
    )
    p.add_argument(
        "--size-option",
        action="append",
        default=[],
        metavar="FLAVOR:SECTION.KEY=VALUE",
        help="a train.py option for one size's runs only (its batch size, ...); repeat for more",
    )
    p.add_argument(
        "--size-nproc",
        action="append",
        default=[],
        metavar="FLAVOR=N",
        help="processes per run for one size's runs (default --nproc), with --parallel scaled down to keep the GPUs "
        "in use (under Slurm, also its --slurm-gpus); repeat for more sizes",
    )
    p.add_argument(
        "--carry-lrs",
        action="store_true",
        help="from the third size on, centre each size's lr grid (the --lrs grid, moved) on the lr the power law "
        "of the smaller sizes' best lrs predicts for it; a size waits for the smaller ones to be done",
    )
    p.add_argument(
        "--target-params",
        type=float,
        default=None,
        help="the size the scale view extrapolates each trend and law to (non-embedding parameters, e.g. 8e9); kept "
        "for later calls",
    )


def check_no_ladder_options(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (
            ("--size-option", args.size_option),
            ("--size-nproc", args.size_nproc),
            ("--carry-lrs", args.carry_lrs),
            ("--target-params", args.target_params is not None),
        )
        if value
    ]
    if given:
        raise UserError(f"{given[0]} applies to a study over sizes; add --ladder FLAVOR,FLAVOR,..., or drop it")
