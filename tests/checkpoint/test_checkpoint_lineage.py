"""Checkpoint lineage: a run resumed from an older step is the branch that later saves and resumes follow; a step
saved again is swapped in atomically; a crash at any point of either leaves a complete checkpoint under each name."""

from __future__ import annotations

import os

import pytest

from tests.helpers import Trainer, assert_same_snapshot
from tests.helpers import checkpoint_job as job
from torchtitan.checkpoint import folders
from torchtitan.checkpoint.safe_reading import METADATA_FILE

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]


def fake_checkpoint(path, content: str) -> None:
    os.makedirs(path)
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        f.write(content)


def content(path) -> str:
    with open(os.path.join(path, METADATA_FILE)) as f:
        return f.read()


def test_resume_from_an_older_step_is_the_branch_that_later_resumes_follow(tmp_path):
    Trainer(job(str(tmp_path), steps=3, interval=1)).run(3)
    folder = tmp_path / "checkpoint"
    branch = Trainer(job(str(tmp_path), steps=3, interval=1, load_step=1, keep_latest_k=2))
    assert branch.checkpoint.load() and branch.train_state.step == 1
    # The abandoned branch's newer checkpoints are set aside, not deleted.
    (aside,) = (folder / "superseded").iterdir()
    assert aside.name.startswith("after-step-1-") and sorted(os.listdir(aside)) == ["step-2", "step-3"]
    assert folders.complete_steps(str(folder)) == [1]
    assert branch.checkpoint.resume_hint().startswith("the last finite checkpoint is step-1 ")
    branch.optimizers.optimizer.param_groups[0]["lr"] = 0.5  # a different run from step 1
    branch.run(2)  # then stops (a crash): step 2 of the branch is its newest checkpoint
    assert folders.complete_steps(str(folder)) == [1, 2]
    assert branch.checkpoint.resume_hint().startswith("the last finite checkpoint is step-2 ")

    resumed = Trainer(job(str(tmp_path), steps=3, interval=1, keep_latest_k=1))
    assert resumed.checkpoint.load() and resumed.train_state.step == 2  # the branch's step 2, not the stale step 3
    assert_same_snapshot(resumed.snapshot(), branch.snapshot())
    resumed.run(3)
    assert folders.complete_steps(str(folder)) == [3]  # keep_latest_k=1 keeps the one just written
    assert sorted(os.listdir(aside)) == ["step-2", "step-3"]


def test_keep_latest_k_never_prunes_the_checkpoint_just_written(tmp_path):
    folder = str(tmp_path / "checkpoint")
    fake_checkpoint(os.path.join(folder, "step-9"), "another run's")  # newer, written after this run resumed
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1, keep_latest_k=1))
    trainer.run(2)
    assert folders.complete_steps(folder) == [2]
    assert trainer.checkpoint.resume_hint().startswith("the last finite checkpoint is step-2 ")


def _replace_step(tmp_path, crash_after_renames: int | None, exchange: bool, monkeypatch, name: str = "step-3") -> str:
    """Publish a new ``name`` (a checkpoint or one of its exports) over an old one, the process dying after
    ``crash_after_renames`` renames; then start again (recover) and return what ``name`` holds."""
    folder = str(tmp_path)
    final, temporary = os.path.join(folder, name), folders.temporary_name(os.path.join(folder, name), "ab")
    fake_checkpoint(final, "old")
    fake_checkpoint(temporary, "new")
    if not exchange:
        monkeypatch.setattr(folders, "_exchange", lambda first, second: False)
    if crash_after_renames is not None:
        renames, real_rename = [], os.rename

        def rename(src, dst):
            if len(renames) == crash_after_renames:
                raise SystemExit("crash")
            renames.append(src)
            real_rename(src, dst)

        monkeypatch.setattr(folders.os, "rename", rename)
        with pytest.raises(SystemExit):
            folders.publish(temporary, final)
        monkeypatch.undo()
    else:
        folders.publish(temporary, final)
    folders.recover(folder)
    assert folders.complete_steps(folder) == ([3] if name == "step-3" else []) and os.listdir(folder) == [name]
    return content(final)


@pytest.mark.parametrize("name", ["step-3", "step-3-weights", "step-3-hf"])
@pytest.mark.parametrize("crash_after_renames, expected", [(0, "old"), (1, "old"), (None, "new")])
def test_replacing_a_step_without_an_atomic_exchange_survives_a_crash_between_the_renames(
    tmp_path, monkeypatch, crash_after_renames, expected, name
):
    assert _replace_step(tmp_path, crash_after_renames, False, monkeypatch, name) == expected


def test_replacing_a_step_swaps_in_one_exchange_where_the_system_has_one(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    if not folders._exchange(str(first), str(second)):
        pytest.skip("this system or file system has no atomic exchange (renameat2); the fallback is tested above")
    first.rmdir()
    second.rmdir()

    def rename(src, dst):
        raise AssertionError(f"renamed {src} to {dst}: the atomic exchange should have replaced the step alone")

    monkeypatch.setattr(folders.os, "rename", rename)  # the fallback renames; the exchange never does
    assert _replace_step(tmp_path, None, True, monkeypatch) == "new"


def test_setting_a_branch_aside_is_finished_after_a_crash(tmp_path, monkeypatch):
    folder = str(tmp_path)
    for step in (1, 2, 3):
        fake_checkpoint(os.path.join(folder, f"step-{step}"), str(step))
    fake_checkpoint(os.path.join(folder, "step-3-weights"), "weights")
    fake_checkpoint(os.path.join(folder, "step-3-hf"), "hf")
    real_rename, renames = os.rename, []

    def rename(src, dst):
        if renames:
            raise SystemExit("crash")
        renames.append(src)
        real_rename(src, dst)

    monkeypatch.setattr(folders.os, "rename", rename)
    with pytest.raises(SystemExit):
        folders.set_aside_newer(folder, 1)
    monkeypatch.undo()
    assert folders.complete_steps(folder) == [1, 3]  # step 3 still visible: the next start must finish the moves
    folders.recover(folder)
    assert folders.complete_steps(folder) == [1] and sorted(os.listdir(folder)) == ["step-1", "superseded"]
    (aside,) = (tmp_path / "superseded").iterdir()
    assert sorted(os.listdir(aside)) == ["step-2", "step-3", "step-3-hf", "step-3-weights"]
