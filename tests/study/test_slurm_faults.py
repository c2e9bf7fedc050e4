"""The Slurm scheduler against stand-ins for Slurm's commands (tests/slurm_stand_in.py) that time out, lose their
socket, refuse for good or for now, and hold few tasks per array: no run is ever submitted twice, every refusal says
what it means, requeues end, and the job script holds every value quoted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos_trainer import TRAINER
from tests.helpers import FAKE, ROOT, one_error_line
from torchtitan.errors import write_exit_record
from torchtitan.study import scheduling, slurm, slurm_job
from torchtitan.study.report import why_it_ended
from torchtitan.study.slurm import SlurmSettings, check_time_limit, run_state
from torchtitan.study.slurm_job import (
    EVENTS_FILE,
    JOB_FILE,
    SLURM_FOLDER,
    SUBMISSION_SUFFIX,
    newest_checkpoint,
    requeue_refusal,
    trained_seconds,
)
from torchtitan.tools.sweep import main


@pytest.fixture
def controller(tmp_path, monkeypatch):
    """A stand-in Slurm on PATH; ``controller(sbatch=..., ...)`` sets how it answers next; ``.jobs()`` what it
    queued; ``.sbatch_calls()`` every sbatch call."""
    folder = tmp_path / "slurm_stand_in"
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    stand_in = ROOT / "tests" / "slurm_stand_in.py"
    for name in ("sbatch", "squeue", "sacct", "scontrol", "sinfo", "srun", "scancel"):
        (bin_dir / name).write_text(f'#!/bin/sh\nSTAND_IN_COMMAND={name} exec {sys.executable} {stand_in} "$@"\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_SLURM", str(folder))
    monkeypatch.setattr(slurm, "SLURM_TIMEOUT_SECONDS", 3.0)

    class Controller:
        def __call__(self, **behaviour) -> None:
            (folder / "behaviour.json").write_text(json.dumps(behaviour))

        def jobs(self) -> list[dict]:
            state = folder / "state.json"
            return json.loads(state.read_text()).get("jobs", []) if state.exists() else []

        def calls(self, command: str) -> list[list[str]]:
            lines = (folder / "calls.jsonl").read_text().splitlines()
            return [call for call in map(json.loads, lines) if call[0] == command]

        def sbatch_calls(self) -> list[list[str]]:
            lines = (folder / "calls.jsonl").read_text().splitlines()
            return [call for call in map(json.loads, lines) if call[0] == "sbatch"]

    return Controller()


STUDY = ["--optimizers", "AdamW", "--lrs", "1e-3,3e-3", "--nproc", "1"]


def sweep(dump: Path, *args: str) -> int:
    return main(["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", FAKE, *STUDY, *args])


def job_ids(dump: Path) -> set[str]:
    return {json.loads(p.read_text())["job_id"] for p in (dump / "runs").glob(f"*/{JOB_FILE}")}


def test_an_sbatch_that_times_out_after_queuing_is_found_and_never_submitted_again(tmp_path, controller, capsys):
    controller(sbatch="timeout")
    dump = tmp_path / "study"
    assert sweep(dump) == 0
    assert "sbatch did not confirm the array (did not answer in 3 s), but Slurm queued it" in capsys.readouterr().out
    assert job_ids(dump) == {"100_0", "100_1"}
    controller(sbatch="ok")
    assert sweep(dump) == 0
    assert capsys.readouterr().out.count("is still there, not submitted again") == 2
    assert len(controller.jobs()) == 1 and len(controller.sbatch_calls()) == 1


def test_a_socket_error_with_a_slow_controller_is_looked_up_by_the_next_call(tmp_path, controller, capsys):
    # sbatch queues the array and loses its socket; the controller shows it to squeue only later.
    controller(sbatch="socket", hidden=True)
    dump = tmp_path / "study"
    assert sweep(dump) == 0
    out = capsys.readouterr().out
    assert "sbatch did not confirm the array (Batch job submission failed: Socket timed out on send/recv" in out
    assert "the next call looks for it by its name" in out and job_ids(dump) == set()
    (record,) = (dump / SLURM_FOLDER).glob(f"*{SUBMISSION_SUFFIX}")
    assert sweep(dump) == 0  # still hidden: its runs wait, nothing is submitted
    assert capsys.readouterr().out.count("not submitted again: sbatch did not confirm its array") == 2
    assert len(controller.jobs()) == 1
    controller(sbatch="ok")  # the controller now shows it
    assert sweep(dump) == 0
    out = capsys.readouterr().out
    assert "found job array 100" in out and out.count("is still there, not submitted again") == 2
    assert job_ids(dump) == {"100_0", "100_1"} and not record.exists()
    assert len(controller.jobs()) == 1 and len(controller.sbatch_calls()) == 1  # the one array, never again


def test_an_array_the_controller_never_queued_is_submitted_again_once_it_surely_is_not_there(
    tmp_path, controller, capsys, monkeypatch
):
    controller(sbatch="socket", queue=False)
    dump = tmp_path / "study"
    assert sweep(dump) == 0 and job_ids(dump) == set()
    controller(sbatch="ok")
    assert sweep(dump) == 0 and job_ids(dump) == set()  # too soon to tell: nothing submitted
    monkeypatch.setattr(slurm, "UNCONFIRMED_SECONDS", 0.0)
    assert sweep(dump) == 0
    assert "never queued" in capsys.readouterr().out
    assert len(controller.jobs()) == 1 and job_ids(dump) == {"100_0", "100_1"}


QOS = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: Job violates "
    "accounting/QOS policy (job submit limit, user's size and/or time limits)"
)


def test_a_submit_limit_below_the_studys_size_is_an_error_with_slurms_reason(tmp_path, controller, capsys):
    controller(sbatch="refuse", error=QOS, squeue_user_jobs=0)
    dump = tmp_path / "study"
    assert sweep(dump) == 1
    line = one_error_line(capsys)
    assert (
        "Slurm refused the job array of 2 run(s) with none of your jobs queued: Batch job submission failed: " in line
    )
    assert "Job violates accounting/QOS policy" in line and "ask for a higher limit" in line
    assert job_ids(dump) == set() and not list((dump / SLURM_FOLDER).glob(f"*{SUBMISSION_SUFFIX}"))


@pytest.mark.parametrize(
    "error, user_jobs",
    [(QOS, 5), ("sbatch: error: Batch job submission failed: Resource temporarily unavailable", 0)],
)
def test_a_refusal_for_now_is_a_hint_and_exit_0(tmp_path, controller, capsys, error, user_jobs):
    controller(sbatch="refuse", error=error, squeue_user_jobs=user_jobs)
    dump = tmp_path / "study"
    assert sweep(dump) == 0
    out = capsys.readouterr().out
    assert "the queue takes no more jobs now" in out and "run the same command again later" in out
    assert job_ids(dump) == set()
    controller(sbatch="ok")
    assert sweep(dump) == 0 and job_ids(dump) == {"100_0", "100_1"}


def test_arrays_split_at_the_clusters_max_array_size_one_after_another(tmp_path, controller, capsys):
    controller(sbatch="ok", max_array_size=2)
    dump = tmp_path / "study"
    assert main(["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", FAKE, "--nproc", "1",
                 "--optimizers", "AdamW", "--lrs", "1e-4,3e-4,1e-3,3e-3,1e-2", "--parallel", "2"]) == 0  # fmt: skip
    jobs = controller.jobs()
    assert [j["tasks"] for j in jobs] == [2, 2, 1]
    assert [j["dependency"] for j in jobs] == [None, "afterany:100", "afterany:101"]  # --parallel over the study
    assert len(job_ids(dump)) == 5 and {j.split("_")[0] for j in job_ids(dump)} == {"100", "101", "102"}


def test_the_job_script_quotes_every_value_and_derives_the_rendezvous_port(tmp_path, controller):
    controller(sbatch="ok")
    dump = tmp_path / "my study, 50%"  # squeue -n splits a name at its commas; sbatch expands a % in --output
    assert sweep(dump, "--slurm-partition", "gpu", "--slurm-account", "a b") == 0
    (script,) = (dump / SLURM_FOLDER).glob("array-*.sh")
    text = script.read_text()
    (name,) = re.findall(r"^#SBATCH --job-name=(.*)$", text, re.MULTILINE)
    assert re.fullmatch(r"study-[0-9a-f]{8}-[0-9]{8}-[0-9]{6}-[0-9]+-[0-9a-f]{6}", name), name
    assert f"#SBATCH --output='{dump}%/slurm'/%A_%a.out" in text  # the folder's % doubled, Slurm's own kept
    assert "#SBATCH --account='a b'" in text and "#SBATCH --partition=gpu" in text
    assert ":$((20000 + SLURM_JOB_ID % 10000))" in text and ":29500" not in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_a_dump_folder_with_a_backslash_is_refused_up_front(tmp_path, controller, capsys):
    # In sbatch --output a backslash turns off %A and %a: every task would write one file, named literally.
    assert sweep(tmp_path / "a\\b") == 2
    line = one_error_line(capsys)
    assert line.startswith("error: --dump-folder ") and "holds a backslash" in line, line
    assert controller.jobs() == []


@pytest.mark.parametrize("option", ["--slurm-partition", "--slurm-account", "--slurm-time"])
def test_a_line_break_in_a_job_script_value_is_refused(tmp_path, controller, capsys, option):
    assert sweep(tmp_path / "study", option, "gpu\n#SBATCH --qos=high") == 2
    assert f"error: {option} 'gpu\\n#SBATCH --qos=high' holds a line break; give it on one line" == one_error_line(
        capsys
    )
    assert controller.jobs() == []


# ----------------------------------------------------------------------------------------------------------------
# Requeues end


def _events(run_dir: Path, *events: dict) -> None:
    with open(run_dir / EVENTS_FILE, "a") as f:
        for event in events:
            f.write(json.dumps({"job_id": "7_0", **event}) + "\n")


def _checkpoint(run_dir: Path, step: int) -> None:
    folder = run_dir / "checkpoint" / "AdamW" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_text("")


def test_a_run_is_requeued_only_with_a_newer_checkpoint_at_most_max_times_never_after_exit_2_or_3(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    run = tmp_path / "run"
    run.mkdir()
    now = time.time()
    _events(run, {"event": "started", "time": now - 10, "checkpoint": None})
    assert "without a checkpoint newer: not requeued" in requeue_refusal(run, 1, 3)  # nothing saved at all
    _checkpoint(run, 40)
    assert requeue_refusal(run, 4, 3) is None  # saved step 40: requeue
    _events(run, {"event": "preempted", "time": now - 9}, {"event": "started", "time": now - 5, "checkpoint": 40})
    refusal = requeue_refusal(run, 1, 3)  # killed before it could save anything newer than step 40
    assert "without a checkpoint newer than step 40, the one it started from: not requeued" in refusal
    _checkpoint(run, 80)
    assert requeue_refusal(run, 1, 3) is None
    assert "the most --slurm-max-requeues 1 allows" in requeue_refusal(run, 1, 1)  # one requeue done already
    for own in (2, 3):  # stopped on its own as the signal came: torchrun says 1, the run's record says why
        write_exit_record(run, own, "error: ...")
        assert requeue_refusal(run, 1, 3) == ""


def test_a_stop_that_is_not_requeued_ends_the_run_with_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    run = tmp_path / "run"
    run.mkdir()
    job = {"job_id": "7_0", "array": "7", "submitted": time.time() - 100, "fields": {"optimizer": "AdamW"}}
    (run / JOB_FILE).write_text(json.dumps(job))
    assert slurm_job.main(["started", str(run)]) == 0
    assert slurm_job.main(["stopped", str(run), "1", "3"]) == 1  # no checkpoint: ended, not requeued
    status = json.loads((run / "sweep_status.json").read_text())
    assert status["outcome"] == "failed" and "not requeued, a new start would train the same steps" in status["message"]
    assert run_state(run, {})[1] == status["message"]


def test_a_runs_seconds_count_its_starts_not_its_time_queued():
    events = [
        {"event": "started", "time": 100.0},
        {"event": "preempted", "time": 160.0},
        {"event": "started", "time": 1000.0},  # queued 840 s in between
        {"event": "ended", "time": 1030.0},
    ]
    assert trained_seconds(events, now=5000.0) == 90.0


def test_a_time_limit_shorter_than_a_whole_run_without_checkpoints_is_refused(tmp_path):
    run = tmp_path / "runs" / "AdamW_lr1e-3_seed0"
    metrics = run / "tb" / "20260101-000000_AdamW"
    metrics.mkdir(parents=True)
    rows = [{"step": s, "loss_metrics/global_avg_loss": 3.0, "time/forward_backward(s)": 1.0} for s in range(1, 101)]
    (metrics / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = {"outcome": "finished", "seconds": 130.0, "ended": 1.0, "requeues": 1}  # 30 s of starting, 2 starts
    (run / "sweep_status.json").write_text(json.dumps(status))
    settings = SlurmSettings(None, None, "2:50", 0, 1, None, 60, False)
    check_time_limit(settings, tmp_path, checkpointing=True)  # it resumes: a limit above one logging interval does
    with pytest.raises(Exception, match="checkpointing is off") as refused:
        check_time_limit(settings, tmp_path, checkpointing=False)
    assert "15 s to start, 100 steps of 1 s" in str(refused.value) and "at least 0:02:55" in str(refused.value)


@pytest.mark.parametrize(
    "state, shown, advice",
    [
        ("REQUEUE_HOLD", "held", "scontrol release 7_0"),
        ("SUSPENDED", "suspended", "scontrol resume 7_0"),
        ("STOPPED", "stopped", "scancel --signal=CONT 7_0"),
    ],
)
def test_jobs_waiting_on_someone_are_shown_as_such_with_what_to_do(tmp_path, state, shown, advice):
    (tmp_path / JOB_FILE).write_text(json.dumps({"job_id": "7_0", "array": "7", "submitted": 0.0, "fields": {}}))
    got, detail = run_state(tmp_path, {"7_0": (state, "None")})
    assert got == shown and advice in detail


def test_the_page_says_why_each_run_ended():
    assert why_it_ended({"outcome": "finished", "requeues": 2}) == "finished its steps, requeued 2 time(s)"
    assert why_it_ended({"outcome": "finished"}) == "finished its steps"
    stopped = {"outcome": "failed", "message": "stopped on a signal without a checkpoint newer: ...", "requeues": 1}
    assert why_it_ended(stopped) == "stopped on a signal without a checkpoint newer: ...; requeued 1 time(s)"
    assert why_it_ended({"outcome": "failed", "message": None, "exit_code": 1}) == "exit 1"


def test_the_job_script_requeues_a_stopped_run_only_when_it_saved_a_newer_checkpoint(tmp_path, controller):
    # The job script itself, run here: srun runs the run's command.sh (the fake trainer), which stops as train.py
    # does on a signal (exit 4); Slurm's own commands are the stand-ins.
    controller(sbatch="ok")
    dump = tmp_path / "study"
    assert main(["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", FAKE, "--optimizers", "AdamW",
                 "--lrs", "1e-3", "--nproc", "1"]) == 0  # fmt: skip
    (script,) = (dump / SLURM_FOLDER).glob("array-*.sh")
    run = dump / "runs" / "AdamW_lr1e-3_seed0"
    name = json.loads((run / JOB_FILE).read_text())["name"]
    environment = {**os.environ, "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "101"}
    environment.update(SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_JOB_NAME=name, PYTHONPATH=str(ROOT))
    environment["FAKE_OUTCOMES"] = json.dumps({"AdamW_lr1e-3_seed0": "stop"})

    def job(**more) -> None:
        done = subprocess.run(["bash", str(script)], env={**environment, **more}, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-2000:]

    job()  # stopped without any checkpoint: not requeued, ended with why
    assert controller.calls("scontrol") and not [c for c in controller.calls("scontrol") if c[1] == "requeue"]
    status = json.loads((run / "sweep_status.json").read_text())
    assert status["outcome"] == "failed" and "without a checkpoint newer: not requeued" in status["message"]

    (run / "sweep_status.json").unlink()
    job(FAKE_CHECKPOINT="1")  # saved step 2, newer than none: requeued
    assert [c for c in controller.calls("scontrol") if c[1] == "requeue"] == [["scontrol", "requeue", "100_0"]]
    assert not (run / "sweep_status.json").exists()
    events = [json.loads(line) for line in (run / EVENTS_FILE).read_text().splitlines()]
    assert [e["event"] for e in events] == ["started", "ended", "started", "preempted"]
    assert events[-2]["checkpoint"] is None and {e["job_name"] for e in events} == {name}

    job(FAKE_CHECKPOINT="1", SLURM_RESTART_COUNT="1")  # started from step 2 and saved step 2 again: not requeued
    assert len([c for c in controller.calls("scontrol") if c[1] == "requeue"]) == 1
    status = json.loads((run / "sweep_status.json").read_text())
    assert "without a checkpoint newer than step 2, the one it started from" in status["message"]
    assert status["requeues"] == 2  # every start of its job after the first: this one's job started 3 times


def test_the_newest_checkpoint_is_read_as_the_checkpoint_manager_reads_them(tmp_path):
    from torchtitan.checkpoint.folders import SUPERSEDED_FOLDER, complete_steps

    folder = tmp_path / "checkpoint" / "AdamW"
    for name, complete in (("step-4", True), ("step-12", True), ("step-20", False), (".step-30.tmp-ab", True)):
        (folder / name).mkdir(parents=True)
        if complete:
            (folder / name / ".metadata").write_text("")
    (folder / SUPERSEDED_FOLDER / "step-40").mkdir(parents=True)
    (folder / SUPERSEDED_FOLDER / "step-40" / ".metadata").write_text("")
    assert complete_steps(str(folder)) == [4, 12]
    assert newest_checkpoint(tmp_path) == 12
    assert newest_checkpoint(tmp_path / "none") is None


# ----------------------------------------------------------------------------------------------------------------
# A flaky cluster: what it did to a study, each once


def _task_environment(dump: Path, run: Path, array: str = "100", **more) -> dict:
    """What Slurm gives task 0 of array ``array`` whose job name the run's submission recorded."""
    name = json.loads((run / JOB_FILE).read_text())["name"] if (run / JOB_FILE).exists() else more.pop("name")
    environment = {**os.environ, "SLURM_ARRAY_JOB_ID": array, "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": array}
    environment.update(SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_JOB_NAME=name, PYTHONPATH=str(ROOT))
    return {**environment, **more}


def _one_run_study(dump: Path, launcher: str = FAKE) -> int:
    return main(["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", launcher, "--optimizers",
                 "AdamW", "--lrs", "1e-3", "--nproc", "1"])  # fmt: skip


def _one_run(dump: Path, launcher: str = FAKE) -> tuple[Path, Path]:
    """A one-run study submitted to the stand-in: its job script and its run folder."""
    assert _one_run_study(dump, launcher) == 0
    (script,) = (dump / SLURM_FOLDER).glob("array-*.sh")
    return script, dump / "runs" / "AdamW_lr1e-3_seed0"


def _events_of(run: Path) -> list[str]:
    return [json.loads(line)["event"] for line in (run / EVENTS_FILE).read_text().splitlines()]


def test_the_job_script_records_its_run_with_a_module_that_imports_none_of_the_sweeps_submitting(tmp_path, controller):
    # Each start and end of each task is a fresh interpreter (hundreds in a study's life): it imports only what the
    # record needs, not the sweep's argument parsing, job names' hashing or submitting, and never torch.
    script, _ = _one_run(tmp_path / "study")
    (module,) = set(re.findall(r" -m (torchtitan[\w.]*)", script.read_text()))
    command = [sys.executable, "-c", f"import sys, {module}; print(' '.join(sys.modules))"]
    loaded = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert not {"argparse", "hashlib", "secrets", "torch", "numpy"} & set(loaded.stdout.split())


def test_a_task_whose_submission_was_never_confirmed_adopts_it_and_records_its_end(tmp_path, controller, capsys):
    # sbatch queued the array and lost its answer; the lookup by name missed: no run knows its job when it ends.
    controller(sbatch="socket", hidden=True)
    script, run = _one_run(tmp_path / "study")
    assert not (run / JOB_FILE).exists()
    (record,) = (tmp_path / "study" / SLURM_FOLDER).glob(f"*{SUBMISSION_SUFFIX}")
    name = json.loads(record.read_text())["name"]
    done = subprocess.run(["bash", str(script)], env=_task_environment(tmp_path, run, name=name), timeout=120)
    assert done.returncode == 0
    assert json.loads((run / JOB_FILE).read_text())["job_id"] == "100_0" and not record.exists()
    status = json.loads((run / "sweep_status.json").read_text())
    assert status["outcome"] == "finished" and status["optimizer"] == "AdamW"
    controller(sbatch="ok")  # the controller lists it now: nothing is submitted again
    assert _one_run_study(tmp_path / "study") == 0 and len(controller.jobs()) == 1
    assert "AdamW_lr1e-3_seed0: finished earlier, skipped" in capsys.readouterr().out


def test_the_trap_passes_the_warning_on_without_waiting_for_scancel(tmp_path, controller):
    # Slurm 22.05 keeps answering "Job can not be altered now"; here scancel does not answer at all.
    controller(sbatch="ok")
    script, run = _one_run(tmp_path / "study")
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    (stuck / "scancel").write_text("#!/bin/sh\nsleep 60\n")
    (stuck / "scancel").chmod(0o755)
    environment = _task_environment(tmp_path, run, FAKE_SECONDS="3")
    environment["PATH"] = f"{stuck}:{environment['PATH']}"
    with open(tmp_path / "job.out", "w") as out:
        job = subprocess.Popen(["bash", str(script)], env=environment, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "started" not in ((run / EVENTS_FILE).read_text() if (run / EVENTS_FILE).exists() else ""):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
        time.sleep(0.5)
        job.send_signal(signal.SIGUSR1)  # --signal=B:USR1: to the batch shell
        began = time.monotonic()
        job.wait(timeout=45)
        assert time.monotonic() - began < 30  # the run's own 3 s, not scancel's 60
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # whatever of the job is left
        except ProcessLookupError:
            pass
        job.wait()
    assert _events_of(run) == ["started", "ended"]
    assert json.loads((run / "sweep_status.json").read_text())["outcome"] == "finished"


def test_a_users_cancel_is_not_undone_by_a_requeue(tmp_path, controller, monkeypatch):
    controller(sbatch="ok")
    script, run = _one_run(tmp_path / "study", launcher=TRAINER)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    environment = _task_environment(tmp_path, run, CHAOS_LEDGER=str(ledger), CHAOS_STEP_SECONDS="1")
    job = subprocess.Popen(["bash", str(script)], env=environment, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (ledger / f"{run.name}.jsonl").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGTERM)  # scancel: SIGTERM to every process of the job
        assert job.wait(timeout=60) == 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert "stopped" in (ledger / f"{run.name}.jsonl").read_text()  # the run saved its step
    assert not [c for c in controller.calls("scontrol") if c[1] == "requeue"]  # and was not requeued
    assert _events_of(run) == ["started", "interrupted"] and not (run / "sweep_status.json").exists()


def test_one_trainer_per_run_folder(tmp_path, controller):
    controller(sbatch="ok")
    script, run = _one_run(tmp_path / "study")
    lock = scheduling.lock_trainer(run)  # another trainer (a local sweep) holds the run
    try:
        done = subprocess.run(["bash", str(script)], env=_task_environment(tmp_path, run), timeout=120)
        assert done.returncode == 0 and _events_of(run) == ["busy"] and not (run / "train.log").exists()
        # ... and a local sweep does not train a run a job holds
        assert main(["--dump-folder", str(tmp_path / "study"), "--launcher", FAKE, "--optimizers", "AdamW",
                     "--lrs", "1e-3", "--nproc", "1"]) == 0  # fmt: skip
        assert not (run / "sweep_status.json").exists() and not (run / "train.log").exists()
    finally:
        os.close(lock)
    # A run that has ended: its job exits at once, without training it again.
    status = {"outcome": "finished", "ended": time.time(), "optimizer": "AdamW", "lr": 1e-3, "seed": 0}
    (run / "sweep_status.json").write_text(json.dumps(status))
    done = subprocess.run(["bash", str(script)], env=_task_environment(tmp_path, run), timeout=120)
    assert done.returncode == 0 and _events_of(run) == ["busy", "skipped"] and not (run / "train.log").exists()


def test_wait_asks_squeue_again_when_it_fails_and_backs_off(tmp_path, controller, monkeypatch, capsys):
    controller(sbatch="ok", squeue_failures=6)  # more than one query's tries
    monkeypatch.setattr(slurm, "QUERY_RETRY_SECONDS", 0.01)
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 12:  # the runs end meanwhile, without a status: the sweep records them failed
            state = json.loads((tmp_path / "slurm_stand_in" / "state.json").read_text())
            state["states"] = {"100_0": "COMPLETED", "100_1": "COMPLETED"}
            (tmp_path / "slurm_stand_in" / "state.json").write_text(json.dumps(state))

    class Clock:  # the time module, as the scheduler sees it, with a sleep that records and returns at once
        def __getattr__(self, name):
            return getattr(time, name)

    clock = Clock()
    clock.sleep = sleep
    monkeypatch.setattr(slurm, "time", clock)
    assert sweep(tmp_path / "study", "--wait") == 1
    out = capsys.readouterr().out
    assert "Slurm did not answer (squeue: slurm_load_jobs error: Socket timed out" in out and "asking again" in out
    assert (
        "AdamW_lr1e-3_seed0: failed (Slurm job 100_0)" in out and "AdamW_lr3e-3_seed0: failed (Slurm job 100_1)" in out
    )
    polls = [s for s in slept if s >= slurm.POLL_SECONDS]
    assert polls[:6] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and max(slept) == slurm.POLL_MAX_SECONDS


def test_a_runaway_job_is_reported_then_taken_for_lost(tmp_path, monkeypatch):
    # squeue no longer knows job 7_0; accounting keeps it RUNNING.
    def answer(command, timeout=None):
        out = "7_0|RUNNING\n" if command[0] == "sacct" else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    monkeypatch.setattr(slurm, "_slurm", answer)
    states = slurm.job_states(["7_0"])
    assert states == {"7_0": (slurm.RUNAWAY, "accounting: RUNNING")}
    job = {"job_id": "7_0", "array": "7", "submitted": time.time() - 1000, "fields": {}}
    (tmp_path / JOB_FILE).write_text(json.dumps(job))
    _events(tmp_path, {"event": "started", "time": time.time() - 10})
    state, detail = run_state(tmp_path, states)
    assert state == "runaway" and "sacctmgr show runawayjobs" in detail
    monkeypatch.setattr(slurm, "RUNAWAY_SECONDS", 5.0)  # its last sign of life is 10 s old
    state, detail = run_state(tmp_path, states)
    assert state == "failed" and "was lost (a runaway" in detail and "the next call submits it again" in detail


def test_a_torn_line_in_the_events_is_skipped_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    job = {"job_id": "7_0", "array": "7", "submitted": time.time() - 100, "fields": {"optimizer": "AdamW"}}
    (tmp_path / JOB_FILE).write_text(json.dumps(job))
    _events(tmp_path, {"event": "started", "time": time.time() - 50})
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"event": "preem\n')  # a job killed as it wrote
    assert slurm_job.main(["started", str(tmp_path)]) == 0
    assert [e["event"] for e in slurm_job.read_events(tmp_path)] == ["started", "started"]
    assert f"{tmp_path / EVENTS_FILE}: line 2 is not a whole JSON object (torn); left out" in capsys.readouterr().err


def test_an_array_of_a_later_call_waits_for_the_studys_arrays_still_alive(tmp_path, controller):
    controller(sbatch="ok", max_array_size=2)
    dump = tmp_path / "study"
    assert sweep(dump) == 0  # two runs: array 100, alive (pending)
    assert main(["--dump-folder", str(dump), "--scheduler", "slurm", "--launcher", FAKE, "--nproc", "1",
                 "--optimizers", "AdamW", "--lrs", "1e-3,3e-3,1e-2,3e-2,1e-1", "--parallel", "2"]) == 0  # fmt: skip
    assert [j["dependency"] for j in controller.jobs()] == [None, "afterany:100", "afterany:101"]


def test_every_start_past_the_requeues_allowed_ends_the_run_slurms_own_requeues_included(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    job = {"job_id": "7_0", "array": "7", "submitted": time.time() - 100, "fields": {"optimizer": "AdamW"}}
    (tmp_path / JOB_FILE).write_text(json.dumps(job))
    # Two starts, each ended by Slurm itself (a node lost, a preemption): no "preempted" event of the job script.
    _events(tmp_path, {"event": "started", "time": time.time() - 50}, {"event": "started", "time": time.time() - 20})
    assert slurm_job.main(["started", str(tmp_path), "", "2"]) == 0  # its third start: two requeues, two allowed
    assert slurm_job.main(["started", str(tmp_path), "", "2"]) == 1  # a fourth: not trained
    status = json.loads((tmp_path / "sweep_status.json").read_text())
    assert status["outcome"] == "failed" and "after 3 requeue(s), Slurm's own included" in status["message"]


def test_a_run_that_ended_in_a_start_its_job_could_not_record_is_recorded_at_the_next_start(tmp_path, monkeypatch):
    # The run finished its last step; its job was preempted before it wrote the status, and Slurm requeued it.
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    job = {"job_id": "7_0", "array": "7", "submitted": time.time() - 100, "fields": {"optimizer": "AdamW"}}
    (tmp_path / JOB_FILE).write_text(json.dumps(job))
    _events(tmp_path, {"event": "started", "time": time.time() - 50})
    (tmp_path / "tb" / "1").mkdir(parents=True)
    (tmp_path / "tb" / "1" / "metrics.jsonl").write_text('{"step": 1, "loss_metrics/global_avg_loss": 2.5}\n')
    write_exit_record(tmp_path, 0, "")
    assert slurm_job.main(["started", str(tmp_path)]) == 1  # not trained again
    assert json.loads((tmp_path / "sweep_status.json").read_text())["outcome"] == "finished"
    assert [e["event"] for e in slurm_job.read_events(tmp_path)] == ["started", "ended"]


def _record(run, *event) -> subprocess.CompletedProcess:
    """A record of ``event`` for ``run``, started as the job script starts it (python -S -m ...slurm_job)."""
    return subprocess.run(
        [sys.executable, "-S", "-m", "torchtitan.study.slurm_job", event[0], str(run), *event[1:]],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )


def test_the_job_scripts_record_imports_only_light_leaves(tmp_path):
    """A job script starts the record twice per start of every task: it imports neither pathlib, typing, dataclasses
    nor subprocess (the sweep's modules), whichever event it records, a run's end (its status) included."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss_metrics/global_avg_loss": 2.5}\n')
    heavy = ("pathlib", "typing", "dataclasses", "subprocess", "torchtitan.study.plan", "torchtitan.study.run_folders")
    probe = (
        "import sys; from torchtitan.study import slurm_job; code = slurm_job.main(sys.argv[1:]); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules)); sys.exit(code)"
    )
    for event in (["started", str(run), "", "3"], ["ended", str(run), "0"]):
        result = subprocess.run(
            [sys.executable, "-S", "-c", probe, *event],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout.strip() == "[]", (event[0], result.stdout, result.stderr)
    assert json.loads((run / "sweep_status.json").read_text())["outcome"] == "finished"


def test_a_record_without_site_packages_reads_a_runs_event_files(tmp_path):
    """A run that logged only TensorBoard event files (no metrics.jsonl) is read by a record started as the job
    script starts it (python -S): site-packages, TensorBoard's, are added for that read only."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    run = tmp_path / "runs" / "r"
    writer = EventFileWriter(str(run / "tb" / "1"))
    for step in (1, 2):
        value = Summary.Value(tag="loss_metrics/global_avg_loss", simple_value=3.0 / step)
        writer.add_event(Event(step=step, wall_time=time.time(), summary=Summary(value=[value])))
    writer.close()
    result = _record(run, "ended", "0")
    assert result.returncode == 0, result.stderr
    assert json.loads((run / "sweep_status.json").read_text())["outcome"] == "finished"


def test_the_made_up_trainers_exit_record_reads_as_train_pys(tmp_path):
    """The chaos test's trainer writes its exit record as text, not through torchtitan.errors: the project reads it
    as its own, code, message and time."""
    from tests import chaos_trainer
    from torchtitan import errors

    assert (chaos_trainer.EXIT_RECORD, chaos_trainer.PREEMPTED_EXIT_CODE) == (
        errors.EXIT_RECORD,
        errors.PREEMPTED_EXIT_CODE,
    )
    began = time.time()
    chaos_trainer.write_exit_record(str(tmp_path), 4, "preempted: stopped on SIGTERM after step 2")
    record = errors.read_exit_record(tmp_path, since=began)
    assert record["exit_code"] == 4 and record["message"] == "preempted: stopped on SIGTERM after step 2"
    assert record["pid"] == os.getpid()
