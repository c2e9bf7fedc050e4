"""The step-time split on a GPU: CUDA events time the device's work without a synchronisation per step."""

from __future__ import annotations

import time

import pytest
import torch

from torchtitan.telemetry.health import OptimizerHealth
from torchtitan.telemetry.step_timing import StepTimer, tag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_device_parts_are_timed_by_events_read_only_at_the_log_step():
    device = torch.device("cuda")
    timer = StepTimer(device)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    host = 0.0
    for _ in range(3):
        started = time.perf_counter()
        with timer.part("forward_backward"):
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
        host += time.perf_counter() - started
        timer.step_done()
    pending = [end for _, end in timer.events["forward_backward"]]
    assert len(pending) == 3 and not pending[-1].query()  # nothing waited for the device during the steps
    metrics = timer.metrics()
    assert metrics[tag("forward_backward")] > host / 3  # the device's time, not the host's queueing time


def test_health_keeps_the_weights_before_the_step_in_pinned_host_memory():
    model = torch.nn.Linear(64, 64, device="cuda")
    health = OptimizerHealth([model], freq=1, max_layers=16, device=torch.device("cuda"))
    model(torch.randn(8, 64, device="cuda")).square().sum().backward()
    assert health.start(1)
    health.record_gradients()
    health.snapshot_weights()
    assert all(h.device.type == "cpu" and h.is_pinned() for h in health._snapshot)
    with torch.no_grad():
        model.weight.add_(1e-3)
    health.record_update()
    metrics = health.metrics(lr=1e-3)
    assert metrics["health/update_rms/other"] == pytest.approx(1e-3 * (64 * 64 / (64 * 64 + 64)) ** 0.5, rel=1e-4)
