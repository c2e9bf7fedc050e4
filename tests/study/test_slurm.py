"""A study through a real Slurm cluster (``scripts/slurm_cluster.sh start``; ``.ci/run`` brings one up):

- a 2-optimizer x 2-seed study of the debug model is submitted as one job array, the sweep exits, ``--report-only``
  follows the runs to the end, and a second call submits nothing new;
- a run warned as Slurm warns ahead of a time limit (USR1 to its job script) saves, is requeued, resumes, and ends
  with losses and a final state equal to an uninterrupted run's, bit for bit;
- bad input (an unknown partition, a time limit shorter than the warning or than the study's runs need to log once
  before it, --parallel above what the partition runs at once) stops the sweep with one line naming the option, and
  a full queue is not a failure.

Without Slurm these tests skip with one line; with CI=true they fail.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import processes
from tests.chaos_trainer import TRAINER, ledger_problems
from tests.helpers import DEBUG_RUN, FAKE, ROOT, by_step, metric_rows, one_error_line, read_checkpoint, train
from torchtitan.errors import UserError
from torchtitan.study.slurm import SlurmSettings, check_time_limit, job_name, run_state
from torchtitan.study.slurm_job import EVENTS_FILE, JOB_FILE, SLURM_FOLDER
from torchtitan.tools.sweep import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

TINY = ["--training.seq_len", "32", "--training.batch_size", "2", "--metrics.log_freq", "1"]
TIMEOUT = 300


@functools.cache
def slurm_is_up() -> bool:
    """Asked once: whether Slurm's commands are here and its controller answers (sinfo waits long on one down).
    Where a start is under way (``.ci/run`` starts the cluster in the background: SLURM_CLUSTER_STARTING, its
    process), first waits for it to end."""
    starting = os.environ.get("SLURM_CLUSTER_STARTING")
    deadline = time.monotonic() + 600
    while starting and processes._alive(int(starting)) and time.monotonic() < deadline:
        time.sleep(1)
    if shutil.which("sinfo") is None:
        return False
    try:
        up = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return False
    return up.returncode == 0 and any(s in up.stdout for s in ("idle", "mixed", "allocated", "completing"))


@pytest.fixture
def slurm(monkeypatch):
    """A Slurm cluster that takes jobs, and jobs that find this repository's Python (they inherit this environment)."""
    if not slurm_is_up():
        message = "no Slurm cluster here (scripts/slurm_cluster.sh start brings up one)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    bin_dir = str(Path(os.sys.executable).parent)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def dump(slurm, tmp_path):
    """The sweep's folder; every job of it is cancelled at the end, whatever happens."""
    folder = tmp_path / "study"
    yield folder
    names = [f"study-{folder.name}"]  # a test's own jobs; each array's: job_name(folder, its stamp)
    names += [
        job_name(folder.resolve(), script.stem[len("array-") :]) for script in (folder / SLURM_FOLDER).glob("*.sh")
    ]
    for name in names:
        subprocess.run(["scancel", "--name", name], capture_output=True)


def sweep(dump: Path, *args: str, train_args=(), launcher=None) -> int:
    argv = ["--dump-folder", str(dump), "--scheduler", "slurm", "--last-k", "2", *args]
    argv += ["--launcher", launcher] if launcher else []
    return main([*argv, "--", *TINY, *train_args])


def wait_until(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; squeue:\n{_squeue()}")
        time.sleep(1)


def _squeue() -> str:
    return subprocess.run(["squeue", "-r"], capture_output=True, text=True).stdout


def statuses(dump: Path) -> dict[str, str]:
    return {p.parent.name: json.loads(p.read_text())["outcome"] for p in (dump / "runs").glob("*/sweep_status.json")}


def job_scripts(dump: Path) -> list[Path]:
    return sorted((dump / SLURM_FOLDER).glob("array-*.sh"))


def test_a_study_through_slurm_is_one_job_array_and_a_second_call_submits_nothing(dump, capsys):
    study = ["--optimizers", "AdamW,AdamMini", "--lrs", "1e-3", "--seeds", "0,1", "--parallel", "2"]
    assert sweep(dump, *study, train_args=["--training.steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "submitted 4 run(s) as job array" in out and ", 2 at a time" in out
    (script,) = job_scripts(dump)
    jobs = {json.loads((d / JOB_FILE).read_text())["job_id"] for d in (dump / "runs").iterdir()}
    assert len({j.split("_")[0] for j in jobs}) == 1 and len(jobs) == 4  # one array, one task per run

    wait_until(lambda: len(statuses(dump)) == 4, "the 4 runs ending")
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "2"]) == 0
    report = capsys.readouterr().out
    assert "slurm: 4 finished" in report
    assert set(statuses(dump).values()) == {"finished"}

    assert sweep(dump, *study, train_args=["--training.steps", "3"]) == 0
    again = capsys.readouterr().out
    assert "submitted" not in again.replace("finished earlier, skipped", "") and job_scripts(dump) == [script]
    assert again.count("finished earlier, skipped") == 4

    # A time limit too short for these runs to start and log once before the 120 s warning: measured on them.
    assert sweep(dump, *study, "--slurm-time", "2:01", train_args=["--training.steps", "3"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: --slurm-time 2:01 is shorter than a run needs to log once"), line
    assert job_scripts(dump) == [script]


def test_a_live_job_is_never_submitted_again_and_a_full_queue_is_no_failure(dump, capsys):
    # The whole node taken by another job: the run waits in the queue.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--exclusive", "--job-name", f"study-{dump.name}", "-o", "/dev/null"]
        + ["--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_until(lambda: f"{blocker} " in _running(), "the blocking job starting")
    args = ["--optimizers", "AdamW", "--lrs", "1e-3", "--nproc", "1"]
    assert sweep(dump, *args, launcher=FAKE) == 0
    first = capsys.readouterr().out
    assert "submitted 1 run(s)" in first and "slurm: 1 pending" in first
    assert sweep(dump, *args, launcher=FAKE) == 0
    second = capsys.readouterr().out
    assert "is still there, not submitted again" in second and "slurm: 1 pending" in second
    assert len(job_scripts(dump)) == 1


def _state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def _running() -> str:
    return subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i "], capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    "args, option",
    [
        (["--slurm-partition", "no-such-partition"], "--slurm-partition"),
        (["--slurm-time", "1"], "--slurm-time"),  # one minute: less than the 120 s warning before the limit
        (["--slurm-time", "2:00:00"], "--slurm-time"),  # above the partition's time limit
        (["--parallel", "64"], "--parallel"),
    ],
    ids=["partition", "time-below-warning", "time-above-limit", "parallel"],
)
def test_bad_slurm_input_is_one_line_naming_the_option(args, option, dump, capsys):
    assert sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", *args, launcher=FAKE) == 2
    line = one_error_line(capsys)
    assert option in line, line
    assert not (dump / SLURM_FOLDER).exists()


def _finished_run(dump: Path, name: str, seconds: float, logs: dict[int, float], outcome: str = "finished") -> None:
    """A run folder as a finished run leaves it: its status and a metrics.jsonl with its step times."""
    folder = dump / "runs" / name
    (folder / "tb" / "20261203-000000").mkdir(parents=True)
    (folder / "sweep_status.json").write_text(json.dumps({"outcome": outcome, "seconds": seconds}))
    rows = [
        {
            "step": step,
            "loss_metrics/global_avg_loss": 5.0,
            "time/data(s)": 0.1 * t,
            "time/forward_backward(s)": 0.6 * t,
            "time/optimizer(s)": 0.3 * t,
            "time/checkpoint(s)": 0.0,
        }
        for step, t in logs.items()
    ]
    (folder / "tb" / "20261203-000000" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_time_limit_shorter_than_a_measured_start_and_logging_interval_is_refused(tmp_path):
    def settings(time_limit):
        return SlurmSettings(None, None, time_limit, 0, 1, None, 120, False)

    check_time_limit(settings("0:00:10"), tmp_path)  # nothing measured yet: nothing to check against
    # Steps of 0.5 s (the median; the first log line's 2 s holds compilation), a log line every 10 steps, 40 steps
    # in 50 s: 30 s of start. Logging once takes 30 + 10 x 0.5 = 35 s, then the 120 s warning: 155 s.
    _finished_run(tmp_path, "AdamW_lr1e-3_seed0", 50.0, {10: 2.0, 20: 0.5, 30: 0.5, 40: 0.4})
    _finished_run(tmp_path, "AdamW_lr1e-3_seed1", 20.0, {10: 0.5, 20: 0.5})  # a faster run: the slowest decides
    _finished_run(tmp_path, "AdamW_lr1e-1_seed0", 900.0, {10: 9.0, 20: 9.0}, outcome="diverged")  # not measured
    check_time_limit(settings("2:35"), tmp_path)
    with pytest.raises(UserError) as refused:
        check_time_limit(settings("2:34"), tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert "run AdamW_lr1e-3_seed0 took 30 s to start and 0.5 s a step (10 steps a log line)" in message
    assert message.endswith("raise --slurm-time to at least 0:02:35"), message
    check_time_limit(SlurmSettings(None, None, None, 0, 1, None, 120, False), tmp_path)  # no limit given


def test_a_job_killed_at_its_time_limit_names_the_options_to_raise(tmp_path):
    # The run's step and save did not fit in the warning: Slurm killed the job (TIMEOUT) before any status.
    run_dir = tmp_path / "runs" / "AdamW_lr1e-3_seed0"
    run_dir.mkdir(parents=True)
    (run_dir / JOB_FILE).write_text(json.dumps({"job_id": "7_0", "array": "7", "submitted": 0.0, "fields": {}}))
    state, detail = run_state(run_dir, {"7_0": ("TIMEOUT", "")})
    assert state == "failed"
    assert detail.startswith("job 7_0 reached its time limit before the run could save and stop; raise --slurm-time")
    assert "--slurm-signal-seconds" in detail
    state, detail = run_state(run_dir, {"7_0": ("CANCELLED", "")})
    assert (state, detail) == ("failed", "job 7_0 cancelled without a status; the next call submits it again")


def test_slurm_options_without_slurm_are_a_mistake(tmp_path, capsys):
    argv = ["--dump-folder", str(tmp_path), "--launcher", FAKE, "--slurm-partition", "debug"]
    assert main(argv) == 2
    assert "--scheduler slurm" in one_error_line(capsys)


def test_a_run_warned_ahead_of_its_time_limit_is_requeued_and_resumes_bit_for_bit(dump, tmp_path, capsys):
    steps = 8
    train_args = [
        "--training.steps",
        str(steps),
        "--training.param_dtype",
        "float64",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "100",
    ]
    # train.py, held after step 2 until the signal reaches it: the signal lands at that step on any machine.
    held = f"{sys.executable} {ROOT / 'tests' / 'hold_until_stopped.py'} {tmp_path / 'held'}"
    args = ["--optimizers", "AdamW", "--lrs", "1e-3", "--nproc", "1"]
    assert sweep(dump, *args, train_args=train_args, launcher=held) == 0
    run_dir = next((dump / "runs").iterdir())
    job = json.loads((run_dir / JOB_FILE).read_text())["job_id"]
    log = run_dir / "train.log"
    wait_until(lambda: log.exists() and "HELD" in log.read_text(), "the run held after step 2", timeout=120)
    # What Slurm does --signal seconds before the time limit: USR1 to the job script.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_until(lambda: "preempted" in (run_dir / EVENTS_FILE).read_text(), "the run stopping", timeout=120)
    # The job script requeues the task right after it records the preemption; a requeued job waits for its old
    # credential to expire before it starts again (10 s on the test cluster, 120 s by default).
    wait_until(lambda: _state(job) == "PENDING", "the job requeued", timeout=60)
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "2"]) == 0
    assert "slurm: 1 preempted" in capsys.readouterr().out
    wait_until(lambda: statuses(dump).get(run_dir.name) is not None, "the run ending after its requeue")

    events = [json.loads(line)["event"] for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    assert events == ["started", "preempted", "started", "ended"], events
    text = log.read_text()
    assert "preempted: stopped on SIGTERM after step 2, checkpoint of step 2 saved" in text, text
    assert "resumed from step 2" in text and text.count("HELD") == 1
    assert statuses(dump)[run_dir.name] == "finished", (run_dir / "sweep_status.json").read_text()

    reference = tmp_path / "straight"
    options = ["--optimizer.name", "AdamW", "--optimizer.lr", "0.001", "--training.seed", "0"]
    train(reference, *TINY, *train_args, *options, cpu=True, base=DEBUG_RUN[:2])
    expected = by_step(metric_rows(next((reference / "tb").iterdir())))
    got: dict[int, float] = {}
    for folder in sorted((run_dir / "tb").iterdir()):
        got.update(by_step(metric_rows(folder)))
    assert sorted(expected) == list(range(1, steps + 1)) and got == expected
    final = read_checkpoint(run_dir / "checkpoint" / "AdamW" / f"step-{steps}")
    straight = read_checkpoint(reference / "checkpoint" / "AdamW" / f"step-{steps}")
    assert final.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.equal(final[name], tensor), name


def test_a_run_that_ends_as_the_warning_comes_has_ended_and_is_not_requeued(dump, capsys):
    # The run's launcher warns its own job as Slurm would, waits for the SIGTERM the job script passes on, then
    # trains to the end and exits 0: finished, never started again.
    script = (
        'got=""; trap got=1 TERM; scancel --signal=USR1 --batch "$SLURM_JOB_ID"; '
        'for _ in $(seq 600); do [ -n "$got" ] && break; sleep 0.1; done; '
        '[ -n "$got" ] || { echo "no SIGTERM came" >&2; exit 1; }; exec ' + FAKE + ' "$@"'
    )
    launcher = f"bash -c {shlex.quote(script)} warned"
    assert sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--nproc", "1", launcher=launcher) == 0
    run_dir = next((dump / "runs").iterdir())
    wait_until(lambda: statuses(dump).get(run_dir.name) is not None, "the run ending")
    events = [json.loads(line)["event"] for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    assert events == ["started", "ended"], (events, (run_dir / "train.log").read_text())
    assert statuses(dump)[run_dir.name] == "finished"


def test_a_coordinate_descent_submits_each_round_when_the_one_before_ends(dump, capsys):
    descent = ["--optimizers", "AdamW", "--lrs", "3e-4,1e-3,3e-3,1e-2", "--search", "coordinate", "--nproc", "1"]
    descent += ["--start", "optimizer.lr=3e-3", "--parallel", "2"]
    assert sweep(dump, *descent, launcher=FAKE) == 0  # the start point only, then the sweep exits
    assert "submitted 1 run(s)" in capsys.readouterr().out and len(job_scripts(dump)) == 1

    assert sweep(dump, *descent, "--wait", launcher=FAKE) == 0  # every round, each when the one before ended
    out = capsys.readouterr().out
    assert "not submitted again" in out or "finished earlier" in out
    # The fake loss is lowest at 1e-3: start 3e-3, round 2 its neighbours 1e-3 and 1e-2, round 3 1e-3's other
    # neighbour 3e-4; then no step improves.
    assert len(job_scripts(dump)) == 3
    assert set(statuses(dump)) == {f"AdamW_lr{lr}_seed0" for lr in ("3e-4", "1e-3", "3e-3", "1e-2")}
    assert "converged" in (dump / "sweep.md").read_text()


def fake_slurm(folder: Path, sbatch_error: str) -> str:
    """A PATH whose sinfo shows one idle node and whose sbatch refuses with ``sbatch_error``."""
    folder.mkdir()
    scripts = {
        "sinfo": "echo 'debug*|1:00:00|1|2|(null)'",
        "squeue": "echo 4242",  # one job of the user's own queued: a submit limit is "not now"
        "scontrol": "echo 'MaxArraySize            = 1001'",
        "sacct": "echo 'Slurm accounting storage is disabled' >&2; exit 1",
        "sbatch": f"echo {json.dumps(sbatch_error)} >&2; exit 1",
    }
    for name, body in scripts.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def test_a_full_queue_submits_nothing_and_is_no_failure(tmp_path, monkeypatch, capsys):
    full = (
        "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's "
        "size and/or time limits)"
    )
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", full))
    dump = tmp_path / "study"
    assert sweep(dump, "--optimizers", "AdamW", "--lrs", "1e-3,3e-3", "--nproc", "1", launcher=FAKE) == 0
    out = capsys.readouterr().out
    assert "the queue takes no more jobs now (Batch job submission failed: Job violates" in out
    assert "nothing submitted, run the same command again later" in out
    assert not list((dump / "runs").glob(f"*/{JOB_FILE}"))  # nothing recorded as submitted: the next call submits


def test_runs_through_slurm_are_named_and_grouped_in_wandb_as_local_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", "sbatch: error: job submit limit"))
    dump = tmp_path / "study"
    args = ["--optimizers", "AdamW", "--lrs", "1e-3", "--nproc", "1"]
    assert sweep(dump, *args, train_args=["--metrics.enable_wandb", "true"], launcher=FAKE) == 0
    command = (dump / "runs" / "AdamW_lr1e-3_seed0" / "command.sh").read_text()
    assert "--metrics.wandb_run_name AdamW_lr1e-3_seed0 --metrics.wandb_group study" in command, command


def test_any_other_sbatch_refusal_is_one_line_naming_the_option(tmp_path, monkeypatch, capsys):
    refused = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
    monkeypatch.setenv("PATH", fake_slurm(tmp_path / "bin", refused))
    assert (
        sweep(tmp_path / "study", "--optimizers", "AdamW", "--lrs", "1e-3", "--slurm-account", "x", launcher=FAKE) == 2
    )
    line = one_error_line(capsys)
    assert "Slurm refused the job array: Batch job submission failed: Invalid account" in line
    assert line.endswith("check --slurm-account")


def test_a_preempted_run_resumes_and_a_cancelled_one_waits_for_the_next_call(dump, tmp_path, capsys, monkeypatch):
    # Three runs of a made-up trainer that saves every step; Slurm requeues one as a preemption does (scontrol
    # requeue), and a user cancels another (scancel): every run is accounted for, each step trained once.
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    monkeypatch.setenv("CHAOS_LEDGER", str(ledger))
    monkeypatch.setenv("CHAOS_STEP_SECONDS", "1")
    study = ["--optimizers", "AdamW", "--lrs", "1e-3", "--seeds", "0,1,2", "--nproc", "1", "--parallel", "2"]
    steps = ["--training.steps", "8"]
    assert sweep(dump, *study, train_args=steps, launcher=TRAINER) == 0
    runs = {seed: dump / "runs" / f"AdamW_lr1e-3_seed{seed}" for seed in range(3)}
    jobs = {seed: json.loads((run / JOB_FILE).read_text())["job_id"] for seed, run in runs.items()}
    wait_until(lambda: all((ledger / f"{runs[s].name}.jsonl").exists() for s in (0, 1)), "runs 0 and 1 training")
    subprocess.run(["scontrol", "requeue", jobs[0]], check=True)  # a preemption: Slurm requeues the job itself
    subprocess.run(["scancel", jobs[1]], check=True)  # a user's cancel
    wait_until(lambda: {statuses(dump).get(runs[s].name) for s in (0, 2)} == {"finished"}, "runs 0 and 2 ending")
    wait_until(lambda: _state(jobs[1]) in ("", "CANCELLED"), "the cancelled job ending")
    assert main(["--dump-folder", str(dump), "--report-only", "--last-k", "2"]) == 0
    out = capsys.readouterr().out
    assert f"AdamW_lr1e-3_seed1: failed (job {jobs[1]} cancelled without a status" in out, out
    cancelled = [e for e in map(json.loads, (runs[1] / EVENTS_FILE).read_text().splitlines())]
    assert [e["event"] for e in cancelled if e["job_id"] == jobs[1]] == ["started", "interrupted"]  # not requeued
    restarts = [e["start"] for e in map(json.loads, (runs[0] / EVENTS_FILE).read_text().splitlines())]
    assert restarts[-1] == 2  # the preempted run's second start, by Slurm's requeue

    assert sweep(dump, *study, train_args=steps, launcher=TRAINER) == 0  # the cancelled run goes again
    assert "submitted 1 run(s)" in capsys.readouterr().out
    wait_until(lambda: len(statuses(dump)) == 3 and set(statuses(dump).values()) == {"finished"}, "every run ending")
    problems = [p for run in runs.values() for p in ledger_problems(ledger / f"{run.name}.jsonl", 8)]
    assert not problems, problems
