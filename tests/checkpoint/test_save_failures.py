"""A save the system refuses (disk full, permission denied, quota) stops the run with one line naming the cause and
the folder (``SaveFailed``, exit code 5); the previous checkpoint stays complete and visible, the partial save is
removed, and an async save's failure surfaces at the next step or at the end.

Disk full is tested on a real small tmpfs where the test runs as root (CI does), and by an injected ENOSPC everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from tests.helpers import Trainer
from tests.helpers import checkpoint_job as job
from torchtitan.errors import SaveFailed

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (root only), unmounted after."""
    os.makedirs(path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/proc/filesystems") and "tmpfs" in open("/proc/filesystems").read()


def _assert_step_1_intact(dump):
    folder = dump / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-1"]  # the partial save removed, the previous one kept
    resumed = Trainer(job(str(dump), steps=2, interval=1))
    assert resumed.checkpoint.load() and resumed.train_state.step == 1  # and it verifies
    resumed.checkpoint.close()


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tmp_path):
    """One checkpoint of the tiny model takes ~1.2 MB: a 2 MiB tmpfs holds step-1, and step-2 cannot be written."""
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        trainer = Trainer(job(str(disk), steps=2, interval=1))
        trainer.run(1)
        with pytest.raises(SaveFailed) as failed:
            trainer.run(2)
        message = str(failed.value)
        assert "\n" not in message and "the disk is full" in message, message
        assert f"'{disk / 'checkpoint'}'" in message and "step-1 is intact" in message
        _assert_step_1_intact(disk)


@pytest.mark.parametrize(
    "code, words",
    [(errno.ENOSPC, "the disk is full"), (errno.EACCES, "permission denied"), (errno.EDQUOT, "disk quota")],
)
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_refused_write_is_named_in_one_line(tmp_path, monkeypatch, mode, code, words):
    trainer = Trainer(job(str(tmp_path), steps=3, interval=1, async_mode=mode))
    trainer.run(1)
    assert trainer.checkpoint.last_finite_step() == 1  # published (an async save waited for)

    def refuse(self, path, mode):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", refuse)
    with pytest.raises(SaveFailed) as failed:
        trainer.run(3)  # sync: at the save of step 2; async: at step 3, when the failed step-2 save is looked at
    message = str(failed.value)
    assert "\n" not in message and "checkpoint of step 2 could not be written" in message and words in message
    assert trainer.train_state.step == (2 if mode == "disabled" else 3)
    monkeypatch.undo()
    _assert_step_1_intact(tmp_path)
