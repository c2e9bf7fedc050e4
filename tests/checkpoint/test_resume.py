"""End to end: ``train.py`` on the debug model resumes exactly, reshards across world sizes, and survives SIGKILL.

One straight 10-step run on 2 ranks (FSDP, float64, global batch 6) is the reference. From its step-5 checkpoint:
- a run on 2 ranks is SIGKILLed while saving step 8; the next start ignores and removes the half-written save,
  resumes from step 5 (async saves) and matches the reference loss for loss and, at step 10, tensor for tensor;
- a run on 3 ranks (local batch 2) resumes with the data dealt to other readers, every one starting from the
  furthest position a reader of the 2-rank run reached (fewer readers than saved, and the rule itself, are proven
  in-process by tests/data/test_datasets.py; one process loading a 2-rank checkpoint by test_checkpoint.py).
From the same step-5 checkpoint, a run under ``torchrun --max-restarts 1`` whose rank 1 dies after step 7 is
restarted by torchrun (the new group starts on the agent's store, which outlived the dead one: ``init_distributed``
scopes each attempt's keys), resumes from step 5 again and matches the reference too: a killed worker costs only the
steps since the last checkpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from tests import processes
from tests.distributed import launch_env
from tests.helpers import (
    DEBUG_RUN,
    KILL_RANK_ONCE,
    ROOT,
    STALL_IN_SAVE,
    by_step,
    metric_rows,
    read_checkpoint,
    restartable_command,
    run_dirs,
    train,
    train_command,
)
from torchtitan.checkpoint import decode_plain
from torchtitan.datasets.hf_datasets import furthest_position

# DCP says it assumes one process whenever no process group exists; so do we.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

GLOBAL_BATCH = 6
STEPS = 10
MIDDLE = 5  # the reference saves here and at STEPS; the resumed runs start here
KILLED_AT = 8  # a save of the killed run (interval 4, resumed from MIDDLE)
DIES_AFTER = 7  # a rank of the restarted run dies after this step, two steps past the step-MIDDLE checkpoint


def resume_args(world_size: int, *extra: str) -> list[str]:
    return [
        *DEBUG_RUN,
        "--training.batch_size",
        str(GLOBAL_BATCH // world_size),
        "--training.steps",
        str(STEPS),
        "--training.param_dtype",
        "float64",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        str(MIDDLE),
        "--checkpoint.keep_latest_k",
        "0",
        *extra,
    ]


def run(dump_folder: str, world_size: int, *extra: str) -> str:
    """train.py to the end, on CPU whatever the machine (runs on 1, 2 and 3 ranks are compared number for number, so
    they must all use the same device kind); its output."""
    proc = train(dump_folder, *extra, nproc=world_size, cpu=True, base=resume_args(world_size))
    return proc.stdout + proc.stderr


def losses(dump_folder: str) -> dict[int, float]:
    """The loss of each step of the latest run in ``dump_folder``."""
    return by_step(metric_rows(run_dirs(dump_folder)[-1]))


def checkpoint_folder(dump_folder: str) -> str:
    return os.path.join(dump_folder, "checkpoint", "AdamW")  # the default folder of the debug config's optimizer


def checkpoint_path(dump_folder: str, step: int) -> str:
    return os.path.join(checkpoint_folder(dump_folder), f"step-{step}")


def copy_checkpoint(source_dump: str, step: int, target_dump: str) -> None:
    shutil.copytree(checkpoint_path(source_dump, step), checkpoint_path(target_dump, step))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """STEPS steps straight on 2 ranks, saving at steps MIDDLE and STEPS."""
    dump = str(tmp_path_factory.mktemp("straight"))
    run(dump, 2)
    assert sorted(os.listdir(checkpoint_folder(dump))) == sorted([f"step-{MIDDLE}", f"step-{STEPS}"])
    straight = losses(dump)
    assert sorted(straight) == list(range(1, STEPS + 1))
    return dump, straight


def train_until_killed_mid_save(dump_folder: str) -> str:
    """Run train.py on 2 ranks, SIGKILL every process once both ranks are inside a save; its output."""
    args = [*resume_args(2, "--checkpoint.interval", str(KILLED_AT - MIDDLE + 1)), "--job.dump_folder", dump_folder]
    command = train_command([str(ROOT / "train.py"), *args], 2, script=STALL_IN_SAVE)
    # Leaving the block SIGKILLs torchrun and both ranks (each in a session of its own), with no chance to clean up.
    with processes.started(
        command,
        cwd=ROOT,
        env=launch_env(cpu=True, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as child:
        output = processes.LineReader(child.stdout)
        output.wait_for(lambda lines: sum(line.startswith("STALLED") for line in lines) == 2, timeout=600)
    return output.text()


def test_sigkill_mid_save_then_resume_matches_straight_run_bit_for_bit(reference, tmp_path):
    straight_dump, straight = reference
    dump = str(tmp_path / "resumed")
    copy_checkpoint(straight_dump, MIDDLE, dump)

    killed = train_until_killed_mid_save(dump)
    assert f"resumed from step {MIDDLE}" in killed
    assert losses(dump) == {s: straight[s] for s in range(MIDDLE + 1, KILLED_AT + 1)}
    folder = checkpoint_folder(dump)
    half_written = [name for name in os.listdir(folder) if name.startswith(f".step-{KILLED_AT}.tmp-")]
    assert sorted(os.listdir(folder)) == sorted([f"step-{MIDDLE}", *half_written]) and len(half_written) == 1

    output = run(dump, 2, "--checkpoint.async_mode", "async")
    assert "removed 1 incomplete save(s)" in output and f"resumed from step {MIDDLE}" in output
    assert losses(dump) == {s: straight[s] for s in range(MIDDLE + 1, STEPS + 1)}
    assert sorted(os.listdir(folder)) == sorted([f"step-{MIDDLE}", f"step-{STEPS}"])
    assert_same_checkpoint(dump, straight_dump, STEPS)


def assert_same_checkpoint(dump_folder: str, expected_dump: str, step: int) -> None:
    expected = read_checkpoint(checkpoint_path(expected_dump, step))
    actual = read_checkpoint(checkpoint_path(dump_folder, step))
    assert actual.keys() == expected.keys()
    assert any(name.startswith("optimizer.state.") for name in expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_a_rank_killed_under_max_restarts_costs_only_the_steps_since_the_checkpoint(reference, tmp_path):
    straight_dump, straight = reference
    dump = str(tmp_path / "restarted")
    copy_checkpoint(straight_dump, MIDDLE, dump)
    command = restartable_command(KILL_RANK_ONCE, str(ROOT / "train.py"), *resume_args(2), "--job.dump_folder", dump)
    env = launch_env(cpu=True, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", KILL_AT_STEP=str(DIES_AFTER))
    proc = processes.run(command, timeout=600, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert f"KILLED rank 1 at step {DIES_AFTER}" in output and f"resumed from step {MIDDLE}" in output

    killed, restarted = (by_step(metric_rows(run)) for run in run_dirs(dump))
    assert killed == {s: straight[s] for s in range(MIDDLE + 1, DIES_AFTER + 1)}
    assert restarted == {s: straight[s] for s in range(MIDDLE + 1, STEPS + 1)}
    assert sorted(os.listdir(checkpoint_folder(dump))) == sorted([f"step-{MIDDLE}", f"step-{STEPS}"])
    assert_same_checkpoint(dump, straight_dump, STEPS)


def data_state(dump_folder: str, step: int) -> dict:
    return decode_plain(read_checkpoint(checkpoint_path(dump_folder, step))["dataloader"].numpy().tobytes())


@pytest.mark.parametrize("world_size", [3])
def test_resume_on_another_world_size_continues_from_the_furthest_reader(reference, tmp_path, world_size):
    straight_dump, _ = reference
    dump = str(tmp_path / f"world{world_size}")
    copy_checkpoint(straight_dump, MIDDLE, dump)

    output = run(dump, world_size)
    assert f"resumed from step {MIDDLE}" in output
    assert "every reader continues from the furthest saved position" in output
    resumed = losses(dump)
    assert sorted(resumed) == list(range(MIDDLE + 1, STEPS + 1))
    # Model and optimizer reshard exactly (tests/checkpoint/test_checkpoint.py); the data is dealt to other readers,
    # so the losses differ from the straight run's, but every reader went on from the furthest saved position.
    saved, after = data_state(straight_dump, MIDDLE), data_state(dump, STEPS)
    assert saved["layout"] == {"dp_degree": 2, "workers": 1, "by_shard": False}  # one file: documents are dealt
    assert after["layout"] == {"dp_degree": world_size, "workers": 1, "by_shard": False}
    assert len(after["readers"]) == world_size and saved["fingerprint"] == after["fingerprint"] is not None
    start = furthest_position(list(saved["readers"].values()))
    assert all((p["epoch"], p["doc_index"]) >= (start["epoch"], start["doc_index"]) for p in after["readers"].values())
    # The loop's position and the lr schedule are world-size independent; the loss-spike window it carries holds
    # the losses, which follow the data (one per step of the run, the resumed ones too).
    expected = read_checkpoint(checkpoint_path(straight_dump, STEPS))
    actual = read_checkpoint(checkpoint_path(dump, STEPS))
    for name in ("train_state", "lr_schedulers"):
        got, want = (decode_plain(c[name].numpy().tobytes()) for c in (actual, expected))
        if name == "train_state":
            assert len(got.pop("loss_spikes")["history"]) == len(want.pop("loss_spikes")["history"]) == STEPS
        assert got == want, name
