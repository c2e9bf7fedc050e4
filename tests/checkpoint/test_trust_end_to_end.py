"""End to end through ``train.py`` (debug model, one process, two steps): what a user sees when a checkpoint is
damaged, when the disk fills up, and when a second run meets a live run's folder. One line each, no traceback, the
documented exit code; the run's own logic is proven in-process by test_integrity.py and test_save_failures.py
(there, too, an explicit ``checkpoint.load_step`` of a damaged step refused with a UserError: train.py's one line and
exit code for that error are the lock refusal's here).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.checkpoint.test_save_failures import can_mount, small_tmpfs
from tests.helpers import by_step, metric_rows, run_dirs, train
from torchtitan.checkpoint import folders
from torchtitan.checkpoint.integrity import read_record, verify_files
from torchtitan.errors import EXIT_RECORD, SAVE_FAILED_EXIT_CODE, USER_ERROR_EXIT_CODE

SAVING = ["--training.steps", "2", "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1"]


def _checkpoints(dump) -> str:
    return os.path.join(dump, "checkpoint", "AdamW")  # the debug config's optimizer's default folder


def _one_error_line(proc) -> str:
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def _losses(dump) -> dict[int, float]:
    return by_step(metric_rows(run_dirs(dump)[-1]))


def test_a_damaged_newest_checkpoint_is_passed_over_by_a_resume(tmp_path):
    dump = tmp_path / "run"
    train(dump, *SAVING)
    straight = _losses(dump)
    shard = os.path.join(_checkpoints(dump), "step-2", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(os.urandom(4096))

    resumed = train(dump, *SAVING)
    output = resumed.stdout + resumed.stderr
    assert "Traceback" not in output
    passed_over = [line for line in output.splitlines() if "step-2 is damaged and passed over" in line]
    assert len(passed_over) == 1 and "__0_0.distcp" in passed_over[0]
    assert "checkpoint: resumed from step 1" in output
    assert _losses(dump)[2] == straight[2]  # exactly the uninterrupted run's
    assert len(os.listdir(os.path.join(_checkpoints(dump), "damaged"))) == 1


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_stops_the_run_with_its_own_exit_code_and_record(tmp_path):
    """One debug-model checkpoint takes ~94 MiB: a 150 MiB disk holds step-1, not step-2."""
    dump = tmp_path / "run"
    with small_tmpfs(tmp_path / "disk", "150m") as disk:
        proc = train(dump, *SAVING, "--checkpoint.folder", str(disk), check=False)
        assert proc.returncode == SAVE_FAILED_EXIT_CODE, proc.stderr[-3000:]
        line = _one_error_line(proc)
        assert "checkpoint of step 2 could not be written" in line and "the disk is full" in line
        assert str(disk) in line and "step-1 is intact" in line
        record = json.loads((dump / EXIT_RECORD).read_text())
        assert record["exit_code"] == SAVE_FAILED_EXIT_CODE and record["message"] == line
        assert sorted(os.listdir(disk)) == ["step-1"]
        step_1 = str(disk / "step-1")
        files = read_record(step_1)
        assert verify_files(step_1, files, sorted(files)) is None  # complete, and every byte as written


def test_a_run_refused_by_the_lock_writes_nothing_into_the_live_runs_folder(tmp_path):
    dump = tmp_path / "run"
    checkpoints = _checkpoints(dump)
    os.makedirs(checkpoints)
    lock, holder = folders.try_lock_folder(checkpoints)  # this process stands for the live run
    assert lock is not None and holder is None
    try:
        before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        proc = train(dump, *SAVING, check=False)
        assert proc.returncode == USER_ERROR_EXIT_CODE
        assert "is in use by another run" in _one_error_line(proc)
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    finally:
        lock.release()
