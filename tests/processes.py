"""Start train.py, torchrun or any other command from a test, and end every process it started, whatever happens.

torchrun starts each rank in a process session of its own, so killing torchrun's process group misses the ranks,
and a rank that outlives its parent is re-parented away from the tree. So every process started here carries an
environment mark (``TORCHTITAN_TEST_RUN=<suite id>.<launch>``, inherited by all its descendants); when the test is
done with it (success, failure or timeout), its whole tree, plus any process still carrying the mark, is SIGKILLed
and waited for. ``tests/conftest.py`` checks at the end of the suite that no marked process is left.

Usage::

    result = run([sys.executable, "train.py", ...], timeout=600)          # a CompletedProcess (text)
    with started(command, stdout=subprocess.PIPE, text=True) as child:    # a Popen, ended on leaving the block
        lines = LineReader(child.stdout)
        lines.wait_for(lambda line: line.startswith("READY"), timeout=300)
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

from torchtitan.distributed.process_tree import descendants

MARK = "TORCHTITAN_TEST_RUN"
# One id per test session (the pytest process); each launch adds ".<n>".
SUITE = f"{os.getpid()}-{secrets.token_hex(3)}"
_launches = itertools.count(1)


def _environ_mark(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:  # gone, or not ours
        return None
    prefix = MARK.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def marked(prefix: str = SUITE) -> list[int]:
    """Live processes (other than this one) whose mark is ``prefix`` or starts with ``prefix + '.'``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        mark = _environ_mark(int(name))
        if mark is not None and (mark == prefix or mark.startswith(prefix + ".")) and _alive(int(name)):
            found.append(int(name))
    return found


def left_by_ended_suites() -> list[int]:
    """Live marked processes whose test session (the pytest process named in the mark) is gone, e.g. killed hard."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        mark = _environ_mark(int(name))
        suite_pid = mark.split("-", 1)[0] if mark else ""
        if suite_pid.isdigit() and not _alive(int(suite_pid)) and _alive(int(name)):
            found.append(int(name))
    return found


def end_tree(pid: int, mark: str, timeout: float = 30.0) -> None:
    """SIGKILL ``pid``, its descendants and every process marked ``mark``; return once all of them are gone."""
    deadline = time.monotonic() + timeout
    while True:
        # Descendants first collected, then killed: a killed parent re-parents its children out of the tree.
        doomed = {pid, *descendants(pid), *marked(mark)}
        doomed = {p for p in doomed if _alive(p)}
        if not doomed:
            return
        for victim in doomed:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(doomed)} survived SIGKILL for {timeout} s")
        time.sleep(0.05)


@contextmanager
def started(command: Sequence[str], env: Optional[dict[str, str]] = None, **popen_kwargs) -> Iterator[subprocess.Popen]:
    """Popen ``command`` in a session of its own, marked; on leaving the block its whole tree is ended."""
    mark = f"{SUITE}.{next(_launches)}"
    environment = {**(os.environ if env is None else env), MARK: mark}
    child = subprocess.Popen(list(command), env=environment, start_new_session=True, **popen_kwargs)
    child.mark = mark
    try:
        yield child
    finally:
        end_tree(child.pid, mark)
        child.wait()
        for stream in (child.stdout, child.stderr, child.stdin):
            if stream is not None:
                stream.close()


def run(
    command: Sequence[str], timeout: float, env: Optional[dict[str, str]] = None, cwd=None
) -> subprocess.CompletedProcess:
    """Run ``command`` until it exits (text output captured); on timeout fail with its output's tail.

    The output is read on threads and collected after the tree is ended: a leftover grandchild holding the pipes
    open can delay neither the result nor the failure.
    """
    with started(command, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        readers = [_Collector(child.stdout), _Collector(child.stderr)]
        try:
            child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        end_tree(child.pid, child.mark)
        stdout, stderr = (reader.result() for reader in readers)
    if timed_out:
        raise AssertionError(
            f"{' '.join(map(str, command[:4]))} ... did not finish within {timeout} s:\n{(stdout + stderr)[-4000:]}"
        )
    return subprocess.CompletedProcess(list(command), child.returncode, stdout, stderr)


class _Collector:
    def __init__(self, stream) -> None:
        self._chunks: list[str] = []
        self._thread = threading.Thread(target=lambda: self._chunks.extend(iter(stream.readline, "")), daemon=True)
        self._thread.start()

    def result(self) -> str:
        self._thread.join(timeout=60)  # every writer is dead by now, so the stream is at its end
        return "".join(self._chunks)


class LineReader:
    """Reads a text stream on a thread, so that waiting for a line has a deadline even when nothing is printed."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        try:
            for line in stream:
                self._queue.put(line)
        except ValueError:  # the stream was closed under us
            pass
        self._queue.put(None)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> None:
        """Block until ``predicate(lines so far)`` holds; AssertionError (with the output) at end of output or
        timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(self.lines):
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no expected output within {timeout} s:\n{''.join(self.lines[-100:])}") from None
            if line is None:
                raise AssertionError(f"the process ended before the expected output:\n{''.join(self.lines[-100:])}")
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)
