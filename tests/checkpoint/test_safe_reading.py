"""A checkpoint's ``.metadata`` runs nothing of its author's choosing, on every path that opens a checkpoint.

Each hostile file below would run ``os.mkdir(marker)`` (or change a class) under Python's pickle; the tests plant it
as a checkpoint's ``.metadata``, with its checksum recorded as if it were genuine (so that the metadata reader, not
the checksums, is what stops it), and assert that the marker never appears and that the refusal is one line naming
the file. The paths that open a checkpoint, all through ``safe_reading.read_metadata_file``:

- ``SafeFileSystemReader.read_metadata`` (what ``dcp.load`` calls; tests' ``read_checkpoint`` too);
- a resume of the newest checkpoint (``CheckpointManager.load()``): the hostile one is moved aside and the run
  resumes from the one before;
- a resume of an explicit ``checkpoint.load_step``: refused;
- ``checkpoint.initial_load_path`` naming a ``step-N`` folder, model weights only and everything;
- ``checkpoint.initial_load_path`` naming a folder of checkpoints (its newest).

Hugging Face folders (``initial_load_in_hf``) are read through safetensors headers (JSON), never pickle.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import time

import pytest
import torch.distributed.checkpoint.metadata as dcp_metadata

from tests.helpers import Trainer, two_saved_steps
from tests.helpers import checkpoint_job as job
from torchtitan.checkpoint import SafeFileSystemReader
from torchtitan.checkpoint.folders import DAMAGED_FOLDER
from torchtitan.checkpoint.integrity import ALGORITHM, CHECKSUMS_FILE, file_digest
from torchtitan.checkpoint.safe_reading import ALLOWED_GLOBALS, UnreadableCheckpoint
from torchtitan.errors import UserError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
]

MARKER = "code_ran"  # a folder the hostile files try to create beside the checkpoint folder


def _text(value: str) -> bytes:
    raw = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _call(module: str, name: str, *args: str) -> bytes:
    return _global(module, name) + pickle.MARK + b"".join(_text(a) for a in args) + pickle.TUPLE + pickle.REDUCE


def _pickle(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


class _SubclassWithReduce(dcp_metadata.Metadata):
    """A subclass of an allowed class whose pickle calls a function of its choosing."""

    def __init__(self, marker: str):
        super().__init__(state_dict_metadata={})
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class _PlainSubclass(dcp_metadata.Metadata):
    """A subclass of an allowed class, pickled under its own (test module) name."""


ALLOWED_MODULES = sorted({module for module, _ in ALLOWED_GLOBALS})


def hostile_files(marker: str) -> dict[str, bytes]:
    """Files that run code, or change an allowed class, when Python's pickle reads them; by what they try."""
    files = {
        # A dotted name, followed attribute by attribute from an allowed module, reaches os.mkdir.
        **{f"dotted name through {module}": _pickle(_call(module, "os.mkdir", marker)) for module in ALLOWED_MODULES},
        "dotted name to an allowed class": _pickle(_call("torch", "distributed.checkpoint.metadata.os.mkdir", marker)),
        "REDUCE on a forbidden callable": _pickle(_call("posix", "mkdir", marker)),
        "REDUCE on an allowed record class": _pickle(
            _call("torch.distributed.checkpoint.metadata", "Metadata", marker)
        ),
        "REDUCE on an allowed constructor with other arguments": _pickle(
            _call("torch.serialization", "_get_layout", marker)
        ),
        "NEWOBJ of a forbidden class": _pickle(
            _global("subprocess", "Popen") + pickle.MARK + _text(marker) + pickle.TUPLE + pickle.NEWOBJ
        ),
        "NEWOBJ of an allowed constructor": _pickle(_global("torch", "Size") + pickle.EMPTY_TUPLE + pickle.NEWOBJ),
        # BUILD on the class itself: pickle would set Metadata.__eq__ (any class attribute) for the whole process.
        "BUILD on an allowed class": _pickle(
            _global("torch.distributed.checkpoint.metadata", "Metadata")
            + pickle.NONE
            + pickle.EMPTY_DICT
            + _text("__eq__")
            + _global("torch", "Size")
            + pickle.SETITEM
            + pickle.TUPLE2
            + pickle.BUILD
        ),
        "BUILD with fields a record does not declare": _pickle(
            _global("torch.distributed.checkpoint.metadata", "Metadata")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + pickle.EMPTY_DICT
            + _text("__class__")
            + _global("torch", "Size")
            + pickle.SETITEM
            + pickle.BUILD
        ),
        "INST of a forbidden callable": pickle.MARK + _text(marker) + pickle.INST + b"os\nmkdir\n" + pickle.STOP,
        "OBJ of a forbidden callable": _pickle(pickle.MARK + _global("os", "mkdir") + _text(marker) + pickle.OBJ),
        "OBJ of an allowed class": _pickle(
            pickle.MARK + _global("torch.distributed.checkpoint.metadata", "Metadata") + pickle.EMPTY_DICT + pickle.OBJ
        ),
        "a subclass's __reduce__": pickle.dumps(_SubclassWithReduce(marker), protocol=4),
        "a subclass of an allowed class": pickle.dumps(_PlainSubclass(state_dict_metadata={}), protocol=4),
        "nesting without end": _pickle(pickle.EMPTY_TUPLE + pickle.TUPLE1 * 50_000),
        "marks without end": pickle.PROTO + b"\x04" + pickle.MARK * 50_000,
        "a text claiming 2**62 bytes": pickle.PROTO + b"\x04" + pickle.BINUNICODE8 + struct.pack("<Q", 2**62) + b"x",
        "bytes claiming 2**40 bytes": pickle.PROTO + b"\x04" + pickle.BINBYTES8 + struct.pack("<Q", 2**40) + b"x",
        "a persistent id": _pickle(pickle.PERSID + marker.encode() + b"\n"),
        "an extension code": _pickle(pickle.EXT1 + b"\x01"),
    }
    return files


def _planted(folder: str, hostile: bytes) -> None:
    """Write ``hostile`` as the ``.metadata`` of the checkpoint ``folder``, its checksum recorded as if genuine."""
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(hostile)
    record_path = os.path.join(folder, CHECKSUMS_FILE)
    with open(record_path) as f:
        record = json.load(f)
    record["files"][".metadata"] = {"size": len(hostile), ALGORITHM: file_digest(os.path.join(folder, ".metadata"))}
    with open(record_path, "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's checkpoint folder holding step-1 and step-2, and the losses of its steps 1 and 2."""
    return two_saved_steps(tmp_path_factory.mktemp("saved"))


def test_the_hostile_files_run_code_under_plain_pickle(tmp_path):
    """The control: each file that reaches a callable does run it (or changes a class) under Python's pickle."""
    for what, hostile in hostile_files(str(tmp_path / "ran")).items():
        if "dotted name" not in what and what not in ("REDUCE on a forbidden callable", "INST of a forbidden callable"):
            continue
        assert not (tmp_path / "ran").exists()
        pickle.loads(hostile)
        assert (tmp_path / "ran").is_dir(), what
        os.rmdir(tmp_path / "ran")
    saved_eq = dcp_metadata.Metadata.__eq__
    try:
        pickle.loads(hostile_files("unused")["BUILD on an allowed class"])
        assert dcp_metadata.Metadata.__eq__ is not saved_eq  # pickle changed the class for the whole process
    finally:
        dcp_metadata.Metadata.__eq__ = saved_eq


def test_the_reader_refuses_every_hostile_file_in_one_line(saved, tmp_path):
    folder, _ = saved
    marker = str(tmp_path / MARKER)
    checkpoint = tmp_path / "step-2"
    shutil.copytree(folder / "step-2", checkpoint)
    for what, hostile in hostile_files(marker).items():
        _planted(str(checkpoint), hostile)
        eq_before = dcp_metadata.Metadata.__eq__
        begin = time.perf_counter()
        with pytest.raises(UnreadableCheckpoint) as refused:
            SafeFileSystemReader(str(checkpoint)).read_metadata()
        assert time.perf_counter() - begin < 10, what  # a huge claimed size is never allocated
        message = str(refused.value)
        assert "\n" not in message and str(checkpoint / ".metadata") in message, (what, message)
        assert not os.path.exists(marker), what
        assert dcp_metadata.Metadata.__eq__ is eq_before, what


def test_an_allowed_name_is_exact(saved):
    """Only exact (module, name) pairs resolve, each to the object imported by the reader."""
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in ALLOWED_GLOBALS
    assert not any("." in name for _, name in ALLOWED_GLOBALS)
    folder, _ = saved
    genuine = SafeFileSystemReader(str(folder / "step-2")).read_metadata()
    assert type(genuine) is dcp_metadata.Metadata and genuine.state_dict_metadata


def _manager_paths(saved_folder, work):
    """Every way a run opens a checkpoint, each as (name, how to start it, folder to plant in, expect a resume)."""
    return [
        ("resume of the newest", {}, work / "checkpoint" / "step-2", True),
        ("resume of checkpoint.load_step", {"load_step": 2}, work / "checkpoint" / "step-2", False),
        (
            "initial_load_path, model only",
            {"initial_load_path": str(work / "other" / "step-2"), "initial_load_model_only": True},
            work / "other" / "step-2",
            False,
        ),
        (
            "initial_load_path, everything",
            {"initial_load_path": str(work / "other" / "step-2"), "initial_load_model_only": False},
            work / "other" / "step-2",
            False,
        ),
        (
            "initial_load_path, a folder of checkpoints",
            {"initial_load_path": str(work / "other")},
            work / "other" / "step-2",
            False,
        ),
    ]


@pytest.mark.parametrize("path_index", range(5))
def test_no_path_that_opens_a_checkpoint_runs_a_hostile_file(saved, tmp_path, path_index):
    folder, losses = saved
    marker = str(tmp_path / MARKER)
    files = hostile_files(marker)
    # The reported attack on every path, and other kinds on the resume (the paths share the reader tested above).
    names = ["dotted name through torch.distributed.checkpoint.metadata"]
    if path_index == 0:
        names += ["INST of a forbidden callable", "a subclass's __reduce__", "nesting without end"]
    for what in names:
        work = tmp_path / "work"
        name, options, plant_in, resumes = _manager_paths(folder, work)[path_index]
        shutil.copytree(folder, work / "checkpoint")
        shutil.copytree(folder, work / "other")
        if name.startswith("initial_load_path"):
            shutil.rmtree(work / "checkpoint")
        _planted(str(plant_in), files[what])
        trainer = Trainer(job(str(work), steps=2, interval=1, **options))
        try:
            if resumes:
                assert trainer.checkpoint.load()
                assert trainer.train_state.step == 1, (name, what)  # the step before the hostile one
                damaged = os.listdir(work / "checkpoint" / DAMAGED_FOLDER)
                assert len(damaged) == 1 and damaged[0].startswith("step-2-"), (name, what)
            else:
                with pytest.raises(UserError) as refused:
                    trainer.checkpoint.load()
                message = str(refused.value)
                assert "\n" not in message and str(plant_in / ".metadata") in message, (name, what, message)
                assert (plant_in / ".metadata").read_bytes() == files[what]  # left where it was
        finally:
            trainer.checkpoint.close()
        assert not os.path.exists(marker), (name, what)
        shutil.rmtree(work)
