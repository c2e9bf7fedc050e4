"""A study of 50 runs through a stand-in Slurm controller (tests/slurm_controller.py) that runs the sweep's job
scripts and misbehaves as busy clusters do, under 20 seeded fault schedules (CHAOS_SCHEDULES=N for another count):
answers of sbatch lost after it queued the array, arrays listed late, squeue and sacct failing for a while, runaway
jobs, a small MaxArraySize, preemptions, warnings ahead of time limits (with scancel refusing to signal for a while),
users' cancels.

In every schedule the study is called again until each run has finished; each run trains each of its steps exactly
once and ends exactly once, counted by the made-up trainer's own ledger (tests/chaos_trainer.py), never by the
sweep; the study ends within a bounded number of calls, no call prints a traceback, and every run is recorded
finished once.

Most of a schedule's time is waiting (for its trainers' steps, for the sweep's bounds to pass, for sbatch answers
that never come), so the schedules run side by side, each in a process forked from the test's own (the sweep's
calls stay in-process calls of its command-line entry point), AT_ONCE at a time.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from tests.chaos_trainer import TRAINER, ledger_problems
from tests.helpers import ROOT
from tests.processes import MARK, SUITE, end_tree, marked
from tests.slurm_controller import Controller, install
from torchtitan.study import report, slurm
from torchtitan.study import sweep as study_sweep
from torchtitan.tools.sweep import main

RUNS = 50
STEPS = 4
SCHEDULES = int(os.environ.get("CHAOS_SCHEDULES", "20"))
AT_ONCE = 4  # schedules side by side: while one waits, another's processes work
SCHEDULE_SECONDS = 300.0  # a schedule still going after this long has hung
MAX_CALLS = 12


def fault_schedule(seed: int) -> tuple[dict, int, bool]:
    """The controller's faults for ``seed``, the study's --parallel, and whether its first call waits (--wait)."""
    draw = random.Random(seed)
    faults = {
        "seed": seed,
        "sbatch_modes": [draw.choice(["ok", "ok", "lost", "timeout", "unqueued", "busy"]) for _ in range(4)],
        "sbatch_timeout": 6.0,  # past the sweep's 5 s: sbatch "did not answer"
        "late_rate": draw.choice([0.0, 0.5]),
        "late": 0.6,  # listed that long after being queued
        "squeue_fail": draw.choice([0.0, 0.1, 0.3]),
        "squeue_spell": draw.randint(1, 3),
        "sacct_fail": draw.choice([0.0, 0.2]),
        "runaway": draw.choice([0.0, 0.05]),
        "max_array_size": draw.choice([1001, 16, 7]),
        "preempt": draw.uniform(0.0, 0.15),
        "warn": draw.uniform(0.0, 0.15),
        "cancel": draw.uniform(0.0, 0.04),
        "fault_window": 0.25,
        "not_alterable": draw.choice([0.0, 0.5]),
        "grace": 3.0,
        "requeue_delay": 0.1,
        "min_job_age": draw.choice([0.3, 5.0]),
    }
    return faults, draw.choice([4, 8, 12]), draw.random() < 0.3


def run_schedule(seed: int, folder: Path) -> list[str]:
    """The study through the fault schedule ``seed``, in a process of its own (its environment is the schedule's):
    what went wrong, with each call's output ([] when nothing did)."""
    faults, parallel, wait = fault_schedule(seed)
    controller_folder, ledger, dump = folder / "controller", folder / "ledger", folder / "study"
    controller_folder.mkdir(parents=True)
    ledger.mkdir()
    os.environ.update(
        PATH=install(controller_folder),
        CHAOS_LEDGER=str(ledger),
        CHAOS_STEP_SECONDS="0.05",
        PYTHONPATH=str(ROOT),
    )
    seeds = ",".join(str(s) for s in range(RUNS))
    argv = ["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", TRAINER, "--optimizers", "AdamW"]
    argv += ["--lrs", "1e-3", "--seeds", seeds, "--parallel", str(parallel), "--nproc", "1"]
    argv += ["--slurm-max-requeues", "30"]
    outputs, last = [], ""
    with Controller(controller_folder, faults, seed) as controller:
        for call in range(1, MAX_CALLS + 1):
            began = time.monotonic()
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = main([*argv, *(["--wait"] if wait and call == 1 else []), "--", "--training.steps", str(STEPS)])
            out, err = out.getvalue(), err.getvalue()
            outputs.append(f"--- call {call}: exit {code} in {time.monotonic() - began:.1f} s\n{out}{err}")
            if "Traceback" in out + err:
                return ["a call printed a traceback", *outputs]
            # 1: runs failed (cancelled by a user), the next call retries them; 2: only for a controller that did
            # not answer (one line), which the next call asks again
            if not (code in (0, 1) or (code == 2 and err.startswith("error: Slurm did not answer"))):
                return [f"call {call} exited {code}", *outputs]
            began = time.monotonic()
            controller.settle()
            outputs.append(f"--- settled in {time.monotonic() - began:.1f} s")
            last = out
            if f"slurm: {RUNS} finished" in out:
                break
            time.sleep(0.3)  # what a user waits between calls, here long enough for the sweep's bounds to pass
    if f"slurm: {RUNS} finished" not in last:
        return [f"not every run finished in {MAX_CALLS} calls", *outputs]
    problems = [p for n in range(RUNS) for p in ledger_problems(ledger / f"AdamW_lr1e-3_seed{n}.jsonl", STEPS)]
    if problems:
        return problems + outputs
    statuses = [json.loads(p.read_text()) for p in (dump / "runs").glob("*/sweep_status.json")]
    if len(statuses) != RUNS or {s["outcome"] for s in statuses} != {"finished"}:
        return [f"statuses: {sorted(s['outcome'] for s in statuses)}", *outputs]
    return []


def _forked(seed: int, folder: Path) -> int:
    """Fork a process that runs schedule ``seed`` and writes what went wrong to ``folder/problems.json``; its pid.
    Every process it starts carries the schedule's mark, so that whatever it leaves behind can be ended."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ[MARK] = f"{SUITE}.chaos{seed}"
        problems = run_schedule(seed, folder)
        code = 0
    except BaseException:  # noqa: BLE001 - the test process reports it
        problems = [f"schedule {seed} raised:\n{traceback.format_exc()}"]
    finally:
        try:
            (folder / "problems.json").write_text(json.dumps(problems))
        finally:
            os._exit(code)


def side_by_side(seeds: list[int], folder: Path) -> dict[int, list[str]]:
    """Each schedule of ``seeds`` run in a forked process, AT_ONCE at a time; what went wrong in each (none when
    nothing did). Every process a schedule started is ended once it is done, whatever happened."""
    waiting, running, found = list(seeds), {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < AT_ONCE:
                seed = waiting.pop(0)
                (folder / f"schedule{seed}").mkdir()
                running[_forked(seed, folder / f"schedule{seed}")] = (seed, time.monotonic())
            for pid, (seed, began) in list(running.items()):
                # Seen ended but not reaped yet, so that its pid is still its own while what it left is ended.
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                late = time.monotonic() - began > SCHEDULE_SECONDS
                if ended is None and not late:
                    continue
                end_tree(pid, f"{SUITE}.chaos{seed}")
                os.waitpid(pid, 0)
                del running[pid]
                result = folder / f"schedule{seed}" / "problems.json"
                if late and ended is None:
                    found[seed] = [f"schedule {seed} did not end within {SCHEDULE_SECONDS:.0f} s"]
                elif not result.exists():
                    found[seed] = [f"schedule {seed} ended without a result"]
                elif problems := json.loads(result.read_text()):
                    found[seed] = problems
            time.sleep(0.1)
    finally:
        for pid, (seed, _) in running.items():
            end_tree(pid, f"{SUITE}.chaos{seed}")
            os.waitpid(pid, 0)
    return found


def test_every_run_of_a_study_trains_exactly_once_whatever_the_controller_does(tmp_path, monkeypatch):
    for name, value in (
        ("SLURM_TIMEOUT_SECONDS", 5.0),
        ("UNCONFIRMED_SECONDS", 1.5),
        ("RUNAWAY_SECONDS", 1.0),
        ("POLL_SECONDS", 0.05),
        ("POLL_MAX_SECONDS", 0.4),
        ("QUERY_RETRY_SECONDS", 0.05),
    ):
        monkeypatch.setattr(slurm, name, value)
    # The scheduler is what is under test: each call's report (scipy, matplotlib: seconds a call) is left out.
    monkeypatch.setattr(study_sweep, "write_report", lambda *args, **kwargs: None)
    monkeypatch.setattr(report, "write_report", lambda *args, **kwargs: None)
    found = side_by_side(list(range(SCHEDULES)), tmp_path)
    assert not found, "\n\n".join(f"=== schedule {seed}\n" + "\n".join(problems) for seed, problems in found.items())


def test_a_schedule_that_fails_raises_or_hangs_fails_the_test_and_leaves_no_process(tmp_path, monkeypatch):
    def schedule(seed: int, folder: Path) -> list[str]:
        if seed == 1:
            return ["AdamW_lr1e-3_seed3: trained steps [1, 2, 2, 3, 4]"]
        if seed == 2:
            raise RuntimeError("the stand-in broke")
        if seed == 3:
            subprocess.Popen(["sleep", "600"])  # left behind by a schedule that hangs
            time.sleep(600)
        return []

    monkeypatch.setattr(sys.modules[__name__], "run_schedule", schedule)
    monkeypatch.setattr(sys.modules[__name__], "SCHEDULE_SECONDS", 1.0)
    found = side_by_side([0, 1, 2, 3], tmp_path)
    assert sorted(found) == [1, 2, 3]
    assert found[1] == ["AdamW_lr1e-3_seed3: trained steps [1, 2, 2, 3, 4]"]
    assert "RuntimeError: the stand-in broke" in found[2][0]
    assert found[3] == ["schedule 3 did not end within 1 s"]
    assert not marked(f"{SUITE}.chaos3")
