"""benchmarks/bench_health.py prints health's overhead as one ratio, at the default frequency unless told."""

from __future__ import annotations

import re

from benchmarks import bench_health
from torchtitan.config.job_config import JobConfig


def test_bench_health_prints_one_ratio_at_the_default_frequency(capsys):
    bench_health.main(["--rounds", "1", "--device", "cpu", "--training.batch_size", "1", "--training.seq_len", "32"])
    out = capsys.readouterr().out
    default = JobConfig().metrics.health_freq
    match = re.search(rf"step-time overhead at health_freq {default}: ratio (\d+\.\d+)$", out.strip())
    assert match, out
    assert 0.5 < float(match.group(1)) < 2.0  # a ratio near 1 (one round on a busy machine is noisy)
