"""Suite-wide fixtures: one short debug-model run shared by the modules that read it, and the check that no process
started by the tests outlives the suite."""

import pytest

from tests.helpers import train
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


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory):
    """train.py with tests/helpers.py's DEBUG_RUN (AdamW, one process), profiling every 2nd step, collecting garbage
    every 3rd and exporting Hugging Face weights at the end (which change no number it logs), started on first use:
    its dump folder and the finished process."""
    dump = tmp_path_factory.mktemp("debug_run")
    return dump, train(
        dump,
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--training.gc_freq",
        "3",
        "--checkpoint.last_save_in_hf",
    )
