import math

import pytest
import torch

from torchtitan.config_manager import JobConfig
from torchtitan.lr_scheduling import build_lr_schedulers, lr_factor


def factors(**kw):
    return [lr_factor(s, **kw) for s in range(1, kw["total_steps"] + 1)]


def test_linear_warmup_then_linear_decay_to_floor():
    f = factors(warmup_steps=4, total_steps=12, decay_type="linear", lr_min=0.1)
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(f[3:], f[4:]))
    assert f[7] == pytest.approx(0.1 + 0.9 * (1 - 4 / 8))


def test_cosine_decay():
    f = factors(warmup_steps=2, total_steps=10, decay_type="cosine", lr_min=0.0)
    assert f[1] == 1.0
    assert f[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert f[-1] == pytest.approx(0.0, abs=1e-12)


def test_no_warmup_and_constant():
    assert lr_factor(1, warmup_steps=0, total_steps=5, decay_type="constant", lr_min=0.0) == 1.0
    assert lr_factor(1, warmup_steps=0, total_steps=5, decay_type="linear", lr_min=0.0) == pytest.approx(0.8)


class _Container:
    def __init__(self, optimizers):
        self.optimizers = optimizers


def test_schedulers_drive_float_and_tensor_lr_and_restore():
    config = JobConfig.parse_args(["--training.warmup_steps", "2", "--training.steps", "6", "--optimizer.lr", "0.1"])
    p = torch.nn.Parameter(torch.zeros(2))
    plain = torch.optim.SGD([p], lr=0.1)
    tensor_lr = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    schedulers = build_lr_schedulers(_Container([plain, tensor_lr]), config)
    seen = []
    for _ in range(4):
        seen.append(schedulers.get_last_lr())
        schedulers.step()
    assert seen == pytest.approx([0.05, 0.1, 0.075, 0.05])
    assert float(tensor_lr.param_groups[0]["lr"]) == pytest.approx(plain.param_groups[0]["lr"])
    state = schedulers.state_dict()

    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    fresh = build_lr_schedulers(_Container([fresh_opt]), config)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == pytest.approx(0.025)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.025)
    fresh.step()
    schedulers.step()
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())
