"""train.py's first rank records how the run ended in its dump folder, since torchrun reports any worker's failure
as 1: the sweep reads that record to tell a diverged run from a crash."""

from __future__ import annotations

from tests.helpers import train
from torchtitan.errors import DIVERGENCE_EXIT_CODE, read_exit_record


def test_a_diverging_two_process_run_records_exit_3_where_torchrun_says_1(tmp_path):
    diverge = ["--optimizer.lr", "1e6", "--training.max_norm", "0", "--training.max_skipped_steps", "0"]
    result = train(tmp_path, *diverge, "--training.steps", "3", nproc=2, cpu=True, check=False)
    assert result.returncode == 1, result.stderr[-3000:]  # torchrun's code for a worker's exit 3
    record = read_exit_record(tmp_path)
    assert record["exit_code"] == DIVERGENCE_EXIT_CODE
    assert record["message"].startswith("error: training diverged: the loss or gradients became non-finite")
