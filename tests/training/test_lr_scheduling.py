import math

import pytest
import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError
from torchtitan.training.lr_scheduling import build_lr_schedulers, lr_factor


def factors(**kw):
    return [lr_factor(s, **kw) for s in range(1, kw["total_steps"] + 1)]


def test_linear_warmup_then_linear_decay_towards_floor():
    f = factors(warmup_steps=4, total_steps=12, decay_type="linear", lr_min=0.1)
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(f[3:], f[4:]))
    # 8 decaying steps at progress i / 9: the floor would be reached at the step after the last.
    assert f[7] == pytest.approx(0.1 + 0.9 * (1 - 4 / 9))
    assert f[-1] == pytest.approx(0.1 + 0.9 / 9)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize("decay_ratio", [None, 0.2, 1.0])
def test_every_step_trains_with_a_zero_floor(decay_type, decay_ratio):
    warmup = 0 if decay_ratio == 1.0 else 3
    f = factors(warmup_steps=warmup, total_steps=20, decay_type=decay_type, lr_min=0.0, decay_ratio=decay_ratio)
    assert min(f) > 0.0 and f[-1] > 0.0
    assert all(a >= b for a, b in zip(f[warmup:], f[warmup + 1 :]))  # never rises after warmup


def test_cosine_and_sqrt_decay_shapes():
    f = factors(warmup_steps=2, total_steps=10, decay_type="cosine", lr_min=0.0)
    assert f[1] == 1.0
    assert f[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert f[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 9)))
    g = factors(warmup_steps=2, total_steps=10, decay_type="sqrt", lr_min=0.2)
    assert g[5] == pytest.approx(0.2 + 0.8 * (1 - math.sqrt(4 / 9)))


def test_warmup_stable_decay():
    f = factors(warmup_steps=2, total_steps=10, decay_type="linear", lr_min=0.0, decay_ratio=0.3)
    assert f[:2] == [0.5, 1.0]
    assert f[2:7] == [1.0] * 5  # stable: steps 3-7 at the peak
    assert f[7:] == pytest.approx([0.75, 0.5, 0.25])  # the last 3 steps decay, at progress 1/4, 2/4, 3/4


def test_no_warmup_and_constant():
    assert lr_factor(1, warmup_steps=0, total_steps=5, decay_type="constant", lr_min=0.0) == 1.0
    assert lr_factor(1, warmup_steps=0, total_steps=5, decay_type="linear", lr_min=0.0) == pytest.approx(5 / 6)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.decay_type", "constant", "--training.decay_ratio", "0.2"], "no effect"),
        (["--training.warmup_steps", "9", "--training.decay_ratio", "0.2"], "exceed training.steps"),
        (["--training.decay_ratio", "0.01"], "no step to decay"),
        (["--training.decay_ratio", "0"], "training.decay_ratio"),
    ],
)
def test_contradicting_schedules_are_user_errors(argv, fragment):
    with pytest.raises(UserError, match=fragment):
        JobConfig.parse_args(["--training.steps", "10", *argv])


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
    assert seen == pytest.approx([0.05, 0.1, 0.08, 0.06])  # 4 decaying steps at progress i / 5
    assert float(tensor_lr.param_groups[0]["lr"]) == pytest.approx(plain.param_groups[0]["lr"])
    state = schedulers.state_dict()

    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    fresh = build_lr_schedulers(_Container([fresh_opt]), config)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == pytest.approx(0.04)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.04)
    fresh.step()
    schedulers.step()
    assert fresh.get_last_lr() == pytest.approx(schedulers.get_last_lr())
