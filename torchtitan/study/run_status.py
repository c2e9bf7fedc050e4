"""What a run folder says of its run's end, read and decided with nothing but the standard library's lightest parts:
its ``sweep_status.json`` (read, written, and whether the run is done), its own exit code, the scalars it logged
(``metrics.jsonl``, merged over its restarts), its outcome, and files of one JSON object a line.

A leaf (``os``, ``json``, ``re``, ``math``, ``sys``, and the leaves ``torchtitan.errors`` and ``torchtitan.files``):
a Slurm job script's record of each start and end imports it (``torchtitan/study/slurm_job.py``), twice per start
of every run of a study. ``plan``, ``run_folders`` and ``scheduling`` take these from here.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections import namedtuple

from torchtitan.errors import DIVERGENCE_EXIT_CODE, read_exit_record
from torchtitan.files import strict_json, write_text_atomically

STATUS_FILE = "sweep_status.json"  # in a run's folder, once it ended: its cell, command, outcome and times
LOG_FILE = "train.log"  # in a run's folder: the output of each of its attempts
# A run's outcome, recorded in its status when it ends.
FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
# The tag of train.py's training loss: a run that logged none did not train.
LOSS = "loss_metrics/global_avg_loss"
VALIDATION_LOSS = "validation/loss"
GRAD_NORM = "grad_norm"
EVENT_FILE_PREFIX = "events.out.tfevents"
METRICS_FILE = "metrics.jsonl"  # train.py's logger writes it beside its event files: the same scalars, fast to read
ATTEMPT_MARK = "\n$ "  # each attempt's output in train.log follows a line "$ {command}" (Slurm's: "$ (Slurm job ...")
# A line that says what went wrong: train.py's one-line errors, and the last line of a Python traceback.
_ERROR_LINE = re.compile(r"^(error: |[\w.]*(Error|Exception|Interrupt): )")


def read_json(path: str | os.PathLike) -> dict | None:
    """A run folder's JSON file, None while it does not exist."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def read_status(run_dir: str | os.PathLike) -> dict | None:
    return read_json(os.path.join(run_dir, STATUS_FILE))


def write_status(run_dir: str | os.PathLike, status: dict) -> None:
    """Write ``sweep_status.json`` atomically: a run has a complete status or none."""
    write_text_atomically(os.path.join(run_dir, STATUS_FILE), strict_json(status))


def is_done(status: dict | None) -> bool:
    """A run that never trains again: it finished or diverged (a failed or interrupted one is tried again)."""
    return status is not None and status["outcome"] in (FINISHED, DIVERGED)


def run_exit_code(run_dir: str | os.PathLike, launcher_code: int, started: float) -> tuple[int, str | None]:
    """The run's own exit code and message: what train.py's first rank recorded in the run's folder during this
    attempt (torchrun reports any worker's failure, a divergence or a mistake alike, as 1); else the launcher's
    code, and no message."""
    record = read_exit_record(run_dir, since=started)
    if record is None or launcher_code == 0 and record["exit_code"] != 0:
        return launcher_code, None
    return int(record["exit_code"]), record.get("message") or None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The objects of a file of one JSON object a line, written by appending (a crash or a full disk can tear a
    line, and a later writer goes on after it): a line cut short, or not an object, is left out with a warning on
    stderr (none for a last line cut short, the trace of a writer that stopped)."""
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):
            print(f"warning: {path}: line {number} is not a whole JSON object (torn); left out", file=sys.stderr)
    return records


def metrics_by_step(path: str | os.PathLike) -> dict[str, dict[int, float]]:
    """Every scalar of a ``metrics.jsonl`` (one ``{"step": N, tag: value, ...}`` object a line), by tag and step; a
    later line wins for a step, and a torn line is left out (:func:`read_jsonl`)."""
    by_tag: dict[str, dict[int, float]] = {}
    for record in read_jsonl(path):
        if not isinstance(record.get("step"), int):
            continue
        step = int(record.pop("step"))
        for tag, value in record.items():
            if isinstance(value, (int, float)):
                by_tag.setdefault(tag, {})[step] = float(value)
    return by_tag


def logging_folders(run_dir: str | os.PathLike) -> list[str]:
    """The folders below ``run_dir`` that train.py logged into, oldest first (a restarted run has several)."""

    def started(folder: str) -> tuple[float, str]:
        # Event files are named events.out.tfevents.{unix time}.{host}...; the oldest one dates the folder.
        times = [int(name.split(".")[3]) for name in os.listdir(folder) if name.startswith(EVENT_FILE_PREFIX)]
        if not times:
            times = [int(os.stat(os.path.join(folder, METRICS_FILE)).st_mtime)]
        return min(times), os.path.basename(folder)

    folders = set()
    for folder, _, names in os.walk(run_dir):
        if any(
            (name == METRICS_FILE or name.startswith(EVENT_FILE_PREFIX)) and os.path.isfile(os.path.join(folder, name))
            for name in names
        ):
            folders.add(folder)
    return sorted(folders, key=started)


def logged_by_step(folder: str | os.PathLike) -> dict[str, dict[int, float]]:
    """The scalars of one logging folder, by tag and step: its ``metrics.jsonl`` when it has one (the numbers as
    logged, read many times faster than event files, which round them to float32), else its TensorBoard event
    files (``run_folders.read_scalars``, imported only then)."""
    jsonl = os.path.join(folder, METRICS_FILE)
    return metrics_by_step(jsonl) if os.path.isfile(jsonl) else event_scalars_by_step(folder)


def event_scalars_by_step(folder: str | os.PathLike) -> dict[str, dict[int, float]]:
    """Every scalar tag in the TensorBoard event files of ``folder`` (classic ``simple_value`` and tensor-style
    scalars), by tag and step. A resumed run may log a step twice; the later value wins."""
    if sys.flags.no_site:  # a job script's record starts without site-packages (python -S): TensorBoard needs them
        import site

        site.main()
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars = {
        tag: {e.step: float(e.value) for e in accumulator.Scalars(tag)}
        for tag in tags.get(event_accumulator.SCALARS, [])
    }
    for tag in tags.get(event_accumulator.TENSORS, []):
        arrays = [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)]
        if arrays and all(a.size == 1 for _, a in arrays):
            scalars.setdefault(tag, {step: float(a.reshape(())) for step, a in arrays})
    return scalars


def merged_by_step(run_dir: str | os.PathLike) -> dict[str, dict[int, float]]:
    """Every scalar logged below ``run_dir``, by tag and step, over all its logging folders, oldest first, so that a
    later value of a step wins."""
    merged: dict[str, dict[int, float]] = {}
    for folder in logging_folders(run_dir):
        for tag, by_step in logged_by_step(folder).items():
            merged.setdefault(tag, {}).update(by_step)
    return merged


def outcome(exit_code: int, logged: dict[str, dict[int, float]]) -> str:
    """A run's outcome from its own exit code (:func:`run_exit_code`, not its launcher's) and what it logged (by
    tag and step, :func:`merged_by_step`)."""
    if exit_code == DIVERGENCE_EXIT_CODE:
        return DIVERGED
    if exit_code != 0:
        return FAILED
    if _diverged_at_step(logged) is not None:
        return DIVERGED
    return FINISHED if LOSS in logged else FAILED


# Steps in increasing order and the value logged at each: read as ``run_folders.Series`` is (which builds on this
# module), without the dataclass machinery a job script's record would import.
_Logged = namedtuple("_Logged", "steps values")


def _diverged_at_step(logged: dict[str, dict[int, float]]) -> int | None:
    """:func:`diverged_at_step` of what a run logged, by tag and step."""
    views = {tag: _Logged(tuple(sorted(d)), tuple(d[s] for s in sorted(d))) for tag, d in logged.items()}
    return diverged_at_step(views)


def first_non_finite_step(series) -> int | None:
    """The first step whose value is NaN or infinite, or None (``series``: steps and values, as ``Series``)."""
    return next((step for step, value in zip(series.steps, series.values) if not math.isfinite(value)), None)


def diverged_at_step(scalars: dict) -> int | None:
    """The first step with a non-finite training or validation loss, or where the non-finite gradient norms that a
    run ended with began (the divergence guard skipped its last updates: a saturated model can keep a finite loss
    while its gradients are NaN); None for a run that did not diverge. ``scalars``: ``run_folders.Series`` by tag."""
    steps = [first_non_finite_step(scalars[tag]) for tag in (LOSS, VALIDATION_LOSS) if tag in scalars]
    grad_norms = scalars.get(GRAD_NORM)
    if grad_norms is not None and grad_norms.values and not math.isfinite(grad_norms.values[-1]):
        start = len(grad_norms.values) - 1
        while start > 0 and not math.isfinite(grad_norms.values[start - 1]):
            start -= 1
        steps.append(grad_norms.steps[start])
    return min((step for step in steps if step is not None), default=None)


def attempt_error_line(log: str | os.PathLike) -> str:
    """What went wrong in the latest attempt of ``log``: its first ``error:`` line or exception line (a run that
    failed before its first step: ``ModuleNotFoundError: No module named 'torch'``), else its last line."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    lines = [line.strip() for line in text[text.rfind(ATTEMPT_MARK) + 1 :].splitlines()[1:] if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or ["(no output)"])[0 if errors else -1]


def ended_status(fields: dict, exit_code: int, run_dir: str | os.PathLike, started: float) -> dict:
    """A run's ``sweep_status.json`` once its launcher ended with ``exit_code``: ``fields`` (its cell, command and
    environment) with its outcome, read from its own exit record and what it logged, its times and, unless it
    finished, why."""
    logged = merged_by_step(run_dir)
    code, message = run_exit_code(run_dir, exit_code, started)
    status = {
        **fields,
        "outcome": outcome(code, logged),
        "exit_code": code,
        **({"launcher_exit_code": exit_code} if code != exit_code else {}),
        "started": started,
        "seconds": round(time.time() - started, 1),
        "ended": time.time(),
    }
    if status["outcome"] == DIVERGED and code == 0:
        status["message"] = f"non-finite loss logged at step {_diverged_at_step(logged)}"
    elif status["outcome"] != FINISHED:
        status["message"] = message or attempt_error_line(os.path.join(run_dir, LOG_FILE))
    return status
