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
