"""Run a test function in N gloo processes on this machine and collect what each rank returns.

Usage::

    def _check(rank, world_size, scale):          # module-level, so it can be pickled
        ...                                         # torch.distributed is initialised (gloo) here
        return some_picklable_result

    results = run_workers(_check, world_size=2, args=(3.0,))   # [result of rank 0, result of rank 1]

A failure in any rank re-raises in the test process with that rank's traceback.

Ranks are forked from a fork server that has imported torch, torchtitan and the test helpers once for this test
process (multiprocessing's "forkserver" start method, with those modules preloaded), not started afresh: a fresh
interpreter importing them is seconds of CPU per rank, most of a small world's time on a 2-core machine. The fork
server runs no test code and starts no thread, so every rank begins as a fresh process would, with those modules
imported: its environment is the caller's at ``run_workers`` (set before ``fn`` runs), its command-line state that of
the test process. Only what those modules read from the environment when imported comes from the test session's
environment at its start, whatever a test has changed since. The fork server ends with the test process.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import pickle
import queue as queue_module
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.processes import SUITE, end_tree


def free_port() -> int:
    """A TCP port nobody listens on right now (e.g. an endpoint that must refuse connections)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports once; each rank then imports only what else its function needs.
PRELOADED = ["tests.helpers"]
# The test session's environment before any test changed it: the fork server's, whichever test starts it.
_SESSION_ENVIRON = dict(os.environ)


def _context():
    """The "forkserver" context, its server started (once per test process) with ``PRELOADED`` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENVIRON)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)
    return ctx


def _worker(
    rank: int, world_size: int, store_file: str, fn: Callable, args: Sequence[Any], queue, environ: dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the fork server's
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        # A file rendezvous: no TCP port to pick, so no race with other processes on the machine for a free one.
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
        # Plain pickle copies tensors by value; the queue's own pickler would share memory that dies with this process.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, args: Sequence[Any] = (), timeout: float = 300.0) -> list[Any]:
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="run_workers-")
    store_file = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, store_file, fn, tuple(args), queue, dict(os.environ)))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        # Drain before joining: a rank blocks on exit until its (possibly large) result has been read.
        while len(results) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"a rank of {fn.__name__} died with exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test {fn.__name__} did not finish within {timeout} s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {fn.__name__} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.pid is not None:
                # The rank and anything it started (e.g. compile workers), even when the rank itself has exited.
                end_tree(p.pid, mark=f"{SUITE}.none")
            p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------------------------------------------
# train.py subprocesses on a machine with or without GPUs
#
# train.py trains on CUDA (NCCL) whenever a GPU is visible, one GPU per rank. A test that starts more ranks than the
# machine has GPUs, or that compares its numbers with CPU float64 results, hides the GPUs from its processes so
# that they run on CPU with gloo instead; everything else runs where a researcher trains.


def uses_cuda(nproc: int = 1, cpu: bool = False) -> bool:
    """Whether a train.py run of ``nproc`` ranks started with ``launch_env(nproc, cpu)`` trains on CUDA."""
    return not cpu and torch.cuda.is_available() and torch.cuda.device_count() >= nproc


def launch_env(nproc: int = 1, cpu: bool = False, **extra: str) -> dict[str, str]:
    """Environment for a train.py subprocess of ``nproc`` ranks (``cpu``: always on CPU)."""
    # PYTHON: the interpreter run_llama_train.sh trains with, this one whatever PATH finds first.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **extra}
    if not uses_cuda(nproc, cpu):
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def memory_tag(nproc: int = 1, cpu: bool = False) -> str:
    """The peak-memory tag train.py logs on the device such a run uses."""
    return "memory/max_allocated(GiB)" if uses_cuda(nproc, cpu) else "memory/rss(GiB)"
