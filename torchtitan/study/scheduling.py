"""Running a sweep's runs: K launcher processes at a time, each in a slot of its own (its own GPUs on a GPU machine),
each run's log, command and outcome, and the end of every run still going when the sweep is interrupted."""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from torchtitan.errors import USER_ERROR_EXIT_CODE, UserError
from torchtitan.study.plan import (
    COMMAND_FILE,
    FAILED,
    LOG_FILE,
    RunSpec,
    axis_value,
    run_command,
    run_folder,
    wandb_group,
)
from torchtitan.study.run_folders import read_status, status_paths, write_status
from torchtitan.study.run_status import (  # noqa: F401 (their home: a leaf, which a job script's record imports)
    ATTEMPT_MARK,
    attempt_error_line,
    ended_status,
    is_done,
    outcome,
    run_exit_code,
)

# How often the runner looks for runs that ended (a run takes seconds at the very least).
POLL_SECONDS = 0.1
# The environment a run gets from the sweep, recorded in its status and command.sh (the rest is the sweep's own).
# PYTHON: the sweep's own interpreter, which run_llama_train.sh trains with whatever PATH holds.
RUN_ENVIRONMENT = ("NGPU", "CONFIG_FILE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHON")
# In a run's folder: held (flock) by whoever trains the run, a local sweep's launcher or a Slurm job script, so that
# two never train one run at once.
TRAINER_LOCK = "trainer.lock"
ELSEWHERE = "training elsewhere"  # what the sweep says of a run another trainer holds (written nowhere)


def lock_trainer(run_dir: Path) -> Optional[int]:
    """An open descriptor holding the run's trainer lock, or None when another process holds it."""
    fd = os.open(run_dir / TRAINER_LOCK, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


# ----------------------------------------------------------------------------------------------------------------
# Slots: where K runs go at once


@dataclass(frozen=True)
class Slot:
    """One place a run trains: its GPUs (CUDA_VISIBLE_DEVICES) on a GPU machine, none on CPU."""

    number: int
    gpus: tuple[str, ...] = ()

    def environment(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}


def visible_gpus(environ: dict[str, str]) -> list[str]:
    """The GPUs this process may use, by the ids its runs are given: CUDA_VISIBLE_DEVICES' entries where it is set
    (as many as torch sees), else 0 .. count-1."""
    import torch

    count = torch.cuda.device_count()
    listed = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if "CUDA_VISIBLE_DEVICES" in environ else [str(i) for i in range(count)]


def plan_slots(parallel: int, nproc: int, gpus: Sequence[str]) -> list[Slot]:
    """K slots of ``nproc`` GPUs each, the GPUs in order and never shared (K x nproc at most the GPUs present); on
    a machine without GPUs, K slots of CPU processes."""
    if parallel < 1:
        raise UserError(f"--parallel must be at least 1; got {parallel}")
    if not gpus:
        return [Slot(number) for number in range(parallel)]
    if parallel * nproc > len(gpus):
        raise UserError(
            f"--parallel {parallel} runs of {nproc} GPU(s) each need {parallel * nproc} GPUs, but {len(gpus)} are "
            f"present ({','.join(gpus)}); lower --parallel or --nproc"
        )
    return [Slot(n, tuple(gpus[n * nproc : (n + 1) * nproc])) for n in range(parallel)]


# ----------------------------------------------------------------------------------------------------------------
# One run


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """End launchers and everything they started (torchrun forwards SIGTERM to its workers): SIGTERM to every
    process group at once, SIGKILL to those still there after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        alive = [p for p in processes if p.poll() is None]
        for process in alive:
            _signal_group(process, sig)
        deadline = time.monotonic() + wait
        for process in alive:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue


def command_script(command: Sequence[str], environment: dict[str, str], cwd: str) -> str:
    """``command.sh``: the run's exact command, in the folder and with the environment the sweep gave it."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in environment.items())
    return (
        "#!/usr/bin/env bash\n"
        "# The command the sweep ran this run with; running it again resumes or repeats the run in this folder.\n"
        f"cd {shlex.quote(cwd)}\n"
        f"{assignments} exec {shlex.join(command)}\n"
    )


@dataclass
class _Running:
    spec: RunSpec
    slot: Slot
    process: Optional[subprocess.Popen]  # None: another trainer holds the run (its folder's lock)
    log: object
    command: list[str]
    environment: dict[str, str]
    started: float
    label: str
    lock: Optional[int]  # the run's trainer lock, which the launcher holds too

    def close(self) -> None:
        if self.log is not None and not self.log.closed:
            self.log.close()
        if self.lock is not None:
            os.close(self.lock)


class Runner:
    """Trains runs K at a time, one per slot: ``start`` a run on a free slot, ``wait`` for the next one to end.

    Each run's folder gets ``train.log`` (every attempt's output, each after a ``$ command`` line), ``command.sh``
    and, when it ends, ``sweep_status.json``; then ``after_each`` is called. Used as a context manager: leaving it
    by an exception (an interrupt, a user error in one run) ends every run still going, which then has no status and
    trains again next time."""

    def __init__(
        self,
        dump: Path,
        config_file: str,
        nproc: int,
        train_args: Sequence[str],
        launcher: Sequence[str],
        slots: Sequence[Slot],
        vary_data_seed: bool = False,
        after_each: Optional[Callable[[], None]] = None,
    ):
        self.dump = dump
        self.train_args = list(train_args)
        self.launcher = list(launcher)
        self.vary_data_seed = vary_data_seed
        self.slots = list(slots)
        self.base_environment = {"NGPU": str(nproc), "CONFIG_FILE": config_file, "PYTHON": sys.executable}
        self.wandb_group = wandb_group(dump, config_file, train_args)
        self.running: list[_Running] = []
        self.after_each = after_each  # called after each run's status is written (the sweep's interim report)

    def __enter__(self) -> "Runner":
        self._previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.running:  # left by an exception: no run outlives the sweep
                _stop([r.process for r in self.running if r.process is not None])
                for r in self.running:
                    r.close()
                self.running.clear()
        finally:
            signal.signal(signal.SIGTERM, self._previous)

    def free(self) -> int:
        return len(self.slots) - len(self.running)

    def start(self, spec: RunSpec, label: str) -> None:
        busy = {r.slot for r in self.running}
        slot = next(s for s in self.slots if s not in busy)
        run_dir = run_folder(self.dump, spec)
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_trainer(run_dir)
        if lock is None:  # a Slurm job of the study trains it now: its job records how it ends
            print(f"{label} {spec.name}: {ELSEWHERE} (another process holds {run_dir / TRAINER_LOCK})", flush=True)
            self.running.append(_Running(spec, slot, None, None, [], {}, time.time(), label, None))
            return
        command = run_command(spec, run_dir, self.train_args, self.launcher, self.vary_data_seed, self.wandb_group)
        environment = {**os.environ, **self.base_environment, **slot.environment()}
        recorded = {k: environment[k] for k in RUN_ENVIRONMENT if k in environment}
        (run_dir / COMMAND_FILE).write_text(command_script(command, recorded, os.getcwd()))
        log = open(run_dir / LOG_FILE, "ab")
        log.write(f"\n$ {shlex.join(command)}\n".encode())
        log.flush()
        where = f" on GPU {','.join(slot.gpus)}" if slot.gpus else ""
        print(f"{label} {spec.name}: training{where} (log: {run_dir / LOG_FILE})", flush=True)
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True, pass_fds=(lock,)
        )
        self.running.append(_Running(spec, slot, process, log, command, recorded, time.time(), label, lock))

    def wait(self) -> tuple[RunSpec, dict]:
        """The next run to end and its status (written to its folder); a run stopped by a mistake in its options
        ends the sweep with that mistake."""
        while True:
            ended = next((r for r in self.running if r.process is None or r.process.poll() is not None), None)
            if ended is not None:
                break
            time.sleep(POLL_SECONDS)
        self.running.remove(ended)
        if ended.process is None:
            return ended.spec, {"outcome": ELSEWHERE}
        ended.log.close()
        status = self._record(ended)  # under the lock: no job starts the run between its end and its status
        ended.close()
        message = f" ({status['message']})" if "message" in status else ""
        print(
            f"{ended.label} {ended.spec.name}: {status['outcome']}, exit {status['exit_code']}, "
            f"{status['seconds']:.0f} s{message}",
            flush=True,
        )
        if status["exit_code"] == USER_ERROR_EXIT_CODE:
            raise UserError(f"{ended.spec.name} stopped on a mistake in its options: {status['message']}")
        if self.after_each is not None:
            self.after_each()
        return ended.spec, status

    def _record(self, run: _Running) -> dict:
        fields = spec_fields(run.spec, self.vary_data_seed)
        fields.update(command=shlex.join(run.command), environment=run.environment)
        status = ended_status(fields, run.process.returncode, run_folder(self.dump, run.spec), run.started)
        write_status(run_folder(self.dump, run.spec), status)
        return status


def spec_fields(spec: RunSpec, vary_data_seed: bool = False) -> dict:
    """What a run's status says of its cell: optimizer, lr, seed, data seed, swept options and budget."""
    return {
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        **({"data_seed": spec.seed} if vary_data_seed else {}),
        **({"options": {k: axis_value(v) for k, v in spec.options}} if spec.options else {}),
        **({"option_values": dict(spec.options)} if spec.options else {}),
        **(spec.budget.status() if spec.budget else {}),
    }


def first_failure(dump: Path, since: float) -> str:
    """``; first: {run}: {why}`` for the run of ``dump`` that failed first among those that ended at ``since`` or
    later ("" when none did): what the sweep's last line names, so that a run that could not start says why."""
    failed = []
    for path in status_paths(dump):
        status = read_status(path.parent)
        if status.get("outcome") == FAILED and status.get("ended", 0.0) >= since:
            failed.append((status["ended"], path.parent.name, status.get("message", "")))
    if not failed:
        return ""
    _, name, message = min(failed)
    return f"; first: {name}: {message}" if message else f"; first: {name}"


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_all(runner: Runner, specs: Sequence[RunSpec]) -> list[dict]:
    """Run every spec not yet finished or diverged, as many at once as the runner has slots, in the plan's order;
    the status of each spec, in order."""
    statuses: dict[str, dict] = {}
    queue = []
    for index, spec in enumerate(specs, 1):
        status = read_status(run_folder(runner.dump, spec))
        if is_done(status):
            print(f"[{index}/{len(specs)}] {spec.name}: {status['outcome']} earlier, skipped", flush=True)
            statuses[spec.name] = status
        else:
            queue.append((index, spec))
    with runner:
        while queue or runner.running:
            while queue and runner.free():
                index, spec = queue.pop(0)
                runner.start(spec, f"[{index}/{len(specs)}]")
            spec, status = runner.wait()
            statuses[spec.name] = status
    return [statuses[spec.name] for spec in specs]
