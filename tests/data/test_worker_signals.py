"""Data loader workers leave the stop signals to the training process, yet end when the process whose loader
started them terminates them, under every start method: fork, spawn and forkserver (Python 3.14's default, where a
worker's parent is the fork server, not the trainer)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.training.preemption import worker_init


class Pids(IterableDataset):
    """Its worker's pid, over and over."""

    def __iter__(self):
        while True:
            yield torch.tensor(os.getpid())
            time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet joined) counts as ended.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_ignore_others_stop_signals_and_end_on_their_owners(method):
    loader = DataLoader(
        Pids(), batch_size=None, num_workers=1, multiprocessing_context=method, worker_init_fn=worker_init()
    )
    batches = iter(loader)
    try:
        worker = int(next(batches))
        assert worker != os.getpid()
        # Slurm signals every process of a job step: the worker keeps serving batches.
        for sig in ("USR1", "TERM"):
            subprocess.run(["kill", f"-{sig}", str(worker)], check=True)
        assert not wait_for(lambda: not alive(worker), 1.0)
        assert int(next(batches)) == worker
        # The owner's terminate ends it (what multiprocessing does to its daemonic children at exit).
        os.kill(worker, signal.SIGTERM)
        try:
            ended = wait_for(lambda: not alive(worker), 10.0)
        except RuntimeError as e:  # the loader's SIGCHLD handler: its worker ended by SIGTERM (exit 128 + 15)
            assert f"pid {worker}) exited unexpectedly with exit code 143" in str(e)
            ended = True
        assert ended, f"{method}: the worker ignored its owner's SIGTERM"
    finally:
        del batches  # the loader joins (or terminates) what is left
