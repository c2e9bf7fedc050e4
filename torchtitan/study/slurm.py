"""A study's runs as Slurm jobs: each sweep call submits the runs it still lacks as one job array, whose concurrency
limit is ``--parallel``; the jobs outlive the sweep, which may exit after submitting.

Each array task trains one run through ``srun`` and the sweep's launcher (``run_llama_train.sh``: torchrun on one
node, or on ``--slurm-nodes`` nodes with a rendezvous on the first), appending to the run's ``train.log``. The job
script asks for ``--signal=B:USR1@{seconds}`` and traps USR1 and TERM: it passes SIGTERM to the run, which saves its
step and exits (torchtitan/training/preemption.py), and requeues the task, which resumes from that checkpoint.
When the run ends the task writes its ``sweep_status.json`` as the local runner does.

What Slurm knows, each run folder keeps: ``slurm_job.json`` (the job of its last submission) and
``slurm_events.jsonl`` (each start, preemption and end of it). A run's state is read from its folder and from Slurm
(``squeue``, and ``sacct`` where the cluster keeps accounting): pending, running, preempted (requeued, waiting),
finished, diverged or failed. A run with a job still alive is never submitted again.

The job script records each start, stop and end of its run through ``python -m torchtitan.study.slurm_job``, a
module that imports only what those calls need; this one reads what they recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import PREEMPTED_EXIT_CODE, UserError
from torchtitan.files import write_text_atomically
from torchtitan.study.plan import (
    COMMAND_FILE,
    FINISHED,
    LOG_FILE,
    RUNS_FOLDER,
    RunSpec,
    run_command,
    run_folder,
    wandb_group,
)
from torchtitan.study.run_folders import LOSS, merged_scalars, read_status, status_paths, write_status
from torchtitan.study.scheduling import (
    RUN_ENVIRONMENT,
    TRAINER_LOCK,
    command_script,
    ended_status,
    is_done,
    spec_fields,
)
from torchtitan.study.slurm_job import (
    DEFAULT_MAX_REQUEUES,
    PREEMPTED,
    SLURM_FOLDER,
    SUBMISSION_SUFFIX,
    adopt,
    main,
    read_events,
    read_job,
)

# --wait asks squeue this often at first, then half as often after each answer in which no run ended, down to once
# every POLL_MAX_SECONDS: a 200-run study is one squeue a minute, whatever its size (docs/cluster.md).
POLL_SECONDS = 2.0
POLL_MAX_SECONDS = 60.0
# A query Slurm does not answer (a busy or restarting controller) is asked again after 1, 2, 4 ... s, this many times
# in one call; --wait goes on asking, at its polling interval, for as long as UNANSWERED_SECONDS.
QUERY_TRIES = 4
QUERY_RETRY_SECONDS = 1.0
UNANSWERED_SECONDS = 900.0
SLURM_TIMEOUT_SECONDS = (
    60.0  # how long a Slurm command may take to answer (sbatch retries while the controller is busy)
)
# An array sbatch did not confirm (it timed out, or its socket did) is looked for by its name; once this long has
# passed since, a controller that knows no job of that name and no run that started under it never queued it.
UNCONFIRMED_SECONDS = 120.0
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize: task ids 0 .. 1000
RENDEZVOUS_PORTS = (20000, 10000)  # a multi-node run's rendezvous port: 20000 + its job id modulo 10000
# Job states in which a job may still train (squeue's long names); anything else has ended.
ALIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "SPECIAL_EXIT",
    "RUNAWAY",  # see job_state
}
RUNAWAY = "RUNAWAY"  # a job accounting keeps RUNNING after the controller forgot it (not one of Slurm's states)
# A runaway job is taken for lost (its run submitted again) this long after its run's last sign of life.
RUNAWAY_SECONDS = 600.0
NOT_LISTED = "not listed by Slurm yet"  # the reason of a job just submitted that squeue does not show yet
PENDING, RUNNING = "pending", "running"
# Alive states in which a job waits for someone, as the sweep shows them, and what to do.
WAITING_ON_SOMEONE = {
    "REQUEUE_HOLD": (
        "held",
        "requeued and held by Slurm; release it (scontrol release {job}), or cancel it (scancel {job}) and the next "
        "call submits the run again",
    ),
    "SUSPENDED": (
        "suspended",
        "suspended by the cluster (an administrator or a gang-scheduled partition); it goes on when resumed "
        "(scontrol resume {job}, an operator's command); it keeps its place in the study",
    ),
    "STOPPED": (
        "stopped",
        "its processes were stopped (SIGSTOP) and hold their nodes; continue them (scancel --signal=CONT {job}) "
        "or cancel it (scancel {job}) and the next call submits the run again",
    ),
    RUNAWAY: (
        "runaway",
        "Slurm's accounting keeps it running but the controller no longer lists it (a runaway job; an administrator "
        "clears it with sacctmgr show runawayjobs); taken for lost, and the run submitted again, "
        f"{RUNAWAY_SECONDS:.0f} s after the run's last sign of life",
    ),
}
SUBMITTED = "submitted"  # what the sweep says of a run it leaves to Slurm (written nowhere)
# Words of sbatch's refusals, and the option of the sweep each points to.
REFUSAL_OPTIONS = (
    ("account", "--slurm-account"),  # before partition: "Invalid account or account/partition combination"
    ("partition", "--slurm-partition"),
    ("time limit", "--slurm-time"),
    ("array", "--parallel"),
    ("gres", "--slurm-gpus"),
    ("gpu", "--slurm-gpus"),
    ("node", "--slurm-nodes"),
)
# sbatch's answers that leave open whether the controller queued the array (it may have, and answered too late).
UNCONFIRMED = ("did not answer", "socket timed out", "unable to contact", "connection refused", "zero bytes")
# Refusals that mean "not now" (a busy controller), not "never": nothing is submitted, nothing failed.
TRANSIENT = ("temporarily", "try again", "resource temporarily unavailable")
# Refusals by a limit on how many jobs may be queued: "not now" while other jobs of the user are queued, "never"
# when the array alone is above the limit.
SUBMIT_LIMIT = ("maxsubmit", "job submit limit", "submitjob", "qosmaxsubmit", "assocmaxsubmit")


def add_scheduler_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scheduler",
        choices=("local", "slurm"),
        default="local",
        help="local: train the runs here, --parallel at a time; slurm: submit them as one Slurm job array per call, "
        "--parallel at a time, and exit (docs/cluster.md)",
    )
    p.add_argument("--slurm-partition", default=None, help="with --scheduler slurm: sbatch --partition")
    p.add_argument("--slurm-account", default=None, help="with --scheduler slurm: sbatch --account")
    p.add_argument(
        "--slurm-time", default=None, help="with --scheduler slurm: each run's time limit per attempt, e.g. 4:00:00"
    )
    p.add_argument("--slurm-gpus", type=int, default=None, help="with --scheduler slurm: GPUs per node of each run")
    p.add_argument("--slurm-nodes", type=int, default=None, help="with --scheduler slurm: nodes per run (default 1)")
    p.add_argument(
        "--slurm-options", default=None, help="with --scheduler slurm: a file of more sbatch options, one a line"
    )
    p.add_argument(
        "--slurm-signal-seconds",
        type=int,
        default=None,
        help="with --scheduler slurm: a run is asked to save and stop this long before its time limit, then "
        "requeued (default 120)",
    )
    p.add_argument(
        "--slurm-max-requeues",
        type=int,
        default=None,
        help="with --scheduler slurm: a run stopped by its time limit or a preemption is requeued at most this "
        f"many times per submission, and only when it saved a checkpoint newer than the one it started from "
        f"(default {DEFAULT_MAX_REQUEUES})",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="with --scheduler slurm: stay until every run ended (a coordinate descent submits each round as the "
        "one before ends) instead of exiting after submitting",
    )


@dataclass(frozen=True)
class SlurmSettings:
    partition: Optional[str]
    account: Optional[str]
    time: Optional[str]
    gpus: int
    nodes: int
    options_file: Optional[str]
    signal_seconds: int
    wait: bool
    max_requeues: int = DEFAULT_MAX_REQUEUES

    def sbatch_lines(self, cpus: int) -> list[str]:
        """The job script's ``#SBATCH`` options, each value quoted as sbatch reads it; a line of the options file
        kept as written (it is sbatch's syntax already)."""
        lines = [f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
        for option, value in (("partition", self.partition), ("account", self.account), ("time", self.time)):
            lines += [f"--{option}={shlex.quote(value)}"] if value else []
        lines += [f"--gpus-per-node={self.gpus}"] if self.gpus else []
        if self.options_file:
            for line in Path(self.options_file).read_text().splitlines():
                line = line.strip()
                line = line[len("#SBATCH") :].strip() if line.startswith("#SBATCH") else line
                if line and not line.startswith("#"):
                    lines.append(line)
        return lines


def one_line_value(option: str, value: Optional[str]) -> None:
    """A value written into one line of a job script: a line break in it would write a line of its own."""
    if value is not None and ("\n" in value or "\r" in value):
        raise UserError(f"{option} {value!r} holds a line break; give it on one line")


def slurm_settings(args: argparse.Namespace) -> Optional[SlurmSettings]:
    """The Slurm options checked; None for ``--scheduler local`` (where any of them is a mistake)."""
    given = [f"--{k.replace('_', '-')}" for k in vars(args) if k.startswith("slurm_") and getattr(args, k) is not None]
    given += ["--wait"] if args.wait else []
    if args.scheduler != "slurm":
        if given:
            raise UserError(f"{given[0]} applies to --scheduler slurm; add --scheduler slurm or drop {given[0]}")
        return None
    for name in ("slurm_gpus", "slurm_nodes", "slurm_signal_seconds", "slurm_max_requeues"):
        value = getattr(args, name)
        least = 0 if name in ("slurm_gpus", "slurm_max_requeues") else 1
        if value is not None and value < least:
            raise UserError(f"--{name.replace('_', '-')} must be at least {least}")
    for name in ("slurm_partition", "slurm_account", "slurm_time", "dump_folder"):
        one_line_value(f"--{name.replace('_', '-')}", getattr(args, name, None))
    dump = getattr(args, "dump_folder", None)
    if dump is not None and "\\" in str(Path(dump).resolve()):
        raise UserError(
            f"--dump-folder {dump} holds a backslash, which turns off the names Slurm fills in its jobs' output "
            "paths (sbatch --output); give a folder without one"
        )
    if args.slurm_options and not Path(args.slurm_options).is_file():
        raise UserError(f"--slurm-options {args.slurm_options}: no such file; give a file of sbatch options")
    settings = SlurmSettings(
        partition=args.slurm_partition,
        account=args.slurm_account,
        time=args.slurm_time,
        gpus=args.slurm_gpus or 0,
        nodes=args.slurm_nodes or 1,
        options_file=args.slurm_options,
        signal_seconds=args.slurm_signal_seconds or 120,
        wait=args.wait,
        max_requeues=DEFAULT_MAX_REQUEUES if args.slurm_max_requeues is None else args.slurm_max_requeues,
    )
    if settings.time is not None:
        seconds = time_seconds(settings.time)
        if seconds <= settings.signal_seconds:
            raise UserError(
                f"--slurm-time {settings.time} leaves a run no time to train before it is asked to save and stop "
                f"({settings.signal_seconds} s before the limit, --slurm-signal-seconds); raise --slurm-time"
            )
    return settings


def time_seconds(text: str) -> int:
    """Slurm's time formats in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if match is None:
        raise UserError(f"--slurm-time {text!r} is not a Slurm time; write minutes, H:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        parts = [int(a), int(b or 0), int(c or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if c is not None:
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:
        return int(a) * 60 + int(b)
    return int(a) * 60


@dataclass(frozen=True)
class FirstLog:
    """How long a finished run of the study took to reach its first log line: its start (everything before the
    steps: launch, model, data, compilation beyond a typical step) and one logging interval of typical steps."""

    run: str
    start_seconds: float
    interval_steps: int
    step_seconds: float
    steps: int = 0  # the steps it trained in all

    @property
    def seconds(self) -> float:
        return self.start_seconds + self.interval_steps * self.step_seconds

    @property
    def whole_seconds(self) -> float:
        """Its start and all its steps: how long it needs in one attempt."""
        return self.start_seconds + self.steps * self.step_seconds


def first_log(run_dir: Path, status: dict) -> Optional[FirstLog]:
    """Measured from a finished run's own logs (None when it logged no step time or fewer than two log lines): the
    median step time over its log lines, the most common gap between logged steps, and whatever of its wall time
    those steps do not account for."""
    from torchtitan.telemetry.step_timing import PARTS  # here: the job script's calls need no torch
    from torchtitan.telemetry.step_timing import tag as time_tag

    scalars = merged_scalars(run_dir)
    parts = [scalars[time_tag(p)] for p in PARTS if time_tag(p) in scalars]
    loss = scalars.get(LOSS)
    if not parts or loss is None or len(loss.steps) < 2 or status.get("seconds") is None:
        return None
    per_step = [sum(vals) for vals in zip(*(s.values for s in parts))]
    gaps = [b - a for a, b in zip(loss.steps, loss.steps[1:])]
    interval = max(set(gaps), key=lambda g: (gaps.count(g), g))
    step_seconds = sorted(per_step)[len(per_step) // 2]
    # Its seconds count starting and training (not time queued between requeues), once per start.
    starts = 1 + int(status.get("requeues", 0))
    start = max(0.0, float(status["seconds"]) - loss.steps[-1] * step_seconds) / starts
    return FirstLog(run_dir.name, start, interval, step_seconds, loss.steps[-1])


def check_time_limit(settings: SlurmSettings, dump: Path, checkpointing: bool = True) -> None:
    """A time limit that cannot let a run start and log once before its warning is refused, measured on the runs of
    this study that finished and logged their step time (the slowest of them); so is one shorter than a whole run
    when ``checkpointing`` is off (each requeue would start over). Nothing is checked before any run finished."""
    if settings.time is None:
        return
    measured = []
    for path in status_paths(dump):
        status = read_status(path.parent)
        if status.get("outcome") == FINISHED and (found := first_log(path.parent, status)) is not None:
            measured.append(found)
    if not measured:
        return
    slowest = max(measured, key=lambda m: m.seconds)
    needed = slowest.seconds + settings.signal_seconds
    if time_seconds(settings.time) < needed:
        steps = f"{slowest.interval_steps} step{'s' if slowest.interval_steps != 1 else ''}"
        raise UserError(
            f"--slurm-time {settings.time} is shorter than a run needs to log once before its warning: run "
            f"{slowest.run} took {slowest.start_seconds:.0f} s to start and {slowest.step_seconds:.3g} s a step "
            f"({steps} a log line), plus {settings.signal_seconds} s of warning "
            f"(--slurm-signal-seconds); raise --slurm-time to at least {slurm_time(math.ceil(needed))}"
        )
    longest = max(measured, key=lambda m: m.whole_seconds)
    if not checkpointing and time_seconds(settings.time) < longest.whole_seconds + settings.signal_seconds:
        raise UserError(
            f"--slurm-time {settings.time} is shorter than a run of this study needs ({longest.run}: "
            f"{longest.start_seconds:.0f} s to start, {longest.steps} steps of {longest.step_seconds:.3g} s, plus "
            f"{settings.signal_seconds} s of warning) and checkpointing is off, so a run stopped at its limit "
            "cannot resume; add --checkpoint.enable_checkpoint, or raise --slurm-time to at least "
            f"{slurm_time(math.ceil(longest.whole_seconds + settings.signal_seconds))}"
        )


def checkpointing(config_file: str, train_args: Sequence[str]) -> bool:
    """Whether the study's job saves checkpoints (checkpoint.enable_checkpoint), so that a stopped run resumes."""
    from torchtitan.study.plan import resolved_job

    return resolved_job(config_file, train_args).checkpoint.enable_checkpoint


def slurm_time(seconds: int) -> str:
    """Seconds as Slurm's H:MM:SS (D-HH:MM:SS past a day)."""
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


# ----------------------------------------------------------------------------------------------------------------
# Asking Slurm


def _slurm(command: Sequence[str], timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """A Slurm command's result; one that does not answer in time (sbatch retries while the controller takes no
    more jobs) ends with code 124 and says so."""
    timeout = SLURM_TIMEOUT_SECONDS if timeout is None else timeout
    try:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise UserError(f"{command[0]} is not here: --scheduler slurm needs Slurm's commands on this machine") from None
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(command), 124, "", f"{command[0]}: did not answer in {timeout:g} s")


def check_cluster(settings: SlurmSettings, parallel: int, nproc: int) -> None:
    """What the partition can hold, checked before anything is submitted: its time limit, its nodes, and how many
    runs it can train at once against ``--parallel``."""
    if parallel < 1:
        raise UserError(f"--parallel must be at least 1; got {parallel}")
    command = ["sinfo", "-h", "-o", "%P|%l|%D|%c|%G"] + (["-p", settings.partition] if settings.partition else [])
    result = _ask(command)
    rows = [line.split("|") for line in result.stdout.splitlines() if line.strip()]
    if settings.partition is None:
        rows = [r for r in rows if r[0].endswith("*")] or rows
    if not rows:
        raise UserError(
            f"--slurm-partition {settings.partition}: Slurm knows no such partition; name one sinfo lists"
            if settings.partition
            else "Slurm has no default partition; give --slurm-partition"
        )
    name = rows[0][0].rstrip("*")
    limit = rows[0][1]
    if settings.time is not None and re.fullmatch(r"[\d:-]+", limit):
        if time_seconds(settings.time) > time_seconds(limit):
            raise UserError(
                f"--slurm-time {settings.time} is above partition {name}'s time limit {limit}; lower --slurm-time"
            )
    nodes = sum(int(r[2]) for r in rows)
    if settings.nodes > nodes:
        raise UserError(f"--slurm-nodes {settings.nodes} is more than partition {name} has ({nodes}); lower it")
    cpus = min(int(r[3].rstrip("+")) for r in rows)
    at_once = (nodes // settings.nodes) * max(1, cpus // max(1, nproc))
    if settings.gpus:
        gpus_per_node = min(_gpus(r[4]) for r in rows)
        if settings.gpus > gpus_per_node:
            raise UserError(
                f"--slurm-gpus {settings.gpus} is more than a node of partition {name} has ({gpus_per_node}); lower it"
            )
        at_once = (nodes // settings.nodes) * (gpus_per_node // settings.gpus)
    if parallel > at_once:
        raise UserError(
            f"--parallel {parallel} is above what partition {name} can train at once ({at_once} runs of "
            f"{settings.nodes} node(s), {nproc} process(es) each); lower --parallel to {at_once} or less"
        )


def _gpus(gres: str) -> int:
    found = re.findall(r"gpu(?::[^:(,]+)?:(\d+)", gres)
    return sum(int(n) for n in found)


def one_line(text: str) -> str:
    lines = [
        re.sub(r"^(sbatch|sinfo|squeue|sacct|scontrol): (error: )?", "", line).strip() for line in text.splitlines()
    ]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "(no message)"


def refusal(stderr: str) -> Exception:
    """sbatch's refusal as one line naming the sweep option it concerns."""
    message = one_line(stderr)
    lowered = message.lower()
    option = next((o for word, o in REFUSAL_OPTIONS if word in lowered), "the --slurm-* options")
    return UserError(f"Slurm refused the job array: {message}; check {option}")


class SlurmUnanswered(UserError):
    """A query Slurm did not answer, asked QUERY_TRIES times (a busy or restarting controller)."""


def _ask(command: Sequence[str]) -> subprocess.CompletedProcess:
    """A query of what Slurm holds, asked again after 1, 2, 4 ... s while it fails (a busy controller answers
    later); raises :class:`SlurmUnanswered` after QUERY_TRIES failures."""
    delay = QUERY_RETRY_SECONDS
    for attempt in range(QUERY_TRIES):
        result = _slurm(command)
        if result.returncode == 0 or "invalid job id" in result.stderr.lower():  # jobs it no longer knows
            return result
        if attempt + 1 < QUERY_TRIES:
            time.sleep(delay)
            delay *= 2
    raise SlurmUnanswered(
        f"Slurm did not answer ({command[0]}: {one_line(result.stderr)}; asked {QUERY_TRIES} times); is the "
        "cluster up? run the same command again later"
    )


def job_states(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """(state, reason) of each job Slurm still knows among ``job_ids`` (array tasks as ``123_4``); a job only
    accounting knows, and as alive, is a runaway (:data:`RUNAWAY`)."""
    if not job_ids:
        return {}
    arrays = sorted({j.split("_")[0] for j in job_ids})
    result = _ask(["squeue", "-h", "-r", "--states=all", "-j", ",".join(arrays), "-o", "%i|%T|%r"])
    states: dict[str, tuple[str, str]] = {}
    for line in result.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            states[parts[0]] = (parts[1], parts[2])
    missing = [j for j in job_ids if j not in states]
    if missing:  # ended longer ago than Slurm keeps jobs in memory: accounting, where the cluster keeps it
        sacct = _slurm(["sacct", "-n", "-P", "-X", "-j", ",".join(arrays), "-o", "JobID,State"])
        if sacct.returncode == 0:
            for line in sacct.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) == 2 and parts[0] in missing:
                    state = parts[1].split()[0]
                    states[parts[0]] = (RUNAWAY, f"accounting: {state}") if state in ALIVE else (state, "")
    return states


def job_state(run_dir: Path, job: dict, states: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """(state, reason) of the job ``job`` of the run in ``run_dir`` as the sweep takes it: Slurm's, except that a
    job Slurm does not list within UNCONFIRMED_SECONDS of its submission is pending (a busy controller may list an
    array late), and a runaway is taken for lost ("LOST") RUNAWAY_SECONDS after the run's last sign of life."""
    state = states.get(job["job_id"])
    if state is None:
        submitted = float(job.get("submitted", 0.0))
        status = read_status(run_dir)
        ended = status is not None and status.get("ended", 0.0) >= submitted  # the job wrote how the run ended
        young = time.time() - submitted < UNCONFIRMED_SECONDS
        return ("PENDING", NOT_LISTED) if young and not ended else ("ENDED", "")
    if state[0] == RUNAWAY:
        events = [e.get("time", 0.0) for e in read_events(run_dir) if e.get("job_id") == job["job_id"]]
        last = max([float(job.get("submitted", 0.0)), *events])
        if time.time() - last > RUNAWAY_SECONDS:
            return "LOST", state[1]
    return state


# ----------------------------------------------------------------------------------------------------------------
# A run's folder: its job, its events, its state


def run_state(run_dir: Path, states: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """(state, detail) of a run: its job's while the job lives, else its status' outcome ("" when it never ran)."""
    job = read_job(run_dir)
    state, reason = job_state(run_dir, job, states) if job is not None else ("", "")
    status = read_status(run_dir)
    if state in ALIVE and not is_done(status):
        events = [e for e in read_events(run_dir) if e.get("job_id") == job["job_id"]]
        requeued = bool(events) and events[-1]["event"] in (PREEMPTED, "interrupted")
        if state == "PENDING":
            why = f", {reason}" if reason and reason != "None" else ""
            return (PREEMPTED if requeued else PENDING), f"job {job['job_id']}{why}"
        if state in WAITING_ON_SOMEONE:
            shown, what_to_do = WAITING_ON_SOMEONE[state]
            return shown, f"job {job['job_id']}: {what_to_do.format(job=job['job_id'])}"
        return RUNNING, f"job {job['job_id']}, {state.lower()}"
    if status is not None:
        return status["outcome"], status.get("message", "")
    if job is not None:
        return "failed", f"job {job['job_id']} {_without_status(state.lower())}; the next call submits it again"
    return "", ""


def print_states(dump: Path) -> dict[str, int]:
    """One line per run of ``dump`` submitted to Slurm, then the count of each state; the counts."""
    run_dirs = sorted(p for p in (dump / RUNS_FOLDER).glob("*") if p.is_dir())
    jobs = {d: read_job(d) for d in run_dirs}
    submitted = [d for d in run_dirs if jobs[d] is not None]
    if not submitted:
        return {}
    try:
        states = job_states([jobs[d]["job_id"] for d in submitted])
    except SlurmUnanswered as unanswered:  # the runs' folders still say what ended
        print(f"slurm: {unanswered}; the states below are the run folders' alone", flush=True)
        states = None
    counts: dict[str, int] = {}
    for d in submitted:
        status = read_status(d)
        if states is None and not is_done(status):
            state, detail = "unknown", "Slurm did not answer"
        else:
            state, detail = run_state(d, states or {})
        counts[state] = counts.get(state, 0) + 1
        print(f"  {d.name}: {state}{f' ({detail})' if detail else ''}", flush=True)
    print("slurm: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())), flush=True)
    return counts


# ----------------------------------------------------------------------------------------------------------------
# Submitting: the runner the sweep and the coordinate descent drive

JOB_SCRIPT = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --output={output}/%A_%a.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@{signal_seconds}
{sbatch}
# One run of the study per array task: its folder is line SLURM_ARRAY_TASK_ID + 1 of {runs}.
# USR1 (Slurm's warning ahead of the time limit): the run is asked to save its step and stop, and the task is
# requeued when it saved a checkpoint newer than the one it started from; it resumes from that checkpoint.
# TERM (a preemption, or a user's scancel): the run saves and stops, and the task is not requeued here: Slurm
# requeues a preempted job itself, and a cancelled one stays cancelled. Every start past {max_requeues} requeues,
# Slurm's own included, ends the run instead of training it.
run_dir=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {runs})
# This task, as scancel and scontrol name it (the first task's own job id is the whole array's).
task=${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}
# The record needs the standard library and this package only (-S: no site-packages, which cost each call 4 ms).
record() {{ PYTHONPATH={root} {python} -S -m torchtitan.study.slurm_job "$1" "$run_dir" "${{@:2}}" 9>&-; }}
# One trainer per run folder: a local sweep or another job training this run holds the lock; then this task ends.
# Only this shell holds it (fd 9, closed for what it starts): it is free again the moment this task ends.
exec 9>>"$run_dir/{lock}"
if ! flock -n 9; then
    record busy
    exit 0
fi
stop=""
step=""
# The warning is passed on to the run's processes as SIGTERM through Slurm (not to srun, which would end the step
# at once) by the loop below, never in the trap: scancel is retried every 2 s while the controller answers "Job can
# not be altered now", and nothing outlives this shell (a stray scancel would reach the task's next start). A TERM
# from Slurm reaches the run's processes itself.
pass=""
forward() {{
    if [ -z "$stop" ] || [ "$1" = TERM ]; then stop=$1; fi
    if [ "$1" = USR1 ]; then pass=1; fi
}}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
record started "" {max_requeues} || exit 0  # the run has ended already, or its requeues are spent (recorded)
export NNODES=$SLURM_NNODES RDZV_ID=$SLURM_JOB_ID
# torchrun, signalled too, gives its workers this long to save before it kills them (its default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{shutdown_seconds}}}
# The rendezvous port from the job id: two runs whose first node is the same meet on ports of their own.
RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$(({port_base} + SLURM_JOB_ID % {port_span}))
export RDZV_ENDPOINT
echo "$ (Slurm job $SLURM_JOB_ID, start $((${{SLURM_RESTART_COUNT:-0}} + 1))) $(tail -n 1 "$run_dir/{command}")" \\
    >>"$run_dir/{log}"
srun --kill-on-bad-exit=1 bash "$run_dir/{command}" >>"$run_dir/{log}" 2>&1 9>&- &
step=$!
while kill -0 "$step" 2>/dev/null; do
    if [ -n "$pass" ] && timeout 5 scancel --signal=TERM "$task" 9>&-; then pass=""; fi
    if [ -n "$pass" ]; then
        sleep 2 9>&- &
        wait $!
    else
        wait "$step"  # a signal ends the wait at once: its trap runs, then this loop
    fi
done
wait "$step"
code=$?
# A run that ended anyway (its last step done as the signal came) has ended. Stopped by a TERM: recorded, not
# requeued. Stopped by the warning (or by the run itself, exit {preempted}): requeued when the run's own record and its
# checkpoints say a new start would go further (record stopped exits 0), else ended with why.
if [ "$code" -ne 0 ] && [ "$stop" = TERM ]; then
    record interrupted "$code"
    exit 0
fi
if [ "$code" -eq {preempted} ] || {{ [ -n "$stop" ] && [ "$code" -ne 0 ]; }}; then
    if record stopped "$code" {max_requeues}; then
        scontrol requeue "$task"
    fi
    exit 0
fi
record ended "$code"
"""


@dataclass
class _Job:
    spec: RunSpec
    job_id: Optional[str]  # None until submitted; "" when not submitted in this call (see SlurmRunner.wait)


def max_array_size() -> int:
    """The cluster's MaxArraySize (``scontrol show config``): an array's task ids are 0 .. MaxArraySize - 1."""
    result = _slurm(["scontrol", "show", "config"])
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", result.stdout, re.MULTILINE) if result.returncode == 0 else None
    return int(match.group(1)) if match else DEFAULT_MAX_ARRAY_SIZE


def unconfirmed(stderr: str) -> bool:
    """Whether sbatch's failure leaves open that the controller queued the array (a timeout, a socket error)."""
    return any(word in stderr.lower() for word in UNCONFIRMED)


def user_jobs() -> int:
    """How many jobs of this user Slurm holds (-1 when squeue does not answer)."""
    result = _slurm(["squeue", "-h", "--me", "-o", "%i"])
    return len(result.stdout.split()) if result.returncode == 0 else -1


def job_name(dump: Path, stamp: str) -> str:
    """An array's job name: ``study-`` and a short hash of the dump folder, then the submission's stamp. Only
    letters, digits and dashes, whatever the folder is called: ``squeue -n`` and ``sacct --name`` split their
    argument at commas, and sbatch drops backslashes from a name."""
    return f"study-{hashlib.sha256(str(dump).encode()).hexdigest()[:8]}-{stamp}"


def arrays_named(name: str) -> list[str]:
    """The ids of the arrays Slurm knows by the job name ``name`` (squeue, then sacct where accounting is kept)."""
    result = _ask(["squeue", "-h", "-r", "--states=all", "-n", name, "-o", "%i"])
    found = {line.strip().split("_")[0] for line in result.stdout.splitlines() if line.strip()}
    if not found:
        sacct = _slurm(["sacct", "-n", "-P", "-X", "--name", name, "-S", "now-7days", "-o", "JobID"])
        if sacct.returncode == 0:
            found = {line.strip().split("_")[0] for line in sacct.stdout.splitlines() if line.strip()}
    return sorted(found)


class SlurmRunner:
    """The local ``Runner``'s interface over Slurm: ``start`` queues a run for the next job array (or adopts the
    job of it still alive), ``wait`` submits the array and, with ``--wait``, returns the next run to end; without,
    it raises :class:`Detached` once submitted.

    No run trains twice: each array's runs and unique job name are written (``slurm/*.submission.json``) before
    ``sbatch`` is called; when sbatch does not confirm (a timeout, a socket error), the array is looked for by that
    name, in this call and the next ones, and its runs are not submitted again until Slurm is known not to hold it."""

    def __init__(
        self,
        dump: Path,
        config_file: str,
        nproc: int,
        train_args: Sequence[str],
        launcher: Sequence[str],
        settings: SlurmSettings,
        parallel: int,
        vary_data_seed: bool = False,
        after_each=None,
    ):
        self.dump = dump
        self.config_file = config_file
        self.nproc = nproc
        self.train_args = list(train_args)
        self.launcher = list(launcher)
        self.settings = settings
        self.parallel = parallel
        self.vary_data_seed = vary_data_seed
        self.after_each = after_each
        self.wandb_group = wandb_group(dump, config_file, train_args)
        self.running: list[_Job] = []
        self._states: Optional[dict[str, tuple[str, str]]] = None  # see _known_states
        self._unconfirmed: Optional[set[str]] = None  # run folders of arrays sbatch did not confirm; see _in_doubt
        self._poll_seconds = POLL_SECONDS  # --wait's interval between two squeue calls, backing off; see wait

    def __enter__(self) -> "SlurmRunner":
        return self

    def __exit__(self, *exc) -> None:  # the jobs outlive the sweep
        pass

    def free(self) -> int:
        return 1  # Slurm holds the queue: every run goes into the array, --parallel of them at once

    def start(self, spec: RunSpec, label: str) -> None:
        run_dir = run_folder(self.dump, spec)
        if str(run_dir) in self._in_doubt():
            print(
                f"{label} {spec.name}: not submitted again: sbatch did not confirm its array, which Slurm may hold",
                flush=True,
            )
            self.running.append(_Job(spec, ""))
            return
        job = read_job(run_dir)
        if job is not None and self._known_states().get(job["job_id"], ("",))[0] in ALIVE:
            print(f"{label} {spec.name}: Slurm job {job['job_id']} is still there, not submitted again", flush=True)
            self.running.append(_Job(spec, job["job_id"]))
            return
        self.running.append(_Job(spec, None))  # submitted with the others at the next wait()

    def _known_states(self) -> dict[str, tuple[str, str]]:
        """The states of every job this dump folder's runs recorded (as :func:`job_state` takes them), asked of
        Slurm once per submission (not once per run: a study of a hundred runs is one squeue, not a hundred)."""
        if self._states is None:
            jobs = {d: read_job(d) for d in (self.dump / RUNS_FOLDER).glob("*") if d.is_dir()}
            jobs = {d: job for d, job in jobs.items() if job is not None}
            states = job_states([job["job_id"] for job in jobs.values()])
            self._states = {job["job_id"]: job_state(d, job, states) for d, job in jobs.items()}
        return self._states

    def _in_doubt(self) -> set[str]:
        """The run folders of arrays sbatch did not confirm and Slurm may still hold; each such array found by its
        name (or a run that started under it) is adopted first, and one Slurm is known not to hold is forgotten."""
        if self._unconfirmed is None:
            self._unconfirmed = set()
            for path in sorted((self.dump / SLURM_FOLDER).glob(f"*{SUBMISSION_SUFFIX}")):
                try:
                    submission = json.loads(path.read_text())
                except FileNotFoundError:  # a task of it adopted it meanwhile (see main)
                    continue
                array = _array_of(submission)
                if array is not None:
                    adopt(path, submission, array)
                    print(f"slurm: found job array {array} ({submission['name']}), which sbatch did not confirm")
                elif time.time() - submission["time"] > UNCONFIRMED_SECONDS:
                    path.unlink()
                    print(f"slurm: Slurm never queued {submission['name']}; its runs are submitted again")
                else:
                    self._unconfirmed |= set(submission["runs"])
        return self._unconfirmed

    def _submit(self) -> None:
        queued = [job for job in self.running if job.job_id is None]
        size = max_array_size() if len(queued) > 1 else 1
        # After every array of the study still alive (an earlier call's, or the rest of a split one): --parallel
        # holds for the whole study, across calls.
        states = self._known_states().items()
        alive = {j.split("_")[0] for j, (state, why) in states if state in ALIVE - {RUNAWAY} and why != NOT_LISTED}
        after = ":".join(sorted(alive, key=lambda a: (len(a), a))) or None
        for first in range(0, len(queued), size):
            chunk = queued[first : first + size]
            after = self._submit_array(chunk, after)
            if after is None:  # not confirmed, or not taken now: the rest waits for the next call
                for job in queued[first + size :]:
                    job.job_id = ""
                return

    def _submit_array(self, queued: list[_Job], after: Optional[str]) -> Optional[str]:
        """Submit ``queued`` as one array (after array ``after`` has ended, when given: --parallel holds for the
        whole study); its id, or None when sbatch did not confirm it or Slurm takes no jobs now."""
        folder = self.dump / SLURM_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}-{secrets.token_hex(3)}"
        runs, script = folder / f"array-{stamp}.runs", folder / f"array-{stamp}.sh"
        name = job_name(self.dump, stamp)
        environment = {"NGPU": str(self.nproc), "CONFIG_FILE": self.config_file, "PYTHON": sys.executable}
        recorded = {**{k: os.environ[k] for k in RUN_ENVIRONMENT if k in os.environ}, **environment}
        recorded.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm gives each job its GPUs
        entries = []
        for job in queued:
            run_dir = run_folder(self.dump, job.spec)
            run_dir.mkdir(parents=True, exist_ok=True)
            command = run_command(
                job.spec, run_dir, self.train_args, self.launcher, self.vary_data_seed, self.wandb_group
            )
            (run_dir / COMMAND_FILE).write_text(command_script(command, recorded, os.getcwd()))
            fields = spec_fields(job.spec, self.vary_data_seed)
            fields.update(command=shlex.join(command), environment=recorded)
            entries.append({"run_dir": str(run_dir), "fields": fields})
        runs.write_text("".join(f"{e['run_dir']}\n" for e in entries))
        sbatch = "\n".join(f"#SBATCH {line}" for line in self.settings.sbatch_lines(self.nproc))
        script.write_text(
            JOB_SCRIPT.format(
                name=shlex.quote(name),
                output=shlex.quote(str(folder).replace("%", "%%")),  # sbatch expands %A, %a ...: %% is a %
                signal_seconds=self.settings.signal_seconds,
                shutdown_seconds=max(10, self.settings.signal_seconds - 10),  # the warning, less time to pass it on
                sbatch=sbatch,
                runs=shlex.quote(str(runs)),
                root=shlex.quote(str(Path(__file__).resolve().parents[2])),
                python=shlex.quote(sys.executable),
                command=COMMAND_FILE,
                log=LOG_FILE,
                lock=TRAINER_LOCK,
                preempted=PREEMPTED_EXIT_CODE,
                max_requeues=self.settings.max_requeues,
                port_base=RENDEZVOUS_PORTS[0],
                port_span=RENDEZVOUS_PORTS[1],
            )
        )
        # Written before sbatch: whatever sbatch answers, a later call finds the array by its name.
        submission = {"name": name, "time": time.time(), "script": str(script), "runs": [e["run_dir"] for e in entries]}
        submission["entries"] = entries
        record = folder / f"array-{stamp}{SUBMISSION_SUFFIX}"
        write_text_atomically(record, json.dumps(submission, indent=1) + "\n")
        command = ["sbatch", "--parsable", f"--array=0-{len(queued) - 1}%{self.parallel}"]
        command += [f"--dependency=afterany:{after}"] if after else []
        result = _slurm([*command, str(script)])
        array = (result.stdout.strip().split(";")[0] or None) if result.returncode == 0 else None
        if array is None and (result.returncode == 0 or unconfirmed(result.stderr)):  # queued or not: look it up
            found = arrays_named(name)
            if not found:
                print(
                    f"slurm: sbatch did not confirm the array ({one_line(result.stderr)}); Slurm may have queued it: "
                    f"the next call looks for it by its name ({name}) before submitting any of its "
                    f"{len(queued)} run(s) again; run the same command again in a few minutes",
                    flush=True,
                )
                for job in queued:
                    job.job_id = ""
                return None
            array = found[0]
            print(f"slurm: sbatch did not confirm the array ({one_line(result.stderr)}), but Slurm queued it")
        if array is None:
            record.unlink()
            self._refused(result.stderr, queued)
            return None
        for index, job in enumerate(queued):
            job.job_id = f"{array}_{index}"
        adopt(record, submission, array)
        print(
            f"slurm: submitted {len(queued)} run(s) as job array {array}, {self.parallel} at a time "
            f"(job script {script})",
            flush=True,
        )
        return array

    def _refused(self, stderr: str, queued: list[_Job]) -> None:
        """sbatch refused the array: not now (a hint, nothing failed: exit 0), or never (an error)."""
        lowered = stderr.lower()
        limit = any(word in lowered for word in SUBMIT_LIMIT)
        if any(word in lowered for word in TRANSIENT) or (limit and user_jobs() > 0):
            print(
                f"slurm: the queue takes no more jobs now ({one_line(stderr)}); nothing submitted, run the same "
                "command again later, when fewer of your jobs are queued",
                flush=True,
            )
            for job in queued:
                job.job_id = ""
            return
        if limit:  # no other job of the user queued: the array alone is above the limit, now and later
            raise SlurmRefused(
                f"Slurm refused the job array of {len(queued)} run(s) with none of your jobs queued: "
                f"{one_line(stderr)}; the study's runs are more than your submit limit (QOS or account "
                "MaxSubmitJobs): ask for a higher limit, or submit fewer runs per call (fewer --lrs, --seeds "
                "or optimizers, then extend)"
            )
        raise refusal(stderr)

    def wait(self) -> tuple[RunSpec, dict]:
        """The next run to end and its status; without ``--wait``, the next run Slurm holds, at once, with the
        outcome "submitted" (written nowhere: the sweep leaves it to Slurm)."""
        self._states = None  # the runs started after this one ends ask Slurm afresh
        if any(job.job_id is None for job in self.running):
            self._submit()
        unsubmitted = next((job for job in self.running if not job.job_id), None)
        if unsubmitted is not None:  # not taken this time: neither running nor failed, submitted next time
            self.running.remove(unsubmitted)
            return unsubmitted.spec, {"outcome": SUBMITTED}
        if not self.settings.wait:
            return self.running.pop(0).spec, {"outcome": SUBMITTED}
        while True:
            states = self._poll()
            for job in self.running:
                run_dir = run_folder(self.dump, job.spec)
                state = job_state(run_dir, read_job(run_dir), states)
                if state[0] not in ALIVE:
                    self.running.remove(job)
                    status = _ended_status(run_dir, job.job_id, state)
                    print(f"{job.spec.name}: {status['outcome']} (Slurm job {job.job_id})", flush=True)
                    if self.after_each is not None:
                        self.after_each()
                    self._poll_seconds = POLL_SECONDS  # the next rounds' runs may end soon after
                    return job.spec, status
            time.sleep(self._poll_seconds)
            self._poll_seconds = min(POLL_MAX_SECONDS, 2 * self._poll_seconds)

    def _poll(self) -> dict[str, tuple[str, str]]:
        """The states of the running jobs; while Slurm does not answer, asked again at the polling interval, for
        as long as UNANSWERED_SECONDS (then the sweep stops with that line; the jobs go on)."""
        since = time.monotonic()
        while True:
            try:
                return job_states([j.job_id for j in self.running])
            except SlurmUnanswered as unanswered:
                if time.monotonic() - since > UNANSWERED_SECONDS:
                    raise
                print(f"slurm: {unanswered}; asking again in {self._poll_seconds:.0f} s", flush=True)
            time.sleep(self._poll_seconds)
            self._poll_seconds = min(POLL_MAX_SECONDS, 2 * self._poll_seconds)


class SlurmRefused(Exception):
    """Slurm refuses the study's array for good (a submit limit below its size): an error, exit 1."""


def _array_of(submission: dict) -> Optional[str]:
    """The id of the array of an unconfirmed submission: Slurm's, by its name, or the job a run of it recorded
    starting under that name; None when neither knows it."""
    found = arrays_named(submission["name"])
    if found:
        return found[0]
    for run_dir in submission["runs"]:
        for event in read_events(Path(run_dir)):
            if event.get("job_name") == submission["name"] and event.get("job_id"):
                return event["job_id"].split("_")[0]
    return None


def _without_status(state: str) -> str:
    """What a job that ended without writing the run's status did (``state`` in squeue's words, lower case)."""
    if state == "timeout":  # killed at its limit: its step and save did not fit in the warning
        return (
            "reached its time limit before the run could save and stop; raise --slurm-time, or "
            "--slurm-signal-seconds if a step and its save take longer than the warning"
        )
    if state == "lost":
        return "was lost (a runaway: accounting kept it running after the controller forgot it)"
    return f"{state} without a status"


def _ended_status(run_dir: Path, job_id: str, state: tuple[str, str]) -> dict:
    """The status the job wrote (or a run that has ended anyway: trained by another trainer); one recorded here
    (failed) when the job ended without writing it (cancelled, killed at its time limit, its node lost)."""
    status = read_status(run_dir)
    job = read_job(run_dir)
    if status is not None and (is_done(status) or status.get("ended", 0) >= job["submitted"]):
        return status
    state = state[0].lower()
    status = ended_status(job["fields"], -1, run_dir, job["submitted"])
    status["message"] = f"Slurm job {job_id} {_without_status(state)}"
    write_status(run_dir, status)
    return status


if __name__ == "__main__":  # the job scripts of studies submitted before their calls moved to slurm_job
    sys.exit(main())
