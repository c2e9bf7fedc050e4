"""Suite-wide fixtures: one short debug-model run shared by the modules that read it, and the check that no process
started by the tests outlives the suite; the order in which the suite's files start."""

from pathlib import Path

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


# The files that start first, in this order; the others follow, those with more tests first (pytest-xdist's own
# order, which the README's command turns off: --no-loadscope-reorder). Each of the three workers takes the next file
# as it nears the end of its own. So the two compiled layout-matrix files (about 5 minutes of a core each on a 2-core
# machine with inductor's cache empty) start early, the files that mostly wait (the GPU check's runner on made-up
# hanging steps, the sweep's parallel runs, the Slurm cluster's jobs) run beside matrix launches of 2-4 ranks, which
# use the core a waiting worker leaves idle, and the rest follow longest first, so that the last files to end are
# short. Three workers on two cores keep both busy (a worker waiting on a subprocess leaves its core to the others):
# measured with --junitxml and vmstat on the 2-core machine, 0.8% idle against 7% with two workers.
FIRST = (
    "optim/test_layout_matrix_float32.py",
    "tools/test_gpu_check.py",
    "study/test_sweep_search.py",
    "optim/test_layout_matrix_torchao.py",
    "study/test_slurm.py",
    "optim/test_adam_mini_lowprec.py",
    "optim/test_layout_matrix.py",
    "estimation/test_estimation.py",
    "checkpoint/test_resume.py",
    "study/test_slurm_chaos.py",
    "training/test_train_optimizers.py",
    "optim/test_optim_builder.py",
    "study/test_sweep.py",
    "training/test_preemption.py",
    "training/test_train.py",
    "study/test_verdict.py",
    "optim/test_adam_mini_distributed.py",
    "study/test_scale.py",
    "data/test_validation.py",
    "optim/test_layout_matrix_compiled.py",
)


def pytest_collection_modifyitems(items):
    """``items`` grouped by file, the files of ``FIRST`` first in its order, then the others by their number of
    tests, most first (ties in collection order)."""
    tests = Path(__file__).parent
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.path.relative_to(tests).as_posix(), []).append(item)
    rank = {name: i for i, name in enumerate(FIRST)}
    order = sorted(files, key=lambda name: (rank.get(name, len(FIRST)), -len(files[name])))
    items[:] = [item for name in order for item in files[name]]
