"""Checksums recorded at save and verified before a load; a damaged newest checkpoint passed over, never loaded.

A run of two steps saves step-1 and step-2 (module fixture). Each test copies that folder, damages step-2 the way a
disk, a copy or a crash would, and resumes: step-2 is moved to ``damaged/`` with one line saying what is wrong, and
the run resumes from step-1 exactly (its step-2 loss is the uninterrupted run's, bit for bit in float64). An explicit
``checkpoint.load_step`` of the damaged step is refused in one line instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from unittest import mock

import pytest
import torch

from tests.helpers import Trainer, two_saved_steps
from tests.helpers import checkpoint_job as job
from torchtitan.checkpoint import integrity, manager
from torchtitan.checkpoint.folders import DAMAGED_FOLDER
from torchtitan.checkpoint.integrity import ALGORITHM, CHECKSUMS_FILE, file_digest
from torchtitan.errors import UserError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's checkpoint folder holding step-1 and step-2, and the losses of its steps 1 and 2."""
    return two_saved_steps(tmp_path_factory.mktemp("saved"))


def _shard(folder) -> str:
    return str(next(path for path in sorted(folder.iterdir()) if path.suffix == ".distcp"))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_each_file_of_a_checkpoint_has_its_checksum_recorded(tmp_path, saved, mode):
    if mode == "disabled":
        folder = saved[0] / "step-2"
    else:
        trainer = Trainer(job(str(tmp_path), steps=1, interval=1, async_mode=mode))
        trainer.run(1)
        trainer.checkpoint.close()  # publishes the save written in the background
        folder = tmp_path / "checkpoint" / "step-1"
    record = json.loads((folder / CHECKSUMS_FILE).read_text())
    assert record["algorithm"] == ALGORITHM
    written = sorted(name for name in os.listdir(folder) if name != CHECKSUMS_FILE)
    assert sorted(record["files"]) == written and ".metadata" in written  # no part of a rank's record left over
    for name, entry in record["files"].items():
        assert entry == {"size": os.path.getsize(folder / name), ALGORITHM: file_digest(str(folder / name))}


@pytest.mark.parametrize("takes", [None, 1000])
def test_a_file_is_hashed_on_its_way_out_whatever_the_writes(tmp_path, monkeypatch, takes):
    """Small writes gathered by the buffer, a tensor's bytes at once (written and hashed a piece at a time), a raw
    write that takes only part of a piece: the digest recorded is the file's, without reading it back; a file that
    was sought in is not recorded (read back)."""
    raw_init = integrity._HashingRaw.__init__
    monkeypatch.setattr(integrity, "_PIECE", 4096)  # the tensor's 200,000 bytes in 49 pieces

    def short_writes(self, file):  # a disk that takes at most ``takes`` bytes a call (the buffer writes the rest)
        raw_init(self, file)
        self._write = lambda data: file.write(memoryview(data).cast("B")[:takes])

    monkeypatch.setattr(integrity._HashingRaw, "__init__", short_writes)
    fs = integrity._HashingFileSystem()
    tensor = torch.arange(50_000, dtype=torch.float32)
    with fs.create_stream(tmp_path / "written", "wb") as stream:
        for i in range(300):
            stream.write(b"header %d" % i)
        stream.write(memoryview(tensor.numpy()))
        stream.flush()
        stream.write(b"tail")
    with fs.create_stream(tmp_path / "sought", "wb") as stream:
        stream.write(b"0123456789")
        stream.seek(2)
        stream.write(b"x")
    size = os.path.getsize(tmp_path / "written")
    assert size == tensor.numel() * 4 + len(b"".join(b"header %d" % i for i in range(300))) + 4
    assert fs.written == {"written": {"size": size, ALGORITHM: file_digest(str(tmp_path / "written"))}}
    assert (tmp_path / "sought").read_bytes() == b"01x3456789"


def _random_bytes(step):
    shard = _shard(step)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(os.urandom(4096))


def _truncated(name):
    def damage(step):
        path = step / name if name else _shard(step)
        os.truncate(path, os.path.getsize(path) // 2)

    return damage


def _empty_metadata(step):
    (step / ".metadata").write_bytes(b"")


def _missing_shard(step):
    os.remove(_shard(step))


def _missing_metadata(step):
    os.remove(step / ".metadata")


def _unreadable_record(step):
    os.remove(step / CHECKSUMS_FILE)
    os.mkdir(step / CHECKSUMS_FILE)  # opening it fails whoever reads it (chmod 000 does not stop root)


def _damaged_record(step):
    (step / CHECKSUMS_FILE).write_text('{"algorithm": "xxh3_128", "files": ')


def _non_finite(step):
    """The checkpoint saved again with a NaN in a weight, its checksums right: only the finiteness check sees it."""
    work = step.parent.parent / "non-finite"
    trainer = Trainer(job(str(work), steps=2, initial_load_path=str(step), initial_load_model_only=False))
    assert trainer.checkpoint.load()
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    with mock.patch.object(manager, "tensors_are_finite", lambda tensors: True):  # saves refuse NaNs otherwise
        trainer.checkpoint.save(2, force=True)
    trainer.checkpoint.close()
    shutil.rmtree(step)
    shutil.move(work / "checkpoint" / "step-2", step)
    shutil.rmtree(work)


DAMAGE = {
    "4 KiB of random bytes in a shard": (_random_bytes, "does not match its checksum"),
    "a truncated shard": (_truncated(None), "truncated"),
    "a missing shard": (_missing_shard, "is missing"),
    "a truncated .metadata": (_truncated(".metadata"), "truncated"),
    "an empty .metadata": (_empty_metadata, "truncated"),
    "no .metadata": (_missing_metadata, "has no .metadata"),
    "an unreadable checksum record": (_unreadable_record, "cannot be read"),
    "a damaged checksum record": (_damaged_record, "is damaged"),
    "a NaN in a weight, checksums right": (_non_finite, "non-finite"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_exactly_from_the_one_before(
    tmp_path, saved, damage, caplog
):
    folder, losses = saved
    shutil.copytree(folder, tmp_path / "checkpoint")
    damage_it, what = DAMAGE[damage]
    damage_it(tmp_path / "checkpoint" / "step-2")
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert trainer.checkpoint.load()
    assert trainer.train_state.step == 1
    lines = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert len(lines) == 1 and "step-2" in lines[0] and what in lines[0] and "\n" not in lines[0], lines
    (moved,) = os.listdir(tmp_path / "checkpoint" / DAMAGED_FOLDER)
    assert moved.startswith("step-2-") and moved in lines[0]  # kept, never deleted
    assert trainer.run(2) == losses[1:]  # exactly the uninterrupted run's step 2
    trainer.checkpoint.close()


def test_an_explicit_load_step_that_is_damaged_is_refused_in_one_line(tmp_path, saved):
    shutil.copytree(saved[0], tmp_path / "checkpoint")
    _random_bytes(tmp_path / "checkpoint" / "step-2")
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1, load_step=2))
    with pytest.raises(UserError) as refused:
        trainer.checkpoint.load(step=2)
    message = str(refused.value)
    assert "\n" not in message and "checkpoint.load_step 2 is not loaded" in message
    assert "does not match its checksum" in message and "available: 1" in message
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1", "step-2"]  # nothing moved, nothing loaded
    assert trainer.train_state.step == 0
    trainer.checkpoint.close()


def test_when_no_checkpoint_verifies_the_run_stops_and_keeps_them_all(tmp_path, saved):
    shutil.copytree(saved[0], tmp_path / "checkpoint")
    for step in ("step-1", "step-2"):
        _random_bytes(tmp_path / "checkpoint" / step)
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1))
    with pytest.raises(UserError, match="no checkpoint in .* verifies"):
        trainer.checkpoint.load()
    assert len(os.listdir(tmp_path / "checkpoint" / DAMAGED_FOLDER)) == 2
    trainer.checkpoint.close()


def test_a_checkpoint_of_an_earlier_version_without_checksums_still_loads_said_once(tmp_path, saved, caplog):
    shutil.copytree(saved[0], tmp_path / "checkpoint")
    os.remove(tmp_path / "checkpoint" / "step-2" / CHECKSUMS_FILE)
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert trainer.checkpoint.load() and trainer.train_state.step == 2
    assert sum("has no checksums" in r.getMessage() for r in caplog.records) == 1
    trainer.checkpoint.close()


def test_an_initial_load_of_non_finite_values_is_refused_and_leaves_the_folder_alone(tmp_path, saved):
    """``initial_load_path`` is someone else's folder: a damaged checkpoint there is refused, never moved."""
    shutil.copytree(saved[0], tmp_path / "other")
    _non_finite(tmp_path / "other" / "step-2")
    trainer = Trainer(
        job(
            str(tmp_path), steps=2, interval=1, initial_load_path=str(tmp_path / "other"), initial_load_model_only=False
        )
    )
    with pytest.raises(UserError, match="step-2' holds non-finite model or optimizer values"):
        trainer.checkpoint.load()
    assert sorted(os.listdir(tmp_path / "other")) == ["step-1", "step-2"]
    trainer.checkpoint.close()


def test_an_incomplete_checkpoint_in_initial_load_path_is_passed_over_in_one_line(tmp_path, saved, caplog):
    shutil.copytree(saved[0], tmp_path / "other")
    _missing_metadata(tmp_path / "other" / "step-2")
    trainer = Trainer(job(str(tmp_path), steps=2, interval=1, initial_load_path=str(tmp_path / "other")))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert trainer.checkpoint.load()
    lines = [r.getMessage() for r in caplog.records if "passed over the incomplete step-2" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "other" / "step-1") in lines[0]
    assert sorted(os.listdir(tmp_path / "other")) == ["step-1", "step-2"]  # someone else's folder: untouched
    trainer.checkpoint.close()


def test_the_checksummed_writes_skip_torchs_unchecked_crc32_and_load_the_same(tmp_path, monkeypatch):
    """torch.save's CRC32 of each record is left out while a checkpoint's files are written (the XXH3 of each file,
    verified before a load, takes its place), set back after, and the files load the tensors written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem
    from torch.utils.serialization import config

    seen = []
    write_item = filesystem._write_item

    def spy(*args, **kwargs):
        seen.append(config.save.compute_crc32)
        return write_item(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", spy)
    state = {"w": torch.randn(64, 32), "m": torch.randn(7)}
    assert config.save.compute_crc32
    dcp.save(state, storage_writer=integrity.ChecksummingWriter(str(tmp_path)))
    assert seen and not any(seen)
    assert config.save.compute_crc32
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    files = integrity.read_record(str(tmp_path))
    assert integrity.verify_files(str(tmp_path), files, sorted(files)) is None
