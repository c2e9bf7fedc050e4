"""The host memory optimizer health holds for the weights before a measured step is bounded by
metrics.health_snapshot_gib: above it no copy is made and no update metric is logged, while the other values are
those of a health that measures everything."""

from __future__ import annotations

import torch

from tests.helpers import job_config, materialize, meta_model, micro_batches
from torchtitan.optim import build_optimizers
from torchtitan.parallelisms import ParallelDims, parallelize_llama
from torchtitan.telemetry.health import OptimizerHealth, snapshot_bytes
from torchtitan.training.step import train_step

CPU = torch.device("cpu")
LR = 1e-2


def measured(snapshot_gib: float) -> tuple[dict, OptimizerHealth]:
    config = job_config(training={"max_norm": 0.5}, optimizer={"name": "AdamW", "lr": LR})
    dims = ParallelDims(1, 1, 1, 1)
    model = materialize(parallelize_llama(meta_model(), dims.build_mesh("cpu"), dims, config))
    optimizers = build_optimizers([model], config)
    health = OptimizerHealth([model], freq=1, max_layers=16, device=CPU, snapshot_gib=snapshot_gib)
    batches = micro_batches(1, 0, 1, seed=7)
    train_step(model, optimizers, batches, dims, config, CPU, None, 1, health)
    return health.metrics(LR), health


def test_above_the_snapshot_limit_no_copy_is_made_and_no_update_is_logged():
    whole, _ = measured(1.0)
    bounded, health = measured(1e-9)
    assert health._host is None and not health.measures_update  # no host copy of the weights, ever
    assert any(key.startswith("health/update_rms/") for key in whole)
    assert not any("update" in key for key in bounded)
    assert bounded == {key: value for key, value in whole.items() if "update" not in key}


def test_the_snapshot_is_counted_as_the_local_weights_within_the_limit():
    params = [torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.float32)), torch.nn.Parameter(torch.zeros(10))]
    assert snapshot_bytes(params, 1.0) == (256 * 256 + 10) * 4
    assert snapshot_bytes(params, 1e-6) == 0  # above the limit: nothing is held
