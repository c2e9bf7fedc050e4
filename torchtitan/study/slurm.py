"""A study's runs as Slurm jobs: each sweep call submits the runs it still lacks as one job array, whose concurrency
limit is ``--parallel``; the jobs outlive the sweep, which may exit after submitting.

Each array task trains one run through ``srun`` and the sweep's launcher (``run_llama_train.sh``: torchrun on one
node, or on ``--slurm-nodes`` nodes with a rendezvous on the first), appending to the run's ``train.log``. The job
script asks for ``--signal=B:USR1@{seconds}`` and traps USR1 and TERM: it passes SIGTERM to the run, which saves its
step and exits (torchtitan/preemption.py), and requeues the task, which resumes from that checkpoint. When the run
ends the task writes its ``sweep_status.json`` as the local runner does.

What Slurm knows, each run folder keeps: ``slurm_job.json`` (the job of its last submission) and
``slurm_events.jsonl`` (each start, preemption and end of it). A run's state is read from its folder and from Slurm
(``squeue``, and ``sacct`` where the cluster keeps accounting): pending, running, preempted (requeued, waiting),
finished, diverged or failed. A run with a job still alive is never submitted again.

The job script calls back into this module: ``python -m torchtitan.study.slurm started|preempted|ended RUN_DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import PREEMPTED_EXIT_CODE, UserError
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
from torchtitan.study.scheduling import RUN_ENVIRONMENT, command_script, ended_status, spec_fields

SLURM_FOLDER = "slurm"  # in the dump folder: each submission's job script, its list of run folders, Slurm's output
JOB_FILE = "slurm_job.json"  # in a run folder: its last submission's job id, and the run's cell
EVENTS_FILE = "slurm_events.jsonl"  # in a run folder: each start, preemption and end of its jobs
POLL_SECONDS = 2.0
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
}
PENDING, RUNNING, PREEMPTED = "pending", "running", "preempted"
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
# Refusals that mean "not now" (a full queue, a busy controller), not "never": nothing is submitted, nothing failed.
QUEUE_FULL = ("MaxSubmit", "job submit limit", "temporarily", "did not answer")


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

    def sbatch_lines(self, cpus: int) -> list[str]:
        lines = [f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
        lines += [f"--partition={self.partition}"] if self.partition else []
        lines += [f"--account={self.account}"] if self.account else []
        lines += [f"--time={self.time}"] if self.time else []
        lines += [f"--gpus-per-node={self.gpus}"] if self.gpus else []
        if self.options_file:
            for line in Path(self.options_file).read_text().splitlines():
                line = line.strip()
                line = line[len("#SBATCH") :].strip() if line.startswith("#SBATCH") else line
                if line and not line.startswith("#"):
                    lines.append(line)
        return lines


def slurm_settings(args: argparse.Namespace) -> Optional[SlurmSettings]:
    """The Slurm options checked; None for ``--scheduler local`` (where any of them is a mistake)."""
    given = [f"--{k.replace('_', '-')}" for k in vars(args) if k.startswith("slurm_") and getattr(args, k) is not None]
    given += ["--wait"] if args.wait else []
    if args.scheduler != "slurm":
        if given:
            raise UserError(f"{given[0]} applies to --scheduler slurm; add --scheduler slurm or drop {given[0]}")
        return None
    for name in ("slurm_gpus", "slurm_nodes", "slurm_signal_seconds"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "slurm_gpus" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be at least {0 if name == 'slurm_gpus' else 1}")
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

    @property
    def seconds(self) -> float:
        return self.start_seconds + self.interval_steps * self.step_seconds


def first_log(run_dir: Path, status: dict) -> Optional[FirstLog]:
    """Measured from a finished run's own logs (None when it logged no step time or fewer than two log lines): the
    median step time over its log lines, the most common gap between logged steps, and whatever of its wall time
    those steps do not account for."""
    from torchtitan.step_timing import PARTS  # here: the job script's calls need no torch
    from torchtitan.step_timing import tag as time_tag

    scalars = merged_scalars(run_dir)
    parts = [scalars[time_tag(p)] for p in PARTS if time_tag(p) in scalars]
    loss = scalars.get(LOSS)
    if not parts or loss is None or len(loss.steps) < 2 or status.get("seconds") is None:
        return None
    per_step = [sum(vals) for vals in zip(*(s.values for s in parts))]
    gaps = [b - a for a, b in zip(loss.steps, loss.steps[1:])]
    interval = max(set(gaps), key=lambda g: (gaps.count(g), g))
    step_seconds = sorted(per_step)[len(per_step) // 2]
    start = max(0.0, float(status["seconds"]) - loss.steps[-1] * step_seconds)
    return FirstLog(run_dir.name, start, interval, step_seconds)


def check_time_limit(settings: SlurmSettings, dump: Path) -> None:
    """A time limit that cannot let a run start and log once before its warning is refused, measured on the runs of
    this study that finished and logged their step time (the slowest of them); nothing is checked before any has."""
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


def slurm_time(seconds: int) -> str:
    """Seconds as Slurm's H:MM:SS (D-HH:MM:SS past a day)."""
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


# ----------------------------------------------------------------------------------------------------------------
# Asking Slurm


def _slurm(command: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """A Slurm command's result; one that does not answer in time (sbatch retries while the controller takes no
    more jobs) ends with code 124 and says so."""
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
    result = _slurm(command)
    if result.returncode != 0:
        raise UserError(f"Slurm did not answer (sinfo: {one_line(result.stderr)}); is the cluster up?")
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


def job_states(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """(state, reason) of each job Slurm still knows among ``job_ids`` (array tasks as ``123_4``)."""
    if not job_ids:
        return {}
    arrays = sorted({j.split("_")[0] for j in job_ids})
    result = _slurm(["squeue", "-h", "-r", "--states=all", "-j", ",".join(arrays), "-o", "%i|%T|%r"])
    states: dict[str, tuple[str, str]] = {}
    if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
        raise UserError(f"Slurm did not answer (squeue: {one_line(result.stderr)}); is the cluster up?")
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
                    states[parts[0]] = (parts[1].split()[0], "")
    return states


# ----------------------------------------------------------------------------------------------------------------
# A run's folder: its job, its events, its state


def read_job(run_dir: Path) -> Optional[dict]:
    path = run_dir / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else None


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_state(run_dir: Path, states: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """(state, detail) of a run: its job's while the job lives, else its status' outcome ("" when it never ran)."""
    job = read_job(run_dir)
    alive = job is not None and states.get(job["job_id"], ("", ""))[0] in ALIVE
    if alive:
        state, reason = states[job["job_id"]]
        events = [e for e in read_events(run_dir) if e.get("job_id") == job["job_id"]]
        requeued = bool(events) and events[-1]["event"] == PREEMPTED
        if state == "PENDING":
            why = f", {reason}" if reason and reason != "None" else ""
            return (PREEMPTED if requeued else PENDING), f"job {job['job_id']}{why}"
        return RUNNING, f"job {job['job_id']}, {state.lower()}"
    status = read_status(run_dir)
    if status is not None:
        return status["outcome"], status.get("message", "")
    if job is not None:
        ended = states.get(job["job_id"], ("ended", ""))[0].lower()
        return "failed", f"job {job['job_id']} {_without_status(ended)}; the next call submits it again"
    return "", ""


def print_states(dump: Path) -> dict[str, int]:
    """One line per run of ``dump`` submitted to Slurm, then the count of each state; the counts."""
    run_dirs = sorted(p for p in (dump / RUNS_FOLDER).glob("*") if p.is_dir())
    jobs = {d: read_job(d) for d in run_dirs}
    submitted = [d for d in run_dirs if jobs[d] is not None]
    if not submitted:
        return {}
    states = job_states([jobs[d]["job_id"] for d in submitted])
    counts: dict[str, int] = {}
    for d in submitted:
        state, detail = run_state(d, states)
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
# USR1 (ahead of the time limit) or TERM (preemption): the run is asked to save its step and stop, and the task is
# requeued; it resumes from that checkpoint.
run_dir=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {runs})
record() {{ PYTHONPATH={root} {python} -m torchtitan.study.slurm "$1" "$run_dir" "${{2:-}}"; }}
stop=""
step=""
# SIGTERM to the run's processes through Slurm (not to srun, which would end the step at once)
forward() {{ stop=$1; [ -n "$step" ] && scancel --signal=TERM "$SLURM_JOB_ID"; }}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
record started
export NNODES=$SLURM_NNODES RDZV_ID=$SLURM_JOB_ID
# torchrun, signalled too, gives its workers this long to save before it kills them (its default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{shutdown_seconds}}}
RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500
export RDZV_ENDPOINT
echo "$ (Slurm job $SLURM_JOB_ID, start $((${{SLURM_RESTART_COUNT:-0}} + 1))) $(tail -n 1 "$run_dir/{command}")" \\
    >>"$run_dir/{log}"
srun --kill-on-bad-exit=1 bash "$run_dir/{command}" >>"$run_dir/{log}" 2>&1 &
step=$!
wait "$step"
code=$?
while kill -0 "$step" 2>/dev/null; do
    wait "$step"
    code=$?
done
# Stopped by the run (it saved its step), or killed by the signal before it could: again. A run that ended
# anyway (its last step done as the signal came) has ended.
if [ "$code" -eq {preempted} ] || {{ [ -n "$stop" ] && [ "$code" -ne 0 ]; }}; then
    record preempted "$code"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
record ended "$code"
"""


@dataclass
class _Job:
    spec: RunSpec
    job_id: Optional[str]  # None until submitted; "" when a full queue took it not


class SlurmRunner:
    """The local ``Runner``'s interface over Slurm: ``start`` queues a run for the next job array (or adopts the
    job of it still alive), ``wait`` submits the array and, with ``--wait``, returns the next run to end; without,
    it raises :class:`Detached` once submitted."""

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

    def __enter__(self) -> "SlurmRunner":
        return self

    def __exit__(self, *exc) -> None:  # the jobs outlive the sweep
        pass

    def free(self) -> int:
        return 1  # Slurm holds the queue: every run goes into the array, --parallel of them at once

    def start(self, spec: RunSpec, label: str) -> None:
        run_dir = run_folder(self.dump, spec)
        job = read_job(run_dir)
        if job is not None and self._known_states().get(job["job_id"], ("",))[0] in ALIVE:
            print(f"{label} {spec.name}: Slurm job {job['job_id']} is still there, not submitted again", flush=True)
            self.running.append(_Job(spec, job["job_id"]))
            return
        self.running.append(_Job(spec, None))  # submitted with the others at the next wait()

    def _known_states(self) -> dict[str, tuple[str, str]]:
        """The states of every job this dump folder's runs recorded, asked of Slurm once per submission (not once
        per run: a study of a hundred runs is one squeue, not a hundred)."""
        if self._states is None:
            jobs = [read_job(d) for d in (self.dump / RUNS_FOLDER).glob("*") if d.is_dir()]
            self._states = job_states([job["job_id"] for job in jobs if job is not None])
        return self._states

    def _submit(self) -> None:
        queued = [(job.spec, job) for job in self.running if job.job_id is None]
        folder = self.dump / SLURM_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        runs, script = folder / f"array-{stamp}.runs", folder / f"array-{stamp}.sh"
        environment = {"NGPU": str(self.nproc), "CONFIG_FILE": self.config_file, "PYTHON": sys.executable}
        recorded = {**{k: os.environ[k] for k in RUN_ENVIRONMENT if k in os.environ}, **environment}
        recorded.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm gives each job its GPUs
        commands = {}
        for spec, _ in queued:
            run_dir = run_folder(self.dump, spec)
            run_dir.mkdir(parents=True, exist_ok=True)
            command = run_command(spec, run_dir, self.train_args, self.launcher, self.vary_data_seed, self.wandb_group)
            (run_dir / COMMAND_FILE).write_text(command_script(command, recorded, os.getcwd()))
            commands[spec.name] = (command, run_dir)
        runs.write_text("".join(f"{commands[spec.name][1]}\n" for spec, _ in queued))
        sbatch = "\n".join(f"#SBATCH {line}" for line in self.settings.sbatch_lines(self.nproc))
        script.write_text(
            JOB_SCRIPT.format(
                name=f"study-{self.dump.name}",
                output=shlex.quote(str(folder)),
                signal_seconds=self.settings.signal_seconds,
                shutdown_seconds=max(10, self.settings.signal_seconds - 10),  # the warning, less time to pass it on
                sbatch=sbatch,
                runs=shlex.quote(str(runs)),
                root=shlex.quote(str(Path(__file__).resolve().parents[2])),
                python=shlex.quote(sys.executable),
                command=COMMAND_FILE,
                log=LOG_FILE,
                preempted=PREEMPTED_EXIT_CODE,
            )
        )
        result = _slurm(["sbatch", "--parsable", f"--array=0-{len(queued) - 1}%{self.parallel}", str(script)])
        if result.returncode != 0:
            if any(word.lower() in result.stderr.lower() for word in QUEUE_FULL):
                print(
                    f"slurm: the queue takes no more jobs now ({one_line(result.stderr)}); nothing submitted, run "
                    "the same command again later",
                    flush=True,
                )
                for _, job in queued:
                    job.job_id = ""
                return
            raise refusal(result.stderr)
        array = result.stdout.strip().split(";")[0]
        for index, (spec, _) in enumerate(queued):
            command, run_dir = commands[spec.name]
            fields = spec_fields(spec, self.vary_data_seed)
            fields.update(command=shlex.join(command), environment=recorded)
            job = {"job_id": f"{array}_{index}", "array": array, "submitted": time.time(), "fields": fields}
            (run_dir / JOB_FILE).write_text(json.dumps(job, indent=1) + "\n")
            queued[index][1].job_id = job["job_id"]
        print(
            f"slurm: submitted {len(queued)} run(s) as job array {array}, {self.parallel} at a time "
            f"(job script {script})",
            flush=True,
        )

    def wait(self) -> tuple[RunSpec, dict]:
        """The next run to end and its status; without ``--wait``, the next run Slurm holds, at once, with the
        outcome "submitted" (written nowhere: the sweep leaves it to Slurm)."""
        self._states = None  # the runs started after this one ends ask Slurm afresh
        if any(job.job_id is None for job in self.running):
            self._submit()
        unsubmitted = next((job for job in self.running if not job.job_id), None)
        if unsubmitted is not None:  # a full queue took none of them: neither running nor failed, submitted next time
            self.running.remove(unsubmitted)
            return unsubmitted.spec, {"outcome": SUBMITTED}
        if not self.settings.wait:
            return self.running.pop(0).spec, {"outcome": SUBMITTED}
        while True:
            states = job_states([j.job_id for j in self.running])
            for job in self.running:
                if states.get(job.job_id, ("ENDED",))[0] not in ALIVE:
                    self.running.remove(job)
                    status = _ended_status(run_folder(self.dump, job.spec), job.job_id, states)
                    print(f"{job.spec.name}: {status['outcome']} (Slurm job {job.job_id})", flush=True)
                    if self.after_each is not None:
                        self.after_each()
                    return job.spec, status
            time.sleep(POLL_SECONDS)


def _without_status(state: str) -> str:
    """What a job that ended without writing the run's status did (``state`` in squeue's words, lower case)."""
    if state == "timeout":  # killed at its limit: its step and save did not fit in the warning
        return (
            "reached its time limit before the run could save and stop; raise --slurm-time, or "
            "--slurm-signal-seconds if a step and its save take longer than the warning"
        )
    return f"{state} without a status"


def _ended_status(run_dir: Path, job_id: str, states: dict) -> dict:
    """The status the job wrote; one recorded here (failed) when the job ended without writing it (cancelled,
    killed at its time limit, its node lost)."""
    status = read_status(run_dir)
    job = read_job(run_dir)
    if status is not None and status.get("ended", 0) >= job["submitted"]:
        return status
    state = states.get(job_id, ("ended",))[0].lower()
    status = ended_status(job["fields"], -1, run_dir, job["submitted"])
    status["message"] = f"Slurm job {job_id} {_without_status(state)}"
    write_status(run_dir, status)
    return status


# ----------------------------------------------------------------------------------------------------------------
# The job script's calls: python -m torchtitan.study.slurm started|preempted|ended RUN_DIR [EXIT_CODE]


def _event(run_dir: Path, event: str, code: Optional[int]) -> dict:
    entry = {
        "event": event,
        "job_id": _job_id(),
        "time": time.time(),
        "start": int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1,
        **({"exit_code": code} if code is not None else {}),
    }
    with open(run_dir / EVENTS_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def _job_id() -> str:
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    event, run_dir = argv[0], Path(argv[1])
    code = int(argv[2]) if len(argv) > 2 and argv[2] else None
    _event(run_dir, event, code)
    if event == "ended":
        job = read_job(run_dir)
        starts = [e["time"] for e in read_events(run_dir) if e["event"] == "started" and e["job_id"] == _job_id()]
        write_status(run_dir, ended_status(job["fields"], code, run_dir, starts[0] if starts else job["submitted"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
