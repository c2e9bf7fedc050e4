"""Checkpoints: exact resume, resharding across world sizes, crash safety, retention, and safe (pickle-free) loads."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from tests import processes
from tests.distributed import run_workers
from tests.parallel_helpers import meta_model
from torchtitan.lr_scheduling import SchedulersContainer
from torchtitan.checkpoint import CheckpointManager, SafeFileSystemReader, SafeLoadPlanner, decode_plain, encode_plain
from torchtitan.config_manager import JobConfig
from torchtitan.errors import UserError
from torchtitan.models.llama import ModelArgs, Transformer

# DCP says it assumes one process whenever no process group exists; so do we.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),  # torchdata's own deprecation notice
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 5
SEQ_LEN = 8
GLOBAL_BATCH = 6  # divisible by the world sizes 1, 2, 3
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=SEQ_LEN)


# ------------------------------------------------------------------------------------------------------------------
# A small training setup: tiny float64 Llama (FSDP2 when distributed), AdamW behind the optimizer-container
# interface, one LambdaLR, a stateful loader honouring the data order contract, and a step counter.


class Windows(IterableDataset):
    """Global window g is random tokens seeded by g; rank r of W takes windows k*W*B + r*B ... of global batch k.

    Its state (batches consumed) is world-size independent, like the project's loaders.
    """

    def __init__(self, rank: int, world_size: int, local_batch: int):
        self.rank, self.world_size, self.local_batch = rank, world_size, local_batch
        self.batches = 0

    def __iter__(self):
        while True:
            first = self.batches * self.world_size * self.local_batch + self.rank * self.local_batch
            self.batches += 1  # counted as the batch starts: the loader reads our state between batches
            for g in range(first, first + self.local_batch):
                generator = torch.Generator().manual_seed(1000 + g)
                yield torch.randint(0, TINY.vocab_size, (SEQ_LEN + 1,), generator=generator)

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


class Optimizers:
    """The optimizer container's checkpoint interface around one AdamW."""

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state):
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.options)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "history": (1, 2.5, "x")}

    def load_state_dict(self, state):
        assert state["history"] == (1, 2.5, "x")  # tuples survive the JSON encoding
        self.step = state["step"]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def build_model(dtype=torch.float64) -> Transformer:
    model = meta_model(TINY, dtype)
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model


def job(dump_folder: str, steps: int = 4, **checkpoint) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = dump_folder
    config.training.steps = steps
    config.checkpoint.enable_checkpoint = True
    config.checkpoint.folder = "checkpoint"  # explicit: used as given, with no per-optimizer subfolder
    for key, value in checkpoint.items():
        setattr(config.checkpoint, key, value)
    return config


class Trainer:
    def __init__(self, config: JobConfig):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.model = build_model()
        self.optimizers = Optimizers(self.model)
        self.schedulers = SchedulersContainer([LambdaLR(self.optimizers.optimizer, warmup)])
        self.loader = StatefulDataLoader(Windows(rank, world_size, GLOBAL_BATCH // world_size),
                                         batch_size=GLOBAL_BATCH // world_size)
        self.train_state = TrainState()
        self.checkpoint = CheckpointManager(
            data_loader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.train_state}, job_config=config,
        )
        self.batches = None
        self.last_step = config.training.steps

    def step(self) -> float:
        """One training step; the global mean loss."""
        if self.batches is None:
            self.batches = iter(self.loader)  # after a load, so that the restored position applies
        tokens = next(self.batches)
        loss = F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizers.optimizer.step()
        self.schedulers.step()
        self.optimizers.optimizer.zero_grad()
        self.train_state.step += 1
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        self.checkpoint.save(self.train_state.step, force=self.train_state.step == self.last_step)
        return total.item()

    def run(self, until: int) -> list[float]:
        return [self.step() for _ in range(self.train_state.step, until)]

    def snapshot(self) -> dict:
        """Full (unsharded) parameters and optimizer state as numpy, plus the plain state, on every rank."""
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        params = get_model_state_dict(self.model, options=full)
        optim = get_optimizer_state_dict(self.model, self.optimizers.optimizer, options=full)
        arrays = {f"param/{k}": _numpy(v) for k, v in params.items()}
        for name, state in optim["state"].items():
            arrays.update({f"optim/{name}/{key}": _numpy(value) for key, value in state.items()})
        return {
            "arrays": arrays,
            "lr": self.optimizers.optimizer.param_groups[0]["lr"],
            "scheduler_epoch": self.schedulers.schedulers[0].last_epoch,
            "loader": self.loader.state_dict()["dataset_state"],
            "step": self.train_state.step,
        }


def _numpy(value) -> np.ndarray:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    # numpy, not tensors: results travel through a multiprocessing queue.
    return value.detach().cpu().numpy().copy()


def assert_same_snapshot(actual: dict, expected: dict, exact: bool = True) -> None:
    assert actual["arrays"].keys() == expected["arrays"].keys()
    for key, value in expected["arrays"].items():
        if exact:
            np.testing.assert_array_equal(actual["arrays"][key], value, err_msg=key)
        else:
            np.testing.assert_allclose(actual["arrays"][key], value, rtol=1e-12, atol=1e-14, err_msg=key)
    for key in ("lr", "scheduler_epoch", "loader", "step"):
        assert actual[key] == expected[key], key


# ------------------------------------------------------------------------------------------------------------------
# Plain-data encoding


def test_plain_encoding_round_trips_exactly():
    value = {
        "ints": [1, -2, 2**70], "float": 0.1, "neg_zero": -0.0, "inf": float("inf"), "none": None, "flag": True,
        "tuple": (1, (2, "a")), "int_keys": {3: "three", (1, 2): "pair"}, "bytes": b"\x00\xff",
        "looks_tagged": {"__tuple__": [1, 2]}, "nested": {"a": [{"b": ()}]},
        "generator": torch.Generator().manual_seed(3).get_state(), "floats": torch.tensor([[0.1, -1e300]], dtype=torch.float64),
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
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-1", "step-2"]


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
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode:
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
        key: untouched[key] for key in ("lr", "scheduler_epoch", "loader", "step")}
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
    assert "holds model flavor debugmodel (28,832 parameters); this job uses model flavor debugmodel (41,184 " \
        in message
    assert "\n" not in message and "model.layers" not in message
    assert len(message) - message.count(str(tmp_path)) * len(str(tmp_path)) < 300
    # Weights only (the optimizer may differ), but of another model: one line too.
    warm = Trainer(job(str(tmp_path), steps=1, folder="warm", initial_load_path=str(tmp_path / "checkpoint")))
    warm.checkpoint.model_parts = [Transformer(replace(TINY, n_layers=3))]
    with pytest.raises(UserError, match=r"holds model flavor debugmodel \(28,832 parameters\); this job uses model "
                                        r"flavor debugmodel \(41,184 parameters\); point checkpoint.initial_load_path"):
        warm.checkpoint.load()
    # A checkpoint without job facts (written before they existed) is judged by its keys, summarised in one line.
    monkeypatch.setattr(CheckpointManager, "_read_facts", lambda self, path, entries: None)
    with pytest.raises(UserError, match=r"does not match this job \(\d+ entries missing: model\.layers\.2\.\S+, "
                                        r"model\.layers\.2\.\S+ and \d+ more\)") as caught:
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


def test_planted_metadata_is_refused(tmp_path):
    folder, marker = tmp_path / "ckpt", str(tmp_path / "code_ran")
    dcp.save({"x": torch.ones(2)}, checkpoint_id=str(folder))
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(pickle.UnpicklingError, match="posix.mkdir|os.mkdir"):
        SafeFileSystemReader(str(folder)).read_metadata()
    assert not os.path.exists(marker)


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

_KILLED_SAVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from tests import test_checkpoint as t
    from torchtitan.checkpoint import manager as ckpt

    class SlowWriter(ckpt.FileSystemWriter):
        # Writes the data files of the save, then stalls before DCP writes the metadata: killed here.
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            print("WROTE_DATA", flush=True)
            time.sleep(600)
            return future

    trainer = t.Trainer(t.job({folder!r}, steps=4, interval=2, async_mode={mode!r}))
    trainer.run(2)
    print("SAVED_2", flush=True)
    ckpt.FileSystemWriter = SlowWriter
    trainer.run(4)
    """
)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path, mode):
    script = _KILLED_SAVER.format(repo=REPO, folder=str(tmp_path), mode=mode)
    with processes.started([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) as child:
        output = processes.LineReader(child.stdout)
        output.wait_for(lambda lines: bool(lines) and lines[-1].startswith("WROTE_DATA"), timeout=300)
        # With async saves the background thread is writing; a synchronous save blocks the loop. Leaving the
        # block SIGKILLs it.
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


def _save_then_resume(rank, world_size, folders):
    """Per async mode: train 4 steps saving at 2 and 4, then a fresh job in the same ranks resumes from step 2."""
    results = {}
    for mode, folder in folders.items():
        losses, at_step_2 = _train_and_save(folder, mode)
        loaded, resumed_losses = _resume(folder, 2)
        results[mode] = {"losses": losses, "at_step_2": at_step_2, "loaded": loaded, "resumed": resumed_losses}
    return results


def _resume_worker(rank, world_size, folder, load_step):
    return _resume(folder, load_step)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One 2-rank launch (process start-up dominates the cost) serving the tests below."""
    folders = {mode: str(tmp_path_factory.mktemp(mode)) for mode in ("disabled", "async")}
    return folders, run_workers(_save_then_resume, world_size=2, args=(folders,))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_save_on_two_ranks_resumes_exactly_on_two(two_rank_runs, mode):
    folders, results = two_rank_runs
    assert sorted(os.listdir(os.path.join(folders[mode], "checkpoint"))) == ["step-2", "step-4"]
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


def test_save_on_two_ranks_loads_in_one_unsharded_process(two_rank_runs):
    folders, results = two_rank_runs
    _assert_resharded([_resume(folders["disabled"], 2)], results[0]["disabled"])


def test_save_on_two_ranks_reshards_to_three(two_rank_runs):
    folders, results = two_rank_runs
    _assert_resharded(run_workers(_resume_worker, world_size=3, args=(folders["disabled"], 2)), results[0]["disabled"])
