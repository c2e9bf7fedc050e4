"""Reading finished runs: the scalars train.py logs (TensorBoard events and metrics.jsonl), the folders that hold
them, the data each run read (``dataset.json``), and a sweep's runs.

Only reading lives here; what the numbers mean is ``summary.py``. Torch-free, so the tools start fast.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.study.plan import RUNS_FOLDER, STATUS_FILE, Budget, RunSpec
from torchtitan.study.run_status import (  # noqa: F401 (their home: a leaf, which a job script's record imports)
    EVENT_FILE_PREFIX,
    GRAD_NORM,
    LOSS,
    METRICS_FILE,
    VALIDATION_LOSS,
    event_scalars_by_step,
    logging_folders,
    merged_by_step,
    metrics_by_step,
    read_jsonl,
    read_status,
    write_status,
)

# The tags train.py logs (see train.py's metrics); GPU runs log the allocator's peak, CPU runs the process RSS.
TPS = "throughput/tps"
TOKENS_SEEN = "throughput/tokens_seen"
# GPU runs log the allocator's peak (max_active in runs of older versions); CPU runs log the process RSS. The first
# one a run logs is its peak memory.
MEMORY_TAGS = ("memory/max_allocated(GiB)", "memory/max_active(GiB)", "memory/rss(GiB)")
STATE_BYTES = "optimizer/state_bytes"
DATASET_FILE = "dataset.json"  # {"fingerprint", "source", "data_seed"} of the data a run read, beside metrics.jsonl


@dataclass(frozen=True)
class Series:
    """One scalar tag of one run: steps in increasing order and the value logged at each."""

    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Run:
    """A TensorBoard run folder, as compare_runs shows it."""

    name: str
    path: Path
    scalars: dict[str, Series]


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep that ended: what it was, its ``sweep_status.json``, and its scalars over every restart."""

    spec: RunSpec
    status: dict
    scalars: dict[str, Series]
    dataset: Optional[dict] = None  # its dataset.json; None for a run that wrote none
    config: Optional[str] = None  # its latest job_config.toml, relative to the run's folder; None if none written


def _has_event_files(folder: Path) -> bool:
    return any(p.is_file() and p.name.startswith(EVENT_FILE_PREFIX) for p in folder.iterdir())


def series_of(by_step: dict[int, float]) -> Series:
    steps = tuple(sorted(by_step))
    return Series(steps, tuple(by_step[s] for s in steps))


def read_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar tag in the event files of ``run_dir`` (classic ``simple_value`` and tensor-style scalars).

    A resumed run may log a step twice; the later value wins.
    """
    return {tag: series_of(by_step) for tag, by_step in event_scalars_by_step(run_dir).items()}


def read_metrics_jsonl(path: Path) -> dict[str, Series]:
    """Every scalar of a ``metrics.jsonl`` (one ``{"step": N, tag: value, ...}`` object a line); a later line wins
    for a step, and a torn line is left out (:func:`read_jsonl`)."""
    return {tag: series_of(by_step) for tag, by_step in metrics_by_step(path).items()}


def read_logged(folder: Path) -> dict[str, Series]:
    """The scalars of one logging folder: its ``metrics.jsonl`` when it has one (the numbers as logged, read many
    times faster than event files, which round them to float32), else its TensorBoard event files."""
    jsonl = folder / METRICS_FILE
    return read_metrics_jsonl(jsonl) if jsonl.is_file() else read_scalars(folder)


def _logging_folders(run_dir: Path) -> list[Path]:
    """The folders below ``run_dir`` that train.py logged into, oldest first (a restarted run has several)."""
    return [Path(folder) for folder in logging_folders(run_dir)]


def merged_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar logged below ``run_dir``, over all its logging folders, oldest first, so that a later value of
    a step wins (:func:`run_status.merged_by_step`)."""
    return {tag: series_of(by_step) for tag, by_step in merged_by_step(run_dir).items()}


def latest_record(run_dir: Path, name: str) -> Optional[Path]:
    """The file ``name`` in the run's latest logging folder that has one (train.py writes ``dataset.json`` and
    ``job_config.toml`` beside its metrics); None when none has."""
    found = None
    for folder in _logging_folders(run_dir):
        if (folder / name).is_file():
            found = folder / name
    return found


def read_dataset(run_dir: Path) -> Optional[dict]:
    """The ``dataset.json`` of the run's latest logging folder that has one; None when none has."""
    path = latest_record(run_dir, DATASET_FILE)
    return None if path is None else json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------------------
# compare_runs: TensorBoard run folders


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
    """The runs in ``paths`` that logged a training step, named by ``labels`` or their folders."""
    run_dirs = find_run_dirs(paths)
    runs, empty = [], []
    for name, run_dir in zip(_run_names(run_dirs, labels), run_dirs):
        scalars = read_logged(run_dir)
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
# The sweep: one folder per run, each with a status once it ended


def status_budget(status: dict) -> Optional[Budget]:
    """The budget a sweep run's status records (None for a run of a sweep without --budgets)."""
    if "budget_label" not in status:
        return None
    return Budget(status["budget_label"], int(status["budget"]), int(status["steps"]), int(status["warmup_steps"]))


def load_sweep_run(status_path: Path) -> SweepRun:
    """The run whose ``sweep_status.json`` this is, with its scalars and data record."""
    status = json.loads(status_path.read_text())
    options = tuple(sorted(status.get("option_values", {}).items()))
    spec = RunSpec(status["optimizer"], float(status["lr"]), int(status["seed"]), status_budget(status), options)
    from torchtitan.config.job_config import JOB_CONFIG_RECORD  # here: a job script's record needs no config

    run_dir = status_path.parent
    config = latest_record(run_dir, JOB_CONFIG_RECORD)
    return SweepRun(
        spec, status, merged_scalars(run_dir), read_dataset(run_dir), config and str(config.relative_to(run_dir))
    )


def status_paths(dump: Path) -> list[Path]:
    """The ``sweep_status.json`` of every run in the sweep's folder that ended."""
    return sorted((dump / RUNS_FOLDER).glob(f"*/{STATUS_FILE}"))


def started(status: dict) -> float:
    """When a run started (statuses of older sweeps record only when it ended and how long it took)."""
    return status.get("started", status["ended"] - status.get("seconds", 0.0))


def sweep_order(runs: Sequence[SweepRun]) -> list[SweepRun]:
    """Optimizers in the order the sweep first started them (its plan's order, however many runs go at once), then
    by budget, lr and seed."""
    first: dict[str, float] = {}
    for r in runs:
        first[r.spec.optimizer] = min(first.get(r.spec.optimizer, math.inf), started(r.status))
    return sorted(
        runs,
        key=lambda r: (
            first[r.spec.optimizer],
            r.spec.optimizer,
            r.spec.budget.tokens if r.spec.budget else 0,
            r.spec.lr,
            r.spec.seed,
        ),
    )


def load_sweep_runs(dump: Path) -> list[SweepRun]:
    """Every run in the sweep's folder that ended (has a status), in :func:`sweep_order`."""
    return sweep_order([load_sweep_run(path) for path in status_paths(dump)])
