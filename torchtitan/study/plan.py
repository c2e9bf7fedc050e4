"""The sweep's plan: which runs, their names and folders, the options each gets, and the checks before any starts.

Torch-free at import (the checks that need torch import it when called), so launchers and tools that only need a
run's name start fast.
"""

from __future__ import annotations

import decimal
import fcntl
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.files import strict_json
from torchtitan.study.run_status import DIVERGED, FAILED, FINISHED, LOG_FILE, STATUS_FILE  # noqa: F401 (their home)

# The sweep's folder: runs/{name}/ per run (train.py's dump folder plus train.log and sweep_status.json), and the
# settings every run shares.
RUNS_FOLDER = "runs"
SETTINGS_FILE = "sweep_settings.json"
LOCK_FILE = "sweep.lock"
DEFAULT_LAST_K = 10  # final training loss = mean of the last k logged values, unless the sweep says otherwise
COMMAND_FILE = "command.sh"  # the run's exact command, environment and folder, runnable again
# Options each run gets from the sweep itself; setting them in the shared options would make every run the same.
SWEEP_OPTIONS = {
    "optimizer.name": "--optimizers",
    "optimizer.lr": "--lrs",
    "training.seed": "--seeds",
    "job.dump_folder": "--dump-folder",
}
# With --budgets each run's length and warmup come from its budget.
BUDGET_OPTIONS = {"training.steps": "--budgets", "training.warmup_steps": "--warmup-fraction"}
# A budget of "Nx" is N times this many tokens per non-embedding parameter (Chinchilla's rule of thumb).
TOKENS_PER_PARAM = 20
# With --vary-data-seed each run's seed is its data seed too (data that has a seed: its order), and the sweep sets it.
DATA_SEED_OPTION = "training.data_seed"


def lr_label(lr: float) -> str:
    """A short, exact name for a learning rate: 3e-4, 1e-3, 2.5e-4, 1e6 (``float(lr_label(lr)) == lr``)."""
    # repr is the shortest text that reads back as the same float: the label names exactly the lr the run used,
    # however many digits it has (two lrs that differ only past the 13th digit get two names, not one).
    mantissa, exponent = f"{decimal.Decimal(repr(float(lr))):e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def tokens_label(tokens: int) -> str:
    """A short, exact name for a token count: the shorter of its scientific form and its digits (2e8, 4096)."""
    return min(lr_label(float(tokens)), str(tokens), key=len)


@dataclass(frozen=True)
class Budget:
    """A run's token budget: the tokens asked for (``label`` as the user wrote it, normalised: ``2e8``, ``1x``),
    the optimizer steps that fit in it and the warmup fitted to those steps."""

    label: str
    tokens: int
    steps: int
    warmup_steps: int

    def status(self) -> dict:
        return {
            "budget": self.tokens,
            "budget_label": self.label,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
        }


@dataclass(frozen=True)
class RunSpec:
    optimizer: str  # canonical name, as train.py logs it
    lr: float
    seed: int
    budget: Optional[Budget] = None
    options: tuple[tuple[str, str], ...] = ()  # (train.py option, value as given) of every swept axis, by option
    # (train.py option, value) this run sets that keys no cell: not in its name or status (a confirmation run's
    # fresh validation windows)
    extra_options: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        tail = "".join(f"_{key}{value}" for key, value in self.options)
        tail += f"_tokens{self.budget.label}" if self.budget else ""
        return f"{self.optimizer}_lr{lr_label(self.lr)}_seed{self.seed}{tail}"


@dataclass(frozen=True)
class Axis:
    """One swept train.py option: its values, for every optimizer (``optimizer`` None) or for one."""

    key: str
    values: tuple[str, ...]
    optimizer: Optional[str] = None


def axis_value(text: str):
    """A swept value as the report orders it: a number where it reads as one, else its text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_axis(raw: str, budgets: bool = False, vary_data_seed: bool = False) -> Axis:
    """``section.key=V1,V2`` (every optimizer) or ``Optimizer:section.key=V1,V2`` (that optimizer's runs); with
    ``budgets`` the options each budget sets are not axes, with ``vary_data_seed`` the data seed is not."""
    head, equals, values = raw.partition("=")
    scope, _, key = head.rpartition(":")
    listed = items(values)
    if not equals or "." not in key or not listed:
        raise UserError(
            f"--axis '{raw}' is not an axis; give one like 'optimizer.weight_decay=0.0,0.1' or "
            "'AdamW:optimizer.beta2=0.95,0.99'"
        )
    if key in SWEEP_OPTIONS or (budgets and key in BUDGET_OPTIONS):
        flag = SWEEP_OPTIONS.get(key) or BUDGET_OPTIONS[key]
        raise UserError(f"--axis {key} is swept by the sweep's own {flag}; use that")
    if vary_data_seed and key == DATA_SEED_OPTION:
        raise UserError(f"--axis {key} is set by --vary-data-seed for each run; drop one of them")
    bad = [v for v in listed if "/" in v]
    if bad:
        raise UserError(f"--axis {key} value '{bad[0]}' names a path; axis values name run folders, give plain values")
    parsed = [axis_value(v) for v in listed]
    if len(set(map(repr, parsed))) < len(parsed):
        raise UserError(f"--axis {key} lists a value twice ({', '.join(listed)}); give each once")
    return Axis(key, tuple(listed), scope or None)


def axes_for(optimizer: str, axes: Sequence[Axis]) -> list[Axis]:
    """The axes of one optimizer's runs (optimizer names already resolved), by option."""
    return sorted((a for a in axes if a.optimizer in (None, optimizer)), key=lambda a: a.key)


def check_axes(axes: Sequence[Axis], optimizers: Sequence[str], train_args: Sequence[str]) -> list[Axis]:
    """Axes with their optimizer names resolved as train.py does; one line for an axis that would sweep nothing
    new (a key given twice for the same runs, an optimizer not in the sweep, a key also among the fixed options)."""
    from torchtitan.optim.builder import resolve_optimizer_name

    fixed = {arg[2:].partition("=")[0] for arg in train_args if arg.startswith("--")}
    resolved = []
    for axis in axes:
        optimizer = resolve_optimizer_name(axis.optimizer).name if axis.optimizer else None
        if optimizer is not None and optimizer not in optimizers:
            raise UserError(
                f"--axis {axis.optimizer}:{axis.key}: {optimizer} is not in --optimizers; add it or drop the axis"
            )
        if axis.key in fixed:
            raise UserError(f"--axis {axis.key} is also set among the train.py options; remove it from one of them")
        resolved.append(Axis(axis.key, axis.values, optimizer))
    for optimizer in optimizers:
        keys = [a.key for a in axes_for(optimizer, resolved)]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise UserError(f"--axis {repeated[0]} is given twice for {optimizer}'s runs; give it once")
    return resolved


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


def parse_budgets(raw: str) -> list[tuple[str, float, bool]]:
    """(label, value, is_multiple) per budget: tokens (``2e8``) or multiples of TOKENS_PER_PARAM tokens per
    non-embedding parameter (``1x``)."""
    budgets = []
    for item in items(raw):
        multiple = item.lower().endswith("x")
        try:
            value = float(item[:-1] if multiple else item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise UserError(
                f"budget '{item}' is neither a token count nor a multiple of {TOKENS_PER_PARAM} tokens per "
                "parameter; give BUDGETS like '2e8,4e8' or '1x,2x'"
            )
        budgets.append((f"{value:g}x" if multiple else tokens_label(round(value)), value, multiple))
    return budgets


def resolved_job(config_file: str, train_args: Sequence[str]):
    """The job (``JobConfig``) of ``config_file`` with ``train_args``, parsed once per study call and shared by
    everything that reads it (budgets, preflight, confirmation windows, earlier runs, W&B, Slurm): read it, never
    change it. Keyed by the file's path, size and modification time as well as the options, so an edited file is
    read again."""
    path = Path(config_file).resolve()
    stat = path.stat() if path.exists() else None
    key = (str(path), stat and (stat.st_size, stat.st_mtime_ns), tuple(train_args))
    return _resolve_job(key)


@functools.lru_cache(maxsize=256)
def _resolve_job(key: tuple):
    from torchtitan.config.job_config import JobConfig

    config_file, _, train_args = key
    return JobConfig.parse_args(["--job.config_file", config_file, *train_args])


def tokens_per_step(config_file: str, nproc: int, train_args: Sequence[str]) -> tuple[int, int]:
    """(tokens per optimizer step, non-embedding parameters) of the job: batch_size x seq_len x data-parallel
    degree x gradient_accumulation_steps, and the flavor's parameters counted on the meta device."""
    from torchtitan.config.preflight import model_args_for
    from torchtitan.models.llama import non_embedding_params
    from torchtitan.parallelisms.parallel_dims import ParallelDims

    config = resolved_job(config_file, train_args)
    dims = ParallelDims.from_job_config(config, nproc)
    dims.validate()
    t = config.training
    per_step = t.batch_size * t.seq_len * dims.dp_replicate * dims.dp_shard * t.gradient_accumulation_steps
    return per_step, non_embedding_params(model_args_for(config, vocab_size=1))


def job_warmup_fraction(config_file: str, train_args: Sequence[str]) -> float:
    """The job's own warmup as a share of its steps: training.warmup_steps / training.steps."""
    t = resolved_job(config_file, train_args).training
    return min(1.0, t.warmup_steps / t.steps)


def fit_budgets(
    budgets: Sequence[tuple[str, float, bool]], per_step: int, params: int, warmup_fraction: float
) -> list[Budget]:
    """Each budget's steps (the whole steps of ``per_step`` tokens that fit in it) and warmup (``warmup_fraction``
    of those steps, rounded): every budget is a schedule of its own, not a cut of a longer one."""
    fitted = []
    for label, value, multiple in budgets:
        tokens = round(value * TOKENS_PER_PARAM * params) if multiple else round(value)
        steps = tokens // per_step
        if steps < 1:
            raise UserError(
                f"budget {label} ({tokens:,} tokens) is less than one step of {per_step:,} tokens (batch_size x "
                "seq_len x data-parallel degree x gradient_accumulation_steps); raise the budget or lower the batch"
            )
        fitted.append(Budget(label, tokens, steps, round(warmup_fraction * steps)))
    repeated = sorted({b.label for b in fitted if [c.tokens for c in fitted].count(b.tokens) > 1})
    if repeated:
        raise UserError(f"the sweep lists the budget of {', '.join(repeated)} tokens twice; give each budget once")
    return fitted


def lrs_of(lrs, optimizer: str) -> Sequence[float]:
    """An optimizer's lrs: ``lrs`` itself, or its entry where ``lrs`` maps optimizers to their own (a study over sizes
    that carries each optimizer's lr grid up to the next size)."""
    return lrs[optimizer] if isinstance(lrs, dict) else lrs


def plan(
    optimizers: Sequence[str],
    lrs,
    seeds: Sequence[int],
    budgets: Sequence[Optional[Budget]] = (None,),
    axes: Sequence[Axis] = (),
    train_args: Sequence[str] = (),
) -> list[RunSpec]:
    """Every combination, optimizer-major, then budget, then the axes' values; names resolved as train.py does
    (``adam_mini`` is AdamMini)."""
    from torchtitan.optim.builder import resolve_optimizer_name

    for what, values in (("optimizers", optimizers), ("lrs", lrs), ("seeds", seeds)):
        if not values:
            raise UserError(f"the sweep needs at least one of {what}; set {what.upper()} (space- or comma-separated)")
    names = [resolve_optimizer_name(name).name for name in optimizers]
    axes = check_axes(axes, names, train_args)
    specs = [
        RunSpec(o, lr, seed, b, options)
        for o in names
        for b in budgets
        for options in _axis_points(axes_for(o, axes))
        for lr in lrs_of(lrs, o)
        for seed in seeds
    ]
    run_names = [s.name for s in specs]
    repeated = sorted({n for n in run_names if run_names.count(n) > 1})
    if repeated:
        raise UserError(f"the sweep lists a run twice ({', '.join(repeated)}); give each optimizer, lr and seed once")
    return specs


def _axis_points(axes: Sequence[Axis]) -> list[tuple[tuple[str, str], ...]]:
    points: list[tuple[tuple[str, str], ...]] = [()]
    for axis in axes:
        points = [(*point, (axis.key, value)) for point in points for value in axis.values]
    return points


def check_train_options(train_args: Sequence[str], vary_data_seed: bool = False, budgets: bool = False) -> None:
    for arg in train_args:
        key = arg[2:].partition("=")[0] if arg.startswith("--") else None
        if budgets and key in BUDGET_OPTIONS:
            raise UserError(
                f"--{key} is set by the sweep for each budget; remove it from the train.py options and use "
                f"{BUDGET_OPTIONS[key]}"
            )
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
    for key, value in spec.options:
        options += [f"--{key}", value]
    if spec.budget is not None:
        options += [
            "--training.steps",
            str(spec.budget.steps),
            "--training.warmup_steps",
            str(spec.budget.warmup_steps),
        ]
    for key, value in spec.extra_options:
        options += [f"--{key}", value]
    return options + ([f"--{DATA_SEED_OPTION}", str(spec.seed)] if vary_data_seed else [])


def run_folder(dump: Path, spec: RunSpec) -> Path:
    return dump / RUNS_FOLDER / spec.name


def run_command(
    spec: RunSpec,
    run_dir: Path,
    train_args: Sequence[str],
    launcher: Sequence[str],
    vary_data_seed: bool = False,
    wandb_group: Optional[str] = None,
) -> list[str]:
    """A run's train.py command; with ``wandb_group`` (the study's jobs log to W&B) the W&B run is named after the
    run and grouped by the study."""
    options = [
        "--metrics.enable_tensorboard",
        "true",
        *spec_options(spec, vary_data_seed),
        "--job.dump_folder",
        str(run_dir),
    ]
    if wandb_group is not None:
        options += ["--metrics.wandb_run_name", spec.name, "--metrics.wandb_group", wandb_group]
    return [*launcher, *train_args, *options]


def wandb_group(dump: Path, config_file: str, train_args: Sequence[str]) -> Optional[str]:
    """The W&B group of a study's runs (the study folder's name) when its job logs to W&B; else None."""
    enabled = resolved_job(config_file, train_args).metrics.enable_wandb
    return Path(dump).resolve().name if enabled else None


def preflight_jobs(
    specs: Sequence[RunSpec], config_file: str, nproc: int, train_args: Sequence[str], vary_data_seed: bool = False
) -> None:
    """Check each optimizer's job (at each budget and point of its axes) as train.py will, so that a mistake stops
    the sweep before any run starts."""
    from torchtitan.config.preflight import preflight

    checked = set()
    for spec in specs:
        if (spec.optimizer, spec.budget, spec.options) in checked:
            continue
        checked.add((spec.optimizer, spec.budget, spec.options))
        config = resolved_job(config_file, [*train_args, *spec_options(spec, vary_data_seed)])
        preflight(config, nproc)  # the optimizer's name and options included


def recorded_settings(dump: Path) -> dict:
    """The settings the sweep in ``dump`` recorded (``sweep_settings.json``), empty before its first run."""
    path = dump / SETTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


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
    path.write_text(strict_json(settings))


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
