"""The sweep's plan: which runs, their names and folders, the options each gets, and the checks before any starts.

Torch-free at import (the checks that need torch import it when called), so launchers and tools that only need a
run's name start fast.
"""

from __future__ import annotations

import fcntl
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from torchtitan.errors import UserError

# The sweep's folder: runs/{name}/ per run (train.py's dump folder plus train.log and sweep_status.json), and the
# settings every run shares.
RUNS_FOLDER = "runs"
STATUS_FILE = "sweep_status.json"
SETTINGS_FILE = "sweep_settings.json"
LOCK_FILE = "sweep.lock"
LOG_FILE = "train.log"
# A run's outcome, recorded in its status when it ends.
FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
# Options each run gets from the sweep itself; setting them in the shared options would make every run the same.
SWEEP_OPTIONS = {
    "optimizer.name": "--optimizers",
    "optimizer.lr": "--lrs",
    "training.seed": "--seeds",
    "job.dump_folder": "--dump-folder",
}
# With --vary-data-seed each run's seed is its data seed too (data that has a seed: its order), and the sweep sets it.
DATA_SEED_OPTION = "training.data_seed"


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


def items(raw: str) -> list[str]:
    """Space- or comma-separated values."""
    return [item for item in re.split(r"[,\s]+", raw.strip()) if item]


def parse_lrs(raw: str) -> list[float]:
    lrs = []
    for item in items(raw):
        try:
            lr = float(item)
        except ValueError:
            raise UserError(f"learning rate '{item}' is not a number; give LRS like '3e-4 1e-3 3e-3'") from None
        if not (math.isfinite(lr) and lr > 0):
            raise UserError(f"learning rate '{item}' must be a positive number")
        lrs.append(lr)
    return lrs


def parse_seeds(raw: str) -> list[int]:
    if not all(item.isdigit() for item in items(raw)):
        raise UserError(f"seeds '{raw}' must be non-negative integers, like '0 1 2'")
    return [int(item) for item in items(raw)]


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


def check_train_options(train_args: Sequence[str], vary_data_seed: bool = False) -> None:
    for arg in train_args:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if key in SWEEP_OPTIONS:
            raise UserError(
                f"--{key} is set by the sweep for each run; remove it from the train.py options and use "
                f"{SWEEP_OPTIONS[key]} (or the matching variable of scripts/compare_optimizers.sh)"
            )
        if vary_data_seed and key == DATA_SEED_OPTION:
            raise UserError(
                f"--{key} is set by the sweep for each run with --vary-data-seed; remove it from the train.py "
                "options, or drop --vary-data-seed to keep one data order for every seed"
            )


def spec_options(spec: RunSpec, vary_data_seed: bool = False) -> list[str]:
    """The train.py options a run's spec sets; with ``vary_data_seed`` its seed is its data seed too."""
    options = ["--optimizer.name", spec.optimizer, "--optimizer.lr", repr(spec.lr), "--training.seed", str(spec.seed)]
    return options + ([f"--{DATA_SEED_OPTION}", str(spec.seed)] if vary_data_seed else [])


def run_folder(dump: Path, spec: RunSpec) -> Path:
    return dump / RUNS_FOLDER / spec.name


def run_command(
    spec: RunSpec, run_dir: Path, train_args: Sequence[str], launcher: Sequence[str], vary_data_seed: bool = False
) -> list[str]:
    options = [
        "--metrics.enable_tensorboard",
        "true",
        *spec_options(spec, vary_data_seed),
        "--job.dump_folder",
        str(run_dir),
    ]
    return [*launcher, *train_args, *options]


def preflight_jobs(
    specs: Sequence[RunSpec], config_file: str, nproc: int, train_args: Sequence[str], vary_data_seed: bool = False
) -> None:
    """Check each optimizer's job as train.py will, so that a mistake stops the sweep before any run starts."""
    from torchtitan.config_manager import JobConfig
    from torchtitan.preflight import preflight

    checked = set()
    for spec in specs:
        if spec.optimizer in checked:
            continue
        checked.add(spec.optimizer)
        config = JobConfig.parse_args(
            ["--job.config_file", config_file, *train_args, *spec_options(spec, vary_data_seed)]
        )
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
