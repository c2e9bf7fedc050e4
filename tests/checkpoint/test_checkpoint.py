"""Checkpoints: exact resume, resharding across world sizes, crash safety, retention, and safe (pickle-free) loads."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests import processes
from tests.distributed import run_workers
from tests.helpers import (
    ROOT,
    STALL_IN_SAVE,
    TINY,
    Trainer,
    assert_same_snapshot,
    meta_model,
    warmup,
)
from tests.helpers import (
    checkpoint_job as job,
)
from torchtitan.checkpoint import (
    CheckpointManager,
    SafeFileSystemReader,
    SafeLoadPlanner,
    decode_plain,
    encode_plain,
    folders,
)
from torchtitan.errors import UserError
from torchtitan.models.llama import Transformer

# DCP says it assumes one process whenever no process group exists; so do we.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),  # torchdata's own deprecation notice
]


# ------------------------------------------------------------------------------------------------------------------
# Plain-data encoding


def test_plain_encoding_round_trips_exactly():
    value = {
        "ints": [1, -2, 2**70],
        "float": 0.1,
        "neg_zero": -0.0,
        "inf": float("inf"),
        "none": None,
        "flag": True,
        "tuple": (1, (2, "a")),
        "int_keys": {3: "three", (1, 2): "pair"},
        "bytes": b"\x00\xff",
        "looks_tagged": {"__tuple__": [1, 2]},
        "nested": {"a": [{"b": ()}]},
        "generator": torch.Generator().manual_seed(3).get_state(),
        "floats": torch.tensor([[0.1, -1e300]], dtype=torch.float64),
    }
    decoded = decode_plain(encode_plain(value))
    generator, floats = decoded.pop("generator"), decoded.pop("floats")
    expected = dict(value)
    expected_generator, expected_floats = expected.pop("generator"), expected.pop("floats")
    assert decoded == expected
    assert isinstance(decoded["tuple"], tuple) and isinstance(decoded["tuple"][1], tuple)
    assert generator.dtype == torch.uint8 and torch.equal(generator, expected_generator)
    assert floats.dtype == torch.float64 and floats.shape == (1, 2) and torch.equal(floats, expected_floats)


def test_plain_encoding_rejects_objects():
    with pytest.raises(TypeError, match=r"state\.sched\.fn is a function"):
        encode_plain({"sched": {"fn": warmup}})


# ------------------------------------------------------------------------------------------------------------------
# Single process


def test_round_trip_resumes_bit_for_bit(tmp_path):
    straight = Trainer(job(str(tmp_path / "a"), steps=6, interval=3))
    losses = straight.run(6)
    assert sorted(os.listdir(tmp_path / "a" / "checkpoint")) == ["step-3", "step-6"]

    resumed = Trainer(job(str(tmp_path / "a"), steps=6, interval=3, load_step=3))
    assert resumed.checkpoint.load()
    assert resumed.train_state.step == 3
    assert resumed.run(6) == losses[3:]
    assert_same_snapshot(resumed.snapshot(), straight.snapshot())


def test_load_without_checkpoint_returns_false(tmp_path):
    trainer = Trainer(job(str(tmp_path)))
    before = trainer.snapshot()
    assert trainer.checkpoint.load() is False
    assert_same_snapshot(trainer.snapshot(), before)


def test_interval_keep_latest_k_and_load_step(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=7, interval=2, keep_latest_k=2))
    trainer.run(7)
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-6", "step-7"]  # 2, 4 pruned; 7 forced as the last step

    with pytest.raises(UserError, match=r"load_step 4 .*available steps: 6, 7"):
        Trainer(job(str(tmp_path), steps=7, load_step=4)).checkpoint.load()
    latest = Trainer(job(str(tmp_path), steps=7))
    assert latest.checkpoint.load() and latest.train_state.step == 7
    chosen = Trainer(job(str(tmp_path), steps=7))
    assert chosen.checkpoint.load(step=6) and chosen.train_state.step == 6


def test_disabled_checkpoint_writes_nothing(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=2, enable_checkpoint=False, interval=1))
    trainer.run(2)
    assert not trainer.checkpoint.load()
    assert not (tmp_path / "checkpoint").exists()


def test_leftover_temporary_folder_is_ignored_and_removed(tmp_path):
    Trainer(job(str(tmp_path), steps=2, interval=2)).run(2)
    folder = tmp_path / "checkpoint"
    (folder / ".step-4.tmp-0123abcd").mkdir()
    (folder / ".step-4.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"half written")
    (folder / "step-9").mkdir()  # a visible folder without metadata is not a checkpoint either
    trainer = Trainer(job(str(tmp_path), steps=4))
    assert not (folder / ".step-4.tmp-0123abcd").exists()
    assert trainer.checkpoint.load() and trainer.train_state.step == 2


def test_saving_a_step_again_replaces_it(tmp_path):
    first = Trainer(job(str(tmp_path), steps=2, interval=1))
    first.run(2)
    again = Trainer(job(str(tmp_path), steps=2, interval=1, load_step=1))
    assert again.checkpoint.load()
    again.optimizers.optimizer.param_groups[0]["lr"] = 0.5  # a different run from step 1
    again.run(2)
    check = Trainer(job(str(tmp_path), steps=2))
    assert check.checkpoint.load() and check.train_state.step == 2
    assert_same_snapshot(check.snapshot(), again.snapshot())
    # Resuming from step 1 set the first run's step 2 aside; the step 2 saved since is this run's.
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1", "step-2", "superseded"]


def test_unwritable_folder_is_a_user_error_before_training(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("keep me")
    with pytest.raises(UserError, match="not writable"):
        Trainer(job(str(tmp_path), folder=str(blocker / "checkpoint")))
    with pytest.raises(UserError, match="not writable"):
        Trainer(job(str(tmp_path), folder=str(blocker)))
    assert blocker.read_text() == "keep me"


@contextlib.contextmanager
def unwritable(folder):
    """``folder`` refuses new files while inside, for root too: permissions for a user, the immutable attribute for
    root (whom permissions do not stop)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode
    ):
        pytest.skip("as root a folder is made unwritable with chattr +i, which this file system or user cannot set")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_read_only_folder_is_a_user_error_and_keeps_checkpoints(tmp_path):
    Trainer(job(str(tmp_path), steps=1, interval=1)).run(1)
    folder = tmp_path / "checkpoint"
    before = sorted(os.listdir(folder / "step-1"))
    with unwritable(folder), pytest.raises(UserError, match="not writable"):
        Trainer(job(str(tmp_path), steps=1))
    assert sorted(os.listdir(folder / "step-1")) == before


def test_folder_the_system_refuses_is_a_user_error():
    # procfs takes no new files from anyone, root included.
    with pytest.raises(UserError, match=r"checkpoint folder '/proc/self' is not writable \(.+\); fix its permissions"):
        Trainer(job("/proc/self", steps=1, folder="/proc/self"))


def test_initial_load_path_model_only_or_everything(tmp_path):
    source = Trainer(job(str(tmp_path), steps=2, interval=2, folder="source"))
    source.run(2)
    expected = source.snapshot()
    step_2 = str(tmp_path / "source" / "step-2")

    everything = Trainer(job(str(tmp_path), folder="full", initial_load_path=step_2, initial_load_model_only=False))
    assert everything.checkpoint.load()
    assert_same_snapshot(everything.snapshot(), expected)

    # Model only, from the folder (its latest step): the weights, and a fresh optimizer, schedule, data and step.
    fresh = Trainer(job(str(tmp_path), interval=1, folder="warm", initial_load_path=str(tmp_path / "source")))
    untouched = fresh.snapshot()
    assert fresh.checkpoint.load()
    warm = fresh.snapshot()
    params = [key for key in expected["arrays"] if key.startswith("param/")]
    for key in params:
        np.testing.assert_array_equal(warm["arrays"][key], expected["arrays"][key], err_msg=key)
    assert not np.array_equal(untouched["arrays"][params[0]], expected["arrays"][params[0]])
    assert {key: warm[key] for key in ("lr", "scheduler_epoch", "loader", "step")} == {
        key: untouched[key] for key in ("lr", "scheduler_epoch", "loader", "step")
    }
    moments = [key for key in untouched["arrays"] if key.startswith("optim/")]
    assert moments and not np.array_equal(expected["arrays"][moments[0]], untouched["arrays"][moments[0]])
    for key in moments:  # the optimizer state as a fresh optimizer has it
        np.testing.assert_array_equal(warm["arrays"][key], untouched["arrays"][key], err_msg=key)
    fresh.run(1)
    assert sorted(os.listdir(tmp_path / "warm")) == ["step-1"]  # it saves into its own folder
    again = Trainer(job(str(tmp_path), folder="warm", initial_load_path=step_2))
    assert again.checkpoint.load() and again.train_state.step == 1  # its own checkpoint, not initial_load_path


def test_default_folder_is_per_optimizer_and_names_older_shared_checkpoints(tmp_path, monkeypatch):
    import torchtitan.checkpoint.manager as checkpoint_module

    Trainer(job(str(tmp_path), steps=1, interval=1)).run(1)  # the explicit shared folder: checkpoint/step-1
    warnings_logged = []
    monkeypatch.setattr(checkpoint_module.logger, "warning", warnings_logged.append)
    per_optimizer = Trainer(job(str(tmp_path), steps=1, interval=1, folder=None))
    assert per_optimizer.checkpoint.folder == str(tmp_path / "checkpoint" / "AdamW")
    assert not per_optimizer.checkpoint.load()  # the shared folder's checkpoint is not resumed ...
    assert len(warnings_logged) == 1 and "--checkpoint.folder checkpoint" in warnings_logged[0]  # ... but named
    per_optimizer.run(1)
    assert sorted(os.listdir(tmp_path / "checkpoint" / "AdamW")) == ["step-1"]


def test_checkpoint_of_another_model_is_one_short_line(tmp_path, monkeypatch):
    Trainer(job(str(tmp_path), steps=1, interval=1)).run(1)
    other = Trainer(job(str(tmp_path), steps=1))
    other.checkpoint.model_parts = [Transformer(replace(TINY, n_layers=3))]
    with pytest.raises(UserError) as caught:
        other.checkpoint.load()
    message = str(caught.value)  # from the checkpoint's job facts: what it holds, what the job expects
    held, expected = (
        f"{sum(p.numel() for p in meta_model(args).parameters()):,}" for args in (TINY, replace(TINY, n_layers=3))
    )
    assert (
        f"holds model flavor debugmodel ({held} parameters); this job uses model flavor debugmodel ({expected} "
        in message
    )
    assert "\n" not in message and "model.layers" not in message
    assert len(message) - message.count(str(tmp_path)) * len(str(tmp_path)) < 300
    # Weights only (the optimizer may differ), but of another model: one line too.
    warm = Trainer(job(str(tmp_path), steps=1, folder="warm", initial_load_path=str(tmp_path / "checkpoint")))
    warm.checkpoint.model_parts = [Transformer(replace(TINY, n_layers=3))]
    with pytest.raises(
        UserError,
        match=rf"holds model flavor debugmodel \({held} parameters\); this job uses "
        rf"model flavor debugmodel \({expected} parameters\); point "
        r"checkpoint.initial_load_path",
    ):
        warm.checkpoint.load()
    # A checkpoint without job facts (written before they existed) is judged by its keys, summarised in one line.
    monkeypatch.setattr(CheckpointManager, "_read_facts", lambda self, path, entries: None)
    with pytest.raises(
        UserError,
        match=r"does not match this job \(\d+ entries missing: model\.layers\.2\.\S+, "
        r"model\.layers\.2\.\S+ and \d+ more\)",
    ) as caught:
        other.checkpoint.load()
    message = str(caught.value)
    assert "\n" not in message and "resume with the model settings that wrote it" in message
    assert len(message) - message.count(str(tmp_path)) * len(str(tmp_path)) < 300


def test_weights_export_at_last_step(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=3, interval=10, model_weights_only=True, export_dtype="bfloat16"))
    trainer.run(3)
    folder = tmp_path / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-3", "step-3-weights"]
    assert Trainer(job(str(tmp_path), steps=3)).checkpoint.load()  # the export is not mistaken for a checkpoint

    target = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in trainer.model.state_dict().items()}
    dcp.load(target, storage_reader=SafeFileSystemReader(str(folder / "step-3-weights")))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(target[name], value.to(torch.bfloat16)), name


def test_async_save_keeps_the_values_at_save_time(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=4, interval=2, async_mode="async"))
    trainer.run(2)
    at_step_2 = trainer.snapshot()
    trainer.run(4)  # mutates parameters while step 2 may still be writing
    trainer.checkpoint.close()
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]
    resumed = Trainer(job(str(tmp_path), steps=4, load_step=2))
    assert resumed.checkpoint.load()
    assert_same_snapshot(resumed.snapshot(), at_step_2)


# ------------------------------------------------------------------------------------------------------------------
# Loads never unpickle arbitrary objects


class _Planted:
    """Unpickling this creates a folder: the observable side effect of running code from a checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickled_object_in_checkpoint_is_refused(tmp_path):
    folder, marker = str(tmp_path / "ckpt"), str(tmp_path / "code_ran")
    dcp.save({"optimizer": {"lr": 0.1, "evil": _Planted(marker)}}, checkpoint_id=folder)
    target = {"optimizer": {"lr": 0.0, "evil": None}}

    planner = SafeLoadPlanner()
    with pytest.raises((pickle.UnpicklingError, CheckpointException), match="GLOBAL posix.mkdir"):
        dcp.load(target, storage_reader=SafeFileSystemReader(folder), planner=planner)
    assert not os.path.exists(marker)
    # The same checkpoint through DCP's default planner runs the planted code: the refusal above is ours.
    dcp.load(target, checkpoint_id=folder)
    assert os.path.isdir(marker)


def test_plain_state_is_stored_as_json(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=1, interval=1))
    trainer.run(1)
    reader = SafeFileSystemReader(str(tmp_path / "checkpoint" / "step-1"))
    saved = reader.read_metadata().state_dict_metadata
    names = ("train_state", "dataloader", "lr_schedulers")
    blobs = {name: torch.empty(saved[name].size, dtype=torch.uint8) for name in names}
    dcp.load(blobs, storage_reader=reader, planner=SafeLoadPlanner())
    text = {name: blob.numpy().tobytes() for name, blob in blobs.items()}
    assert text["train_state"] == b'{"step":1,"history":{"__tuple__":[1,2.5,"x"]}}'  # JSON text, not a pickle
    assert decode_plain(text["dataloader"])["dataset_state"] == {"batches": 1}
    assert decode_plain(text["lr_schedulers"])["last_epoch"] == 1


# ------------------------------------------------------------------------------------------------------------------
# SIGKILL in the middle of a save


@contextlib.contextmanager
def _stalled_in_save_at_step_2(code: str):
    """A process running ``code`` under STALL_IN_SAVE, yielded once its step-2 save has stalled; SIGKILLed after."""
    with processes.started(
        [sys.executable, STALL_IN_SAVE, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "STALL_AT_SAVE": "2"},
    ) as child:
        output = processes.LineReader(child.stdout)
        output.wait_for(lambda lines: any(line.startswith("STALLED") for line in lines), timeout=300)
        yield child


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path, mode):
    # The save at step 2 completes; the one at step 4 writes its data files and stalls before its metadata.
    code = (
        "from tests.helpers import Trainer, checkpoint_job\n"
        f"Trainer(checkpoint_job({str(tmp_path)!r}, steps=4, interval=2, async_mode={mode!r})).run(4)\n"
    )
    # With async saves the background thread is writing; a synchronous save blocks the loop. Leaving the block
    # SIGKILLs it.
    with _stalled_in_save_at_step_2(code) as child:
        pass
    assert child.returncode == -signal.SIGKILL
    folder = tmp_path / "checkpoint"
    leftovers = [name for name in os.listdir(folder) if name.startswith(".step-4.tmp-")]
    assert sorted(os.listdir(folder)) == sorted(["step-2", *leftovers]) and len(leftovers) == 1
    assert any(name.endswith(".distcp") for name in os.listdir(folder / leftovers[0]))

    resumed = Trainer(job(str(tmp_path), steps=4))
    assert os.listdir(folder) == ["step-2"]
    assert resumed.checkpoint.load() and resumed.train_state.step == 2
    expected = Trainer(job(str(tmp_path / "fresh"), steps=2, enable_checkpoint=False))
    expected.run(2)
    assert_same_snapshot(resumed.snapshot(), expected.snapshot())


def test_a_second_run_on_a_folder_in_use_is_refused_and_keeps_the_save_in_progress(tmp_path):
    code = (
        "from tests.helpers import Trainer, checkpoint_job\n"
        f"Trainer(checkpoint_job({str(tmp_path)!r}, steps=4, interval=2)).run(4)\n"
    )
    folder = tmp_path / "checkpoint"
    with _stalled_in_save_at_step_2(code) as child:
        in_use = sorted(os.listdir(folder))
        assert any(name.startswith(".step-4.tmp-") for name in in_use)
        refusal = re.escape(f"checkpoint folder '{folder}' is in use by another run (pid {child.pid} on ")
        with pytest.raises(UserError, match=refusal):
            Trainer(job(str(tmp_path), steps=4))
        assert sorted(os.listdir(folder)) == in_use  # the first run's save in progress is untouched
    # Its process is gone (SIGKILLed on leaving the block): the next run starts, cleaning what it left.
    resumed = Trainer(job(str(tmp_path), steps=4))
    assert os.listdir(folder) == ["step-2"]
    assert resumed.checkpoint.load() and resumed.train_state.step == 2
    resumed.checkpoint.close()
    assert not os.path.exists(folders.lock_path(str(folder)))  # a clean end leaves no lock file


def test_a_filesystem_without_locks_is_said_in_one_warning(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(folders.fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        trainer = Trainer(job(str(tmp_path), steps=2, interval=2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot lock" in w and "would not be refused" in w for w in warnings), warnings
    trainer.run(2)
    assert os.listdir(tmp_path / "checkpoint") == ["step-2"]


# ------------------------------------------------------------------------------------------------------------------
# Several ranks (gloo, FSDP2)


def _train_and_save(folder, mode):
    trainer = Trainer(job(folder, steps=4, interval=2, async_mode=mode))
    losses = trainer.run(2)
    at_step_2 = trainer.snapshot()
    losses += trainer.run(4)
    trainer.checkpoint.close()
    return losses, at_step_2


def _resume(folder, load_step):
    trainer = Trainer(job(folder, steps=4, load_step=load_step))
    assert trainer.checkpoint.load()
    loaded = trainer.snapshot()
    return loaded, trainer.run(4)


def _save_then_resume(rank, world_size, folders, seconds_folder=None):
    """Per async mode: train 4 steps saving at 2 and 4, then a fresh job in the same ranks resumes from step 2."""
    results = {}
    for mode, folder in folders.items():
        losses, at_step_2 = _train_and_save(folder, mode)
        loaded, resumed_losses = _resume(folder, 2)
        results[mode] = {"losses": losses, "at_step_2": at_step_2, "loaded": loaded, "resumed": resumed_losses}
    if seconds_folder is not None:
        _save_by_rank_0s_clock(rank, seconds_folder)
    return results


def _save_by_rank_0s_clock(rank, folder):
    """interval_type seconds with clocks that disagree: rank ``deciding`` says due (or not), the other the opposite."""
    for deciding_due, name in ((False, "rank0_never"), (True, "rank0_always")):
        trainer = Trainer(job(os.path.join(folder, name), steps=4, interval=10, interval_type="seconds"))
        due = deciding_due if rank == 0 else not deciding_due
        # A clock that runs 100 s per reading is always due; one that stands still never is.
        trainer.checkpoint.clock = functools.partial(next, itertools.count(100.0, 100.0)) if due else lambda: 0.0
        trainer.checkpoint._last_save_time = 0.0
        trainer.run(4)
        trainer.checkpoint.close()


def _resume_worker(rank, world_size, folder, load_step):
    return _resume(folder, load_step)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One 2-rank launch (process start-up dominates the cost) serving the tests below."""
    folders = {mode: str(tmp_path_factory.mktemp(mode)) for mode in ("disabled", "async")}
    folders_and_seconds = (folders, str(tmp_path_factory.mktemp("seconds")))
    return folders_and_seconds, run_workers(_save_then_resume, world_size=2, args=folders_and_seconds)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_save_on_two_ranks_resumes_exactly_on_two(two_rank_runs, mode):
    (folders, _), results = two_rank_runs
    # The resume from step 2 set the first run's step 4 aside; the step 4 there now is the resumed run's.
    assert sorted(os.listdir(os.path.join(folders[mode], "checkpoint"))) == ["step-2", "step-4", "superseded"]
    for rank_results in results:
        run = rank_results[mode]
        assert_same_snapshot(run["loaded"], run["at_step_2"])
        assert run["resumed"] == run["losses"][2:]  # bit for bit


def _assert_resharded(results, reference):
    for loaded, resumed_losses in results:
        # Same global batch (6 = 1x6 = 3x2), so training continues on the same data; only the summation order
        # across a different number of shards differs.
        assert_same_snapshot(loaded, reference["at_step_2"])
        np.testing.assert_allclose(resumed_losses, reference["losses"][2:], rtol=1e-10)


def test_time_based_saves_follow_rank_0s_clock_on_every_rank(two_rank_runs):
    """Rank 0 decides and broadcasts: with clocks that disagree, both ranks save at the same steps (no hang)."""
    (_, seconds_folder), _ = two_rank_runs
    saved = {
        name: sorted(os.listdir(os.path.join(seconds_folder, name, "checkpoint")))
        for name in ("rank0_never", "rank0_always")
    }
    assert saved == {"rank0_never": ["step-4"], "rank0_always": ["step-1", "step-2", "step-3", "step-4"]}


def test_save_on_two_ranks_loads_in_one_unsharded_process(two_rank_runs):
    (folders, _), results = two_rank_runs
    _assert_resharded([_resume(folders["disabled"], 2)], results[0]["disabled"])


def test_save_on_two_ranks_reshards_to_three(two_rank_runs):
    (folders, _), results = two_rank_runs
    _assert_resharded(run_workers(_resume_worker, world_size=3, args=(folders["disabled"], 2)), results[0]["disabled"])


def test_a_tied_model_saves_its_one_weight_once_and_resumes_tied(tmp_path):
    from tests.helpers import TIED_TINY, batch, checkpoint_job, materialize, tiny_manager, weights

    job = checkpoint_job(str(tmp_path))
    model = materialize(meta_model(TIED_TINY), seed=1)
    manager = tiny_manager(model, job)
    inputs, labels = batch()
    model(inputs, labels=labels).backward()
    manager.optimizers.step()
    manager.save(1, force=True)
    manager.close()
    entries = SafeFileSystemReader(str(tmp_path / "checkpoint" / "step-1")).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in entries and not any("output.weight" in name for name in entries)
    resumed = materialize(meta_model(TIED_TINY), seed=2)
    again = tiny_manager(resumed, job)
    assert again.load()
    assert resumed.output.weight is resumed.tok_embeddings.weight
    assert weights(resumed).keys() == weights(model).keys()
    for name, value in weights(model).items():
        assert torch.equal(weights(resumed)[name], value), name
    assert again.optimizers.state_bytes() == manager.optimizers.state_bytes()


def test_a_folder_named_through_a_symbolic_link_shares_the_lock_of_its_real_path(tmp_path):
    real = tmp_path / "real" / "checkpoint"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    through_link = tmp_path / "link" / "checkpoint"
    assert folders.lock_path(str(through_link)) == folders.lock_path(str(real))
    # A process holding the real folder: taking it through the link, from another process, is refused.
    holder = (
        "import sys\n"
        "from torchtitan.checkpoint import folders\n"
        f"lock, who = folders.try_lock_folder({str(real)!r})\n"
        "print('held' if lock else 'refused', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    command = [sys.executable, "-c", holder]
    with processes.started(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT) as child:
        assert child.stdout.readline().strip() == "held"
        lock, who = folders.try_lock_folder(str(through_link))
        assert lock is None and f"pid {child.pid} on " in who
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)
    lock, who = folders.try_lock_folder(str(through_link))  # free again once the holder is gone
    assert lock is not None and who is None
    lock.release()
