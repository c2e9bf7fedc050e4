"""The memory estimate says what optimizer health holds in host memory per rank: the weights before a measured
step when they fit in metrics.health_snapshot_gib, nothing above it (the 8B model's 32 GiB on one replicated rank)."""

from __future__ import annotations

import dataclasses

import torch

from tests.helpers import job_config, meta_model
from torchtitan.estimation.simulate import health_host_memory
from torchtitan.models.llama import llama3_configs


def test_the_estimate_counts_the_health_snapshot_within_its_limit():
    eight_b = meta_model(dataclasses.replace(llama3_configs["8B"], vocab_size=128256), dtype=torch.float32)
    (note,) = health_host_memory(job_config(), eight_b)  # 32 GiB of weights on a rank that holds them all
    assert "above metrics.health_snapshot_gib 1, so it holds no host copy" in note
    (note,) = health_host_memory(job_config("--metrics.health_snapshot_gib", "40"), eight_b)
    assert note.startswith("optimizer health: 29.9") and "GiB of host memory per rank" in note
    assert health_host_memory(job_config("--metrics.health_freq", "0"), eight_b) == []


def test_the_estimate_bounds_the_logit_measurements_device_memory():
    from torchtitan.estimation.simulate import health_device_memory

    args = llama3_configs["8B"]  # 32 heads of 128; batch 1 x 8192 tokens per rank
    (note,) = health_device_memory(job_config("--training.batch_size", "1", "--training.seq_len", "8192"), args, 1)
    # 320 MiB of scores and mask, and q and k (8192 x 32 x 128 each) in float32 twice: 512 MiB.
    assert "adds at most 832 MiB of device memory" in note
    assert health_device_memory(job_config("--metrics.health_freq", "0"), args, 1) == []
