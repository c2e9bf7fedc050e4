"""Suite-wide checks: no process started by the tests outlives the suite."""

import pytest

from tests.processes import SUITE, end_tree, left_by_ended_suites, marked


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    # Leftovers of an earlier session that was killed before it could clean up would slow this one down.
    for pid in left_by_ended_suites():
        end_tree(pid, f"{SUITE}.none")
    yield
    left = marked(SUITE)
    for pid in left:
        end_tree(pid, SUITE)
    assert not left, f"processes started by the tests were still alive at the end of the suite: {left}"
