"""tests/processes.py ends whole process trees: a grandchild in a session of its own (as torchrun starts its ranks),
an orphaned grandchild, and a tree whose command timed out."""

import re
import sys

import pytest

from tests.processes import LineReader, _alive, run, started

# Starts a grandchild in its own session (like torchrun's ranks), prints its pid, then sleeps or exits.
TREE = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
    "print('GRANDCHILD', g.pid, flush=True)\n"
    "if sys.argv[1] == 'sleep':\n"
    "    time.sleep(600)\n"
)


def grandchild(text: str) -> int:
    return int(re.search(r"GRANDCHILD (\d+)", text).group(1))


def test_leaving_the_block_ends_a_grandchild_in_its_own_session():
    import subprocess

    with started([sys.executable, "-c", TREE, "sleep"], stdout=subprocess.PIPE, text=True) as child:
        lines = LineReader(child.stdout)
        lines.wait_for(lambda seen: any("GRANDCHILD" in line for line in seen), timeout=120)
        pid = grandchild(lines.text())
        assert _alive(pid)
    assert not _alive(pid) and child.returncode is not None


def test_an_orphaned_grandchild_is_found_by_its_mark():
    result = run([sys.executable, "-c", TREE, "exit"], timeout=120)
    assert result.returncode == 0
    assert not _alive(grandchild(result.stdout))


def test_a_timeout_ends_the_tree_and_reports_the_output():
    with pytest.raises(AssertionError, match="did not finish within 2 s") as failure:
        run([sys.executable, "-c", TREE, "sleep"], timeout=2)
    assert not _alive(grandchild(str(failure.value)))


def test_leftovers_of_a_session_that_died_are_found():
    import os
    import subprocess
    import time

    from tests.processes import MARK, end_tree, left_by_ended_suites

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_suite = f"{ended.stdout.strip()}-test"
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, MARK: f"{dead_suite}.1"},
        start_new_session=True,
    )
    try:
        # Until the child has exec'd, /proc shows the parent's environment (without the mark): wait for it.
        deadline = time.monotonic() + 30
        while orphan.pid not in left_by_ended_suites() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orphan.pid in left_by_ended_suites()
    finally:
        end_tree(orphan.pid, dead_suite)
        orphan.wait()
    assert orphan.pid not in left_by_ended_suites()
