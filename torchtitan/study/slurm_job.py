"""What a Slurm job of a study records about its run, called by its job script: each start, stop on a signal and end
(``slurm_events.jsonl`` in the run's folder), the checks before a start (the run ended already, its requeues
spent), and the run's ``sweep_status.json`` when it ends.

``python -S -m torchtitan.study.slurm_job started|busy|interrupted|stopped|ended RUN_DIR [EXIT_CODE [MAX_REQUEUES]]``

A job script calls it at every start and end of every task, so it imports only the standard library's lightest
parts and leaves (``torchtitan.errors``, ``torchtitan.files``, ``torchtitan.study.run_status``): no pathlib, typing,
argparse or torch, nothing of the sweep's submitting; it starts without site-packages (``-S``). A study of hundreds
of runs starts it hundreds of times.
``torchtitan/study/slurm.py`` submits and watches the jobs, and reads what they recorded through this module.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Sequence

from torchtitan.errors import DIVERGENCE_EXIT_CODE, USER_ERROR_EXIT_CODE, read_exit_record
from torchtitan.study.run_status import (
    ended_status,
    is_done,
    read_json,
    read_jsonl,
    read_status,
    run_exit_code,
    write_status,
)

SLURM_FOLDER = "slurm"  # in the dump folder: each submission's job script, its list of run folders, Slurm's output
JOB_FILE = "slurm_job.json"  # in a run folder: its last submission's job id, and the run's cell
EVENTS_FILE = "slurm_events.jsonl"  # in a run folder: each start, preemption and end of its jobs
SUBMISSION_SUFFIX = ".submission.json"  # in the slurm folder: an array being submitted, until its runs know its id
DEFAULT_MAX_REQUEUES = 10
PREEMPTED = "preempted"  # a run stopped on a signal and requeued (its event, and its state as the sweep shows it)


def read_job(run_dir: str | os.PathLike) -> dict | None:
    return read_json(os.path.join(run_dir, JOB_FILE))


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """The run's Slurm events; a torn line (a job killed as it wrote) is left out with a warning."""
    try:
        return [e for e in read_jsonl(os.path.join(run_dir, EVENTS_FILE)) if "event" in e]
    except FileNotFoundError:
        return []


def adopt(record: str | os.PathLike, submission: dict, array: str) -> None:
    """Each run of ``submission`` now belongs to array ``array`` (its ``slurm_job.json``); the record is done."""
    from torchtitan.files import write_text_atomically

    for index, entry in enumerate(submission["entries"]):
        job = {"job_id": f"{array}_{index}", "array": array, "submitted": submission["time"]}
        job.update(name=submission["name"], fields=entry["fields"])
        write_text_atomically(os.path.join(entry["run_dir"], JOB_FILE), json.dumps(job, indent=1) + "\n")
    try:
        os.unlink(record)
    except FileNotFoundError:  # a task of the array and the sweep may adopt it at once
        pass


def _adopt_own_submission(run_dir: str) -> None:
    """A task whose run does not know its job yet (sbatch's answer was lost and the lookup missed): its array is
    the one whose submission record bears this job's name; every run of it learns its job now."""
    job, array = read_job(run_dir), os.environ.get("SLURM_ARRAY_JOB_ID", "")
    if not array or (job is not None and job.get("array") == array):
        return
    name = os.environ.get("SLURM_JOB_NAME", "")
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(run_dir))), SLURM_FOLDER)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(SUBMISSION_SUFFIX))
    except FileNotFoundError:
        return
    for path in (os.path.join(folder, n) for n in names):
        try:
            with open(path) as f:
                submission = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if submission.get("name") == name:
            adopt(path, submission, array)
            return


def _event(run_dir: str, event: str, code: int | None, **more) -> dict:
    entry = {
        "event": event,
        "job_id": _job_id(),
        "job_name": os.environ.get("SLURM_JOB_NAME", ""),
        "time": time.time(),
        "start": int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1,
        **({"exit_code": code} if code is not None else {}),
        **more,
    }
    with open(os.path.join(run_dir, EVENTS_FILE), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def _job_id() -> str:
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


def newest_checkpoint(run_dir: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint below the run's folder (where train.py writes them unless
    checkpoint.folder is absolute); None when there is none. The rule of ``checkpoint.folders.complete_steps`` (a
    ``step-N`` folder holding DCP's ``.metadata``, none set aside as superseded), read without importing torch: the
    job script asks at every start and stop."""
    steps = []
    for folder, subfolders, _ in os.walk(run_dir):
        subfolders[:] = [name for name in subfolders if name != "superseded"]
        for name in subfolders:
            match = re.fullmatch(r"step-(\d+)", name)
            if match and os.path.isfile(os.path.join(folder, name, ".metadata")):
                steps.append(int(match.group(1)))
    return max(steps) if steps else None


def trained_seconds(events: Sequence[dict], now: float) -> float:
    """Seconds a job's starts took, from each start to the stop or end after it: time spent starting and
    training, not time queued between a requeue and the next start."""
    total, began = 0.0, None
    for event in events:
        if event["event"] == "started":
            began = event["time"]
        elif began is not None:
            total, began = total + event["time"] - began, None
    return total + (now - began if began is not None else 0.0)


def requeue_refusal(run_dir: str | os.PathLike, code: int, max_requeues: int) -> str | None:
    """Why a run stopped on a signal is not requeued ("" when its own status says why); None to requeue it. Never
    a run that stopped on its own
    (diverged, a mistake: its exit record says so), never past ``max_requeues`` requeues of its job, and never a
    run that saved no checkpoint newer than the one it started from (a new start would train the same steps)."""
    events = [e for e in read_events(run_dir) if e.get("job_id") == _job_id()]
    starts = [e for e in events if e["event"] == "started"]
    own, _ = run_exit_code(run_dir, code, starts[-1]["time"] if starts else 0.0)
    if own in (USER_ERROR_EXIT_CODE, DIVERGENCE_EXIT_CODE):
        return ""  # its status says why: its own error line
    requeues = max(0, len(starts) - 1)  # every start after the first, whoever requeued it (Slurm's own too)
    if requeues >= max_requeues:
        return (
            f"stopped on a signal after {requeues} requeue(s), the most --slurm-max-requeues {max_requeues} allows: "
            "not requeued; raise --slurm-time or --slurm-max-requeues"
        )
    newest, began_at = newest_checkpoint(run_dir), starts[-1].get("checkpoint") if starts else None
    if newest is None or (began_at is not None and newest <= began_at):
        since = "" if began_at is None else f" than step {began_at}, the one it started from"
        return (
            f"stopped on a signal without a checkpoint newer{since}: not requeued, a new start would train the same "
            "steps again; enable checkpointing (--checkpoint.enable_checkpoint), or raise --slurm-signal-seconds "
            "if a step and its save take longer than the warning"
        )
    return None


def _ended_unrecorded(run_dir: str) -> bool:
    """Whether the run's last start ended it (its own exit record, written after that start, says it finished or
    diverged) without a status: its job was preempted or killed between the run's end and its record."""
    starts = [e["time"] for e in read_events(run_dir) if e["event"] == "started"]
    record = read_exit_record(run_dir, since=starts[-1]) if starts else None
    return record is not None and record.get("exit_code") in (0, DIVERGENCE_EXIT_CODE)


def _write_ended(run_dir: str, code: int | None, why: str | None = None) -> None:
    job = read_job(run_dir) or {}  # none only when neither the sweep nor the task could learn the job (see main)
    submitted = float(job.get("submitted", time.time()))
    events = [e for e in read_events(run_dir) if e.get("job_id") == _job_id()]
    starts = [e["time"] for e in events if e["event"] == "started"]
    status = ended_status(
        job.get("fields", {}), -1 if code is None else code, run_dir, starts[-1] if starts else submitted
    )
    status["started"] = starts[0] if starts else submitted
    status["seconds"] = round(trained_seconds(events, time.time()), 1)  # starting and training, not queueing
    requeues = max(0, len(starts) - 1)
    if requeues:
        status["requeues"] = requeues
    if why:
        status["message"] = why
    write_status(run_dir, status)


def main(argv: Sequence[str] | None = None) -> int:
    """The job script's record of a start, a stop on a signal or an end of the run in ``RUN_DIR``; ``stopped``
    exits 0 when the task is to be requeued (recorded as preempted), 1 when the run ended (its status written)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    event, run_dir = argv[0], argv[1]
    name = os.path.basename(os.path.normpath(run_dir))
    code = int(argv[2]) if len(argv) > 2 and argv[2] else None
    max_requeues = int(argv[3]) if len(argv) > 3 else DEFAULT_MAX_REQUEUES
    if event == "started":  # exits 1 when the task is not to train: its run ended, or its requeues are spent
        _adopt_own_submission(run_dir)
        if is_done(read_status(run_dir)):
            _event(run_dir, "skipped", None, reason="the run has ended already")
            print(f"{name} has ended already (its sweep_status.json): not trained again", file=sys.stderr)
            return 1
        if _ended_unrecorded(run_dir):  # its last start trained it to its end; the job ended before it said so
            _event(run_dir, "ended", 0, reason="recorded at the next start")
            _write_ended(run_dir, 0)
            print(f"{name} ended in its last start: recorded now, not trained again", file=sys.stderr)
            return 1
        requeues = sum(e["event"] == "started" for e in read_events(run_dir) if e.get("job_id") == _job_id())
        if requeues > max_requeues:
            why = (
                f"started again after {requeues} requeue(s), Slurm's own included, more than --slurm-max-requeues "
                f"{max_requeues} allows: not trained again; raise --slurm-time or --slurm-max-requeues"
            )
            _event(run_dir, "ended", None, reason=why)
            _write_ended(run_dir, None, why)
            return 1
        _event(run_dir, event, code, checkpoint=newest_checkpoint(run_dir))
    elif event == "busy":  # another trainer (a local sweep, another job) holds the run's folder
        _event(run_dir, event, None)
        print(
            f"{name} is being trained by another process (its folder is locked): not trained here",
            file=sys.stderr,
        )
    elif event == "interrupted":  # stopped by a TERM: Slurm requeues a preempted job itself, not a cancelled one
        _event(run_dir, event, code)
    elif event == "stopped":
        why = requeue_refusal(run_dir, code, max_requeues)
        if why is None:
            _event(run_dir, PREEMPTED, code)
            return 0
        _event(run_dir, "ended", code, reason=why)
        _write_ended(run_dir, code, why)
        return 1
    else:
        _event(run_dir, event, code)
        if event == "ended":
            _write_ended(run_dir, code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
