"""One check of the Adam hyperparameters, with torch.optim's rules, wherever they enter: the job config, the
optimizer builder and AdamMini's constructor."""

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import TINY, tiny_model
from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError
from torchtitan.optim import AdamMini, build_optimizers

DEFAULTS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def torch_adam(values: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        [torch.nn.Parameter(torch.zeros(2))],
        lr=values["lr"],
        eps=values["eps"],
        betas=(values["beta1"], values["beta2"]),
        weight_decay=values["weight_decay"],
    )


def adam_mini(values: dict) -> AdamMini:
    return AdamMini(
        tiny_model().named_parameters(),
        dim=TINY.dim,
        n_heads=TINY.n_heads,
        lr=values["lr"],
        betas=(values["beta1"], values["beta2"]),
        eps=values["eps"],
        weight_decay=values["weight_decay"],
    )


def job_with(field: str, value: float, name: str) -> JobConfig:
    job = JobConfig.parse_args(["--optimizer.name", name])
    setattr(job.optimizer, field, value)  # after parsing: the builder checks on its own
    return job


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lr", -1e-3, "lr must be at least 0"),
        ("lr", math.nan, "lr must be at least 0"),
        ("eps", -1e-8, "eps must be at least 0"),
        ("beta1", -0.1, "must be in [0, 1)"),
        ("beta1", 1.0, "must be in [0, 1)"),
        ("beta2", 1.0, "must be in [0, 1)"),
        ("weight_decay", -0.1, "weight_decay must be at least 0"),
    ],
)
def test_every_entry_point_refuses_what_torch_refuses(field, value, message):
    values = {**DEFAULTS, field: value}
    with pytest.raises(ValueError):
        torch_adam(values)
    with pytest.raises(UserError) as config_error:
        JobConfig.parse_args([f"--optimizer.{field}", repr(value)])
    assert str(config_error.value).startswith(f"optimizer.{field} ") and message in str(config_error.value)
    for name in ("AdamW", "AdamMini"):
        with pytest.raises(UserError) as builder_error:
            build_optimizers([tiny_model()], job_with(field, value, name))
        assert str(builder_error.value) == str(config_error.value), name
    with pytest.raises(UserError) as constructor_error:
        adam_mini(values)
    assert str(constructor_error.value).startswith("AdamMini ") and message in str(constructor_error.value)
    for error in (config_error, builder_error, constructor_error):
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "field, value", [("lr", 0.0), ("eps", 0.0), ("beta1", 0.0), ("beta2", 0.0), ("weight_decay", 0.0)]
)
def test_every_entry_point_accepts_the_edge_values_torch_accepts(field, value):
    values = {**DEFAULTS, field: value}
    torch_adam(values)
    job = JobConfig.parse_args([f"--optimizer.{field}", repr(value), "--optimizer.name", "AdamMini"])
    assert getattr(job.optimizer, field) == value
    assert build_optimizers([tiny_model()], job).name == "AdamMini"
    assert build_optimizers([tiny_model()], job_with(field, value, "AdamW")).name == "AdamW"
    defaults = adam_mini(values).defaults
    betas = dict(zip(("beta1", "beta2"), defaults["betas"]))
    assert {**defaults, **betas}[field] == value


def test_the_config_is_checked_without_importing_torch():
    code = (
        "import sys\n"
        "from torchtitan.config.job_config import JobConfig\n"
        "from torchtitan.errors import UserError\n"
        "try:\n"
        "    JobConfig.parse_args(['--optimizer.eps', '-1'])\n"
        "except UserError as e:\n"
        "    print(e)\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert out.stdout.splitlines() == ["optimizer.eps must be at least 0; got -1.0", "False"]
