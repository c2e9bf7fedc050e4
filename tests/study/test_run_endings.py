"""How a sweep learns how each run ended: from the run's own exit record (train.py's first rank writes it), not from
the launcher's code (torchrun reports any worker's failure as 1); runs train with the sweep's own interpreter; a run
that fails before its first step is named with the first error line of its log."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from tests.helpers import ROOT, attempts, fake_sweep, status_of
from torchtitan.errors import EXIT_RECORD, read_exit_record, write_exit_record
from torchtitan.study.scheduling import attempt_error_line
from torchtitan.tools.sweep import main


def test_a_two_process_run_that_diverges_is_diverged_and_the_study_goes_on_to_confirmation(tmp_path, capsys):
    # --nproc 2: the fake trainer exits as torchrun does, 1 for its divergence (exit 3 of a worker).
    dump = tmp_path / "sweep"
    study = ["--optimizers", "AdamW", "--lrs", "1e-4,1e-3,1e-2", "--nproc", "2", "--confirm-seeds", "1"]
    assert fake_sweep(dump, *study, outcomes={"AdamW_lr1e-2_seed0": "exit3"}) == 0
    out = capsys.readouterr().out
    diverged = status_of(dump / "runs" / "AdamW_lr1e-2_seed0")
    assert diverged["outcome"] == "diverged" and diverged["exit_code"] == 3 and diverged["launcher_exit_code"] == 1
    assert diverged["message"].startswith("error: the loss was non-finite at step 3")
    assert "AdamW_lr1e-2_seed0: diverged, exit 3" in out
    report = json.loads((dump / "sweep.json").read_text())
    assert report["best"]["AdamW"]["lr"] == 1e-3  # the rest ranked
    row = next(line for line in (dump / "sweep.md").read_text().splitlines() if "[AdamW_lr1e-2_seed0]" in line)
    assert "| diverged | error: the loss was non-finite at step 3; lower optimizer.lr |" in row  # why it ended
    assert status_of(dump / "runs" / "AdamW_lr1e-3_seed1")["outcome"] == "finished"  # confirmation trained
    # Diverged is done: a second call trains nothing again.
    assert fake_sweep(dump, *study) == 0
    assert attempts(dump / "runs" / "AdamW_lr1e-2_seed0") == 1


def test_a_two_process_mistake_stops_the_sweep_as_a_mistake(tmp_path, capsys):
    dump = tmp_path / "sweep"
    assert (
        fake_sweep(
            dump, "--optimizers", "AdamW", "--lrs", "1e-3", "--nproc", "2", outcomes={"AdamW_lr1e-3_seed0": "exit2"}
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    mistake = "error: training.steps is too large for this test; lower it"
    assert err == f"error: AdamW_lr1e-3_seed0 stopped on a mistake in its options: {mistake}"


def test_an_exit_record_of_an_earlier_attempt_is_not_this_attempts(tmp_path):
    write_exit_record(tmp_path, 3, "error: diverged")
    record = json.loads((tmp_path / EXIT_RECORD).read_text())
    assert read_exit_record(tmp_path)["exit_code"] == 3
    assert read_exit_record(tmp_path, since=record["time"] + 1) is None
    assert read_exit_record(tmp_path / "none") is None


def test_a_failed_runs_error_is_the_first_error_line_of_its_latest_attempt(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "\n$ run 1\nerror: an earlier attempt\n"
        "\n$ run 2\nTraceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'torch'\n"
        "error: the launcher's summary\n"
    )
    assert attempt_error_line(log) == "ModuleNotFoundError: No module named 'torch'"
    log.write_text("\n$ run 1\nsome output\nlast words\n")
    assert attempt_error_line(log) == "last words"


def _broken_python(folder: Path) -> Path:
    """A ``python`` that is not the sweep's: it fails as an interpreter without torch does."""
    folder.mkdir()
    python = folder / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return folder


def test_runs_train_with_the_sweeps_interpreter_whatever_path_holds(tmp_path, monkeypatch, capsys):
    # The real launcher, one process, one step: PATH's first python would fail; the sweep's own trains.
    monkeypatch.setenv("PATH", f"{_broken_python(tmp_path / 'bin')}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    dump = tmp_path / "sweep"
    tiny = [
        "--training.seq_len",
        "32",
        "--training.batch_size",
        "2",
        "--training.steps",
        "1",
        "--metrics.log_freq",
        "1",
    ]
    assert (
        main(
            [
                "--dump-folder",
                str(dump),
                "--optimizers",
                "AdamW",
                "--lrs",
                "1e-3",
                "--nproc",
                "1",
                "--last-k",
                "1",
                "--",
                *tiny,
            ]
        )
        == 0
    )
    run = dump / "runs" / "AdamW_lr1e-3_seed0"
    assert status_of(run)["outcome"] == "finished"
    assert status_of(run)["environment"]["PYTHON"] == sys.executable
    assert f"PYTHON={sys.executable}" in (run / "command.sh").read_text()


def test_a_run_that_fails_before_its_first_step_is_named_with_its_error(tmp_path, monkeypatch, capsys):
    # A launcher of its own that trusts PATH's python (as run_llama_train.sh did): the sweep says why it failed.
    monkeypatch.setenv("PATH", f"{_broken_python(tmp_path / 'bin')}:{os.environ['PATH']}")
    launcher = tmp_path / "launch.sh"
    launcher.write_text('#!/bin/sh\necho "starting"\nexec python train.py "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    dump = tmp_path / "sweep"
    code = main(
        [
            "--dump-folder",
            str(dump),
            "--optimizers",
            "AdamW",
            "--lrs",
            "1e-3",
            "--nproc",
            "1",
            "--launcher",
            str(launcher),
        ]
    )
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: 1 of 1 runs failed (see their train.log); first: AdamW_lr1e-3_seed0: ModuleNotFoundError: No module "
        "named 'torch'; run the same command again to retry"
    )
