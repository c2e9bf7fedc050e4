"""A stop signal mid-training (SIGUSR1, Slurm's warning before a time limit; SIGTERM, its preemption): train.py
finishes the step it is in, saves it whatever the checkpoint interval, exits with PREEMPTED_EXIT_CODE, and the same
command resumes it to losses and a final state equal to an uninterrupted run's, bit for bit. On several ranks a
signal to one rank stops all of them at the same step. (Under Slurm, requeued: tests/study/test_slurm.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from tests import processes
from tests.distributed import launch_env
from tests.helpers import DEBUG_RUN, LOSS, ROOT, by_step, metric_rows, read_checkpoint, run_dirs, train, train_command
from torchtitan.distributed.process_tree import descendants
from torchtitan.errors import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

STEPS = 8
SIGNAL_AFTER = 2  # the signal is sent in this step, where the divergence guard asks (the run waits there for it)
ARGS = [
    "--training.steps",
    str(STEPS),
    "--training.param_dtype",
    "float64",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "100",  # no save but the last: the one at the signal comes from the signal alone
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.loss_spike_factor",
    "1.0001",  # every rise of the loss counts: a spike count that a restart from zero would change
]
SPIKES, TO_MEDIAN = "health/loss_spikes", "health/loss_to_median"


def logged(dump: str, tag: str) -> dict[int, float]:
    """``tag`` at each step over every attempt of the run in ``dump`` (later attempts win)."""
    merged: dict[int, float] = {}
    for run in run_dirs(dump):
        merged.update(by_step(metric_rows(run), tag))
    return merged


def losses(dump: str) -> dict[int, float]:
    """Each step's loss over every attempt of the run in ``dump`` (later attempts win)."""
    return logged(dump, LOSS)


def checkpoint_steps(dump: str) -> list[str]:
    return sorted(os.listdir(os.path.join(dump, "checkpoint", "AdamW")))


def signalled_run(dump: str, sig: int, nproc: int = 1, rank: int = 0, extra: tuple = ()) -> tuple[int, str]:
    """train.py (ARGS and ``extra``) until step SIGNAL_AFTER reaches its divergence guard, then ``sig`` to rank
    ``rank`` only; its exit code and output. The run is held there until the signal reaches it
    (tests/hold_until_stopped.py), so that it stops after that step however fast or slow the machine."""
    args = [os.path.join(dump, "held"), *DEBUG_RUN, *ARGS, *extra, "--job.dump_folder", dump]
    command = train_command(args, nproc, script=str(ROOT / "tests" / "hold_until_stopped.py"))
    env = launch_env(nproc, cpu=True, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("CONFIG_FILE", None)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    with processes.started(command, env=env, cwd=ROOT, **pipes) as child:
        output = processes.LineReader(child.stdout)
        output.wait_for(lambda lines: any(line.strip().endswith("HELD") for line in lines), timeout=300)
        if nproc == 1:  # to every process of the run, data loader workers too, as Slurm signals a job step
            os.killpg(child.pid, sig)
        else:
            os.kill(rank_pid(child.pid, rank), sig)
        code = child.wait(timeout=300)
        output.wait_for(lambda lines: any(line.startswith("preempted: ") for line in lines), timeout=60)
    return code, output.text()


def rank_pid(torchrun: int, rank: int) -> int:
    for pid in descendants(torchrun):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no rank {rank} under torchrun {torchrun}")


def stopped_at(output: str) -> int:
    line = next(line for line in output.splitlines() if line.startswith("preempted: "))
    return int(line.split("after step ")[1].split(",")[0])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> str:
    """The run uninterrupted."""
    dump = str(tmp_path_factory.mktemp("straight"))
    train(dump, *ARGS, cpu=True)
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    return dump


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_signalled_run_saves_exits_and_resumes_bit_for_bit(sig, straight, tmp_path_factory):
    expected = losses(straight)

    dump = str(tmp_path_factory.mktemp("signalled"))
    code, output = signalled_run(dump, sig)
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    step = stopped_at(output)
    assert step == SIGNAL_AFTER  # held there until the signal came
    assert checkpoint_steps(dump) == [f"step-{step}"]  # saved at the signal, off the interval
    assert losses(dump) == {s: expected[s] for s in range(1, step + 1)}

    resumed = train(dump, *ARGS, cpu=True)
    assert f"resumed from step {step}" in resumed.stdout + resumed.stderr
    assert losses(dump) == expected
    # The spike count and its running median go on from the checkpoint, as if the run had never stopped.
    assert logged(dump, SPIKES) == logged(straight, SPIKES) and logged(straight, SPIKES)[STEPS] >= 1
    assert logged(dump, TO_MEDIAN) == logged(straight, TO_MEDIAN)
    final = read_checkpoint(os.path.join(dump, "checkpoint", "AdamW", f"step-{STEPS}"))
    reference = read_checkpoint(os.path.join(straight, "checkpoint", "AdamW", f"step-{STEPS}"))
    assert final.keys() == reference.keys() and any(k.startswith("optimizer.state.") for k in final)
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    dump = str(tmp_path)
    code, output = signalled_run(dump, signal.SIGUSR1, nproc=2, rank=1)
    assert code != 0, output[-3000:]
    step = stopped_at(output)  # rank 0 prints the line: it stopped too, though it had no signal
    assert step == SIGNAL_AFTER
    assert checkpoint_steps(dump) == [f"step-{step}"]
    assert sorted(losses(dump)) == list(range(1, step + 1))
