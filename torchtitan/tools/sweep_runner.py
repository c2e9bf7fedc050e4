"""Running a sweep's runs: one launcher process at a time, its log, its outcome, and its end when interrupted."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from torchtitan.errors import DIVERGENCE_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError
from torchtitan.tools.runs import LOSS, Series, merged_scalars, read_status, write_status
from torchtitan.tools.summary import diverged_at_step
from torchtitan.tools.sweep_plan import (
    DIVERGED,
    FAILED,
    FINISHED,
    LOG_FILE,
    RunSpec,
    axis_value,
    run_command,
    run_folder,
)


def outcome(exit_code: int, scalars: dict[str, Series]) -> str:
    if exit_code == DIVERGENCE_EXIT_CODE:
        return DIVERGED
    if exit_code != 0:
        return FAILED
    if diverged_at_step(scalars) is not None:
        return DIVERGED
    return FINISHED if LOSS in scalars else FAILED


def _last_error_line(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1].strip()


def _stop(process: subprocess.Popen) -> None:
    """End the launcher and everything it started (torchrun forwards SIGTERM to its workers)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def train_one(spec: RunSpec, run_dir: Path, command: list[str], env: dict, vary_data_seed: bool = False) -> dict:
    """Run one job to its end, log to ``train.log``, and record the outcome in ``sweep_status.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(run_dir / LOG_FILE, "ab") as log:
        log.write(f"\n$ {shlex.join(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            exit_code = process.wait()
        except BaseException:  # interrupted: leave no marker, so that the next sweep runs it again
            _stop(process)
            raise
    scalars = merged_scalars(run_dir)
    status = {
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        **({"data_seed": spec.seed} if vary_data_seed else {}),
        **({"options": {k: axis_value(v) for k, v in spec.options}} if spec.options else {}),
        **({"option_values": dict(spec.options)} if spec.options else {}),
        **(spec.budget.status() if spec.budget else {}),
        "outcome": outcome(exit_code, scalars),
        "exit_code": exit_code,
        "command": shlex.join(command),
        "seconds": round(time.time() - started, 1),
        "ended": time.time(),
    }
    if status["outcome"] == DIVERGED and exit_code == 0:
        status["message"] = f"non-finite loss logged at step {diverged_at_step(scalars)}"
    elif status["outcome"] != FINISHED:
        status["message"] = _last_error_line(run_dir / LOG_FILE)
    write_status(run_dir, status)
    return status


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_sweep(
    specs: Sequence[RunSpec],
    dump: Path,
    config_file: str,
    nproc: int,
    train_args: Sequence[str],
    launcher: Sequence[str],
    vary_data_seed: bool = False,
) -> list[dict]:
    """Run every spec not yet finished or diverged; returns the status of each spec, in order."""
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": config_file}
    statuses = []
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for index, spec in enumerate(specs, 1):
            run_dir = run_folder(dump, spec)
            head = f"[{index}/{len(specs)}] {spec.name}:"
            status = read_status(run_dir)
            if status is not None and status["outcome"] in (FINISHED, DIVERGED):
                print(f"{head} {status['outcome']} earlier, skipped", flush=True)
                statuses.append(status)
                continue
            print(f"{head} training (log: {run_dir / LOG_FILE})", flush=True)
            command = run_command(spec, run_dir, train_args, launcher, vary_data_seed)
            status = train_one(spec, run_dir, command, env, vary_data_seed)
            message = f" ({status['message']})" if "message" in status else ""
            print(
                f"{head} {status['outcome']}, exit {status['exit_code']}, {status['seconds']:.0f} s{message}",
                flush=True,
            )
            statuses.append(status)
            if status["exit_code"] == USER_ERROR_EXIT_CODE:
                raise UserError(f"{spec.name} stopped on a mistake in its options: {status['message']}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return statuses
