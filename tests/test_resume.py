"""End to end: ``train.py`` on the debug model resumes exactly, reshards across world sizes, and survives SIGKILL.

One straight 10-step run on 2 ranks (FSDP, float64, global batch 6) is the reference. From its step-5 checkpoint:
- a run on 2 ranks is SIGKILLed while saving step 8; the next start ignores and removes the half-written save,
  resumes from step 5 (async saves) and matches the reference loss for loss and, at step 10, tensor for tensor;
- runs on 1 and 3 ranks (local batch 6 and 2: the same global batch, so the same data) continue the reference's
  losses within float64 summation-order noise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests import processes
from tests.distributed import launch_env
from torchtitan.checkpoint import SafeFileSystemReader, SafeLoadPlanner, decode_plain

# DCP says it assumes one process whenever no process group exists; so do we.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
GLOBAL_BATCH = 6
STEPS = 10
MIDDLE = 5  # the reference saves here and at STEPS; the resumed runs start here
KILLED_AT = 8  # a save of the killed run (interval 4, resumed from MIDDLE)
LOSS_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)")
TIMEOUT = 600


def train_args(dump_folder: str, world_size: int, *extra: str) -> list[str]:
    return [
        "--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
        "--job.dump_folder", dump_folder,
        "--training.seq_len", "32",
        "--training.batch_size", str(GLOBAL_BATCH // world_size),
        "--training.steps", str(STEPS),
        "--training.param_dtype", "float64",
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", str(MIDDLE),
        "--checkpoint.keep_latest_k", "0",
        *extra,
    ]


def command(script: str, world_size: int, args: list[str]) -> list[str]:
    if world_size == 1:
        return [sys.executable, script, *args]  # no process group: the checkpoint loads into a plain model
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
            script, *args]


def environment() -> dict[str, str]:
    # On CPU whatever the machine: runs on 1, 2 and 3 ranks are compared number for number, so they must all use
    # the same device kind.
    return launch_env(cpu=True, PYTHONUNBUFFERED="1")


def train(dump_folder: str, world_size: int, *extra: str) -> str:
    """Run train.py to the end; its output."""
    result = processes.run(command(TRAIN, world_size, train_args(dump_folder, world_size, *extra)), cwd=REPO,
                           env=environment(), timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


def losses(output: str) -> dict[int, str]:
    """Loss of each step as printed by rank 0 (8 decimals)."""
    return {int(step): loss for step, loss in LOSS_LINE.findall(output)}


def checkpoint_folder(dump_folder: str) -> str:
    return os.path.join(dump_folder, "checkpoint", "AdamW")  # the default folder of the debug config's optimizer


def checkpoint_path(dump_folder: str, step: int) -> str:
    return os.path.join(checkpoint_folder(dump_folder), f"step-{step}")


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (DCP reshards the saved shards into full tensors)."""
    reader = SafeFileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in entries.items() if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    return state


def copy_checkpoint(source_dump: str, step: int, target_dump: str) -> None:
    shutil.copytree(checkpoint_path(source_dump, step), checkpoint_path(target_dump, step))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """STEPS steps straight on 2 ranks, saving at steps MIDDLE and STEPS."""
    dump = str(tmp_path_factory.mktemp("straight"))
    output = train(dump, 2)
    assert sorted(os.listdir(checkpoint_folder(dump))) == sorted([f"step-{MIDDLE}", f"step-{STEPS}"])
    straight = losses(output)
    assert sorted(straight) == list(range(1, STEPS + 1))
    return dump, straight


_STALLING_TRAIN = textwrap.dedent(
    """
    import os, runpy, sys, time
    sys.path.insert(0, {repo!r})
    import torchtitan.checkpoint.manager as checkpoint

    class StallingWriter(checkpoint.FileSystemWriter):
        # Writes this rank's data files, then stalls before the metadata is written: the SIGKILL lands mid-save.
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            print("STALLED rank", os.environ.get("RANK"), flush=True)
            time.sleep(3600)
            return future

    checkpoint.FileSystemWriter = StallingWriter
    sys.argv = [{train!r}] + sys.argv[1:]
    runpy.run_path({train!r}, run_name="__main__")
    """
)


def train_until_killed_mid_save(dump_folder: str, tmp_path) -> str:
    """Run train.py on 2 ranks, SIGKILL every process once both ranks are inside a save; its output."""
    script = tmp_path / "stalling_train.py"
    script.write_text(_STALLING_TRAIN.format(repo=REPO, train=TRAIN))
    args = train_args(dump_folder, 2, "--checkpoint.interval", str(KILLED_AT - MIDDLE + 1))
    # Leaving the block SIGKILLs torchrun and both ranks (each in a session of its own), with no chance to clean up.
    with processes.started(command(str(script), 2, args), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) as child:
        output = processes.LineReader(child.stdout)
        output.wait_for(lambda lines: sum(line.startswith("STALLED") for line in lines) == 2, timeout=TIMEOUT)
    return output.text()


def test_sigkill_mid_save_then_resume_matches_straight_run_bit_for_bit(reference, tmp_path):
    straight_dump, straight = reference
    dump = str(tmp_path / "resumed")
    copy_checkpoint(straight_dump, MIDDLE, dump)

    killed = train_until_killed_mid_save(dump, tmp_path)
    assert f"resumed from step {MIDDLE}" in killed
    assert losses(killed) == {s: straight[s] for s in range(MIDDLE + 1, KILLED_AT + 1)}
    folder = checkpoint_folder(dump)
    half_written = [name for name in os.listdir(folder) if name.startswith(f".step-{KILLED_AT}.tmp-")]
    assert sorted(os.listdir(folder)) == sorted([f"step-{MIDDLE}", *half_written]) and len(half_written) == 1

    output = train(dump, 2, "--checkpoint.async_mode", "async")
    assert "removed 1 incomplete save(s)" in output and f"resumed from step {MIDDLE}" in output
    assert losses(output) == {s: straight[s] for s in range(MIDDLE + 1, STEPS + 1)}
    assert sorted(os.listdir(folder)) == sorted([f"step-{MIDDLE}", f"step-{STEPS}"])

    expected = read_checkpoint(checkpoint_path(straight_dump, STEPS))
    actual = read_checkpoint(checkpoint_path(dump, STEPS))
    assert actual.keys() == expected.keys()
    assert any(name.startswith("optimizer.state.") for name in expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_on_another_world_size_continues_the_losses(reference, tmp_path, world_size):
    straight_dump, straight = reference
    dump = str(tmp_path / f"world{world_size}")
    copy_checkpoint(straight_dump, MIDDLE, dump)

    output = train(dump, world_size)
    assert f"resumed from step {MIDDLE}" in output
    resumed = losses(output)
    assert sorted(resumed) == list(range(MIDDLE + 1, STEPS + 1))
    for step in resumed:
        # float64 with a different number of shards: only the summation order differs (~1e-15 relative).
        assert float(resumed[step]) == pytest.approx(float(straight[step]), abs=2e-8), step
    # The loop's position and the data-loader position are world-size independent.
    expected = read_checkpoint(checkpoint_path(straight_dump, STEPS))
    actual = read_checkpoint(checkpoint_path(dump, STEPS))
    for name in ("train_state", "dataloader", "lr_schedulers"):
        assert decode_plain(actual[name].numpy().tobytes()) == decode_plain(expected[name].numpy().tobytes()), name
