"""A process and every process it started, found through ``/proc`` (Linux), to be ended together.

Killing a process group misses what started a session or group of its own (torchrun's ranks, a step's commands);
following the parent links of the live tree does not. Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children of all its threads, recursively)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.append(child)
                    todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group (when it leads one) and its descendants, found before any is killed."""
    doomed = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for process in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process, signal.SIGKILL)
