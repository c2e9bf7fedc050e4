"""AdEMAMix: exact against pytorch-optimizer's AdEMAMix (float32, 1e-6, through and past the warm-up), the paper's
schedules, its options and their refusals, and its state (bytes, bfloat16 storage, checkpoints)."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_optimizer import AdEMAMix as ReferenceAdEMAMix

from tests.helpers import (
    TINY,
    initial_state_bytes,
    job_config,
    max_difference,
    set_synthetic_grads,
    tiny_model,
    weights,
)
from torchtitan.errors import UserError
from torchtitan.optim import build_optimizers
from torchtitan.optim.ademamix.optimizer import AdEMAMix
from torchtitan.optim.ademamix.update import alpha_schedule, beta3_schedule
from torchtitan.optim.settings import optimizer_settings

STEPS = 20
OPTIONS = {"lr": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "alpha": 4.0, "beta3": 0.999}


def config_for(warmup: int, **options) -> list[str]:
    values = {**OPTIONS, **options}
    argv = ["--optimizer.name", "AdEMAMix", "--optimizer.ademamix_warmup_steps", str(warmup)]
    for key in ("lr", "beta1", "beta2", "eps", "weight_decay"):
        argv += [f"--optimizer.{key}", str(values[key])]
    return argv + [
        "--optimizer.ademamix_alpha",
        str(values["alpha"]),
        "--optimizer.ademamix_beta3",
        str(values["beta3"]),
    ]


def reference_for(model: torch.nn.Module, warmup: int) -> torch.optim.Optimizer:
    """pytorch-optimizer's AdEMAMix with the same settings: decoupled weight decay scaled by lr (the paper's),
    betas (beta1, beta2, beta3), one warm-up for alpha and beta3 (None: none)."""
    o = OPTIONS
    return ReferenceAdEMAMix(
        model.parameters(),
        lr=o["lr"],
        betas=(o["beta1"], o["beta2"], o["beta3"]),
        weight_decay=o["weight_decay"],
        weight_decouple=True,
        fixed_decay=False,
        alpha=o["alpha"],
        t_alpha_beta3=warmup or None,
        eps=o["eps"],
        foreach=False,
    )


@pytest.mark.parametrize("warmup", [12, 0])
def test_equals_pytorch_optimizers_ademamix_in_float32(warmup):
    ours_model, reference_model = tiny_model(TINY, torch.float32), tiny_model(TINY, torch.float32)
    (ours,) = build_optimizers([ours_model], job_config(*config_for(warmup))).optimizers
    assert isinstance(ours, AdEMAMix)
    reference = reference_for(reference_model, warmup)
    for step in range(STEPS):  # 12 steps of warm-up, 8 after
        set_synthetic_grads(ours_model, step)
        set_synthetic_grads(reference_model, step)
        ours.step()
        reference.step()
    assert max_difference(weights(ours_model), weights(reference_model)) < 1e-6
    assert max_difference(weights(ours_model), weights(tiny_model(TINY, torch.float32))) > 1e-2  # it trained
    state, reference_state = ours.state[ours_model.output.weight], reference.state[reference_model.output.weight]
    for key in ("exp_avg", "exp_avg_slow", "exp_avg_sq"):
        assert torch.allclose(state[key], reference_state[key], rtol=1e-5, atol=1e-7), key


def test_the_schedules_are_the_papers():
    steps = torch.arange(0, 31, dtype=torch.float64)
    alpha = alpha_schedule(steps, 8.0, 20)
    assert alpha[0] == 0 and alpha[10] == pytest.approx(4.0) and (alpha[20:] == 8.0).all()
    assert torch.equal(alpha_schedule(steps, 8.0, 0), torch.full_like(steps, 8.0))
    beta3 = beta3_schedule(steps, 0.9, 0.999, 20)
    assert beta3[0] == pytest.approx(0.9) and beta3[20] == pytest.approx(0.999) and (beta3[20:] <= 0.999).all()
    assert (beta3[21:] == 0.999).all()
    # The slow momentum's half-life, ln(1/2) / ln(beta3(t)), grows linearly from beta1's to beta3's.
    half_life = math.log(0.5) / beta3[:21].log()
    start, end = math.log(0.5) / math.log(0.9), math.log(0.5) / math.log(0.999)
    assert torch.allclose(half_life, start + (end - start) * steps[:21] / 20, rtol=1e-10)
    assert torch.equal(beta3_schedule(steps, 0.9, 0.999, 0), torch.full_like(steps, 0.999))


def test_unset_options_resolve_to_the_papers_choices_and_the_runs_length():
    settings = optimizer_settings(job_config("--optimizer.name", "ademamix", "--training.steps", "300"))
    assert settings.name == "AdEMAMix"
    assert dict(settings.options) == {
        "state_dtype": "float32",
        "ademamix_alpha": 5.0,
        "ademamix_beta3": 0.9999,
        "ademamix_warmup_steps": 300,
    }
    (optimizer,) = build_optimizers([tiny_model()], job_config("--optimizer.name", "AdEMAMix")).optimizers
    group = optimizer.param_groups[0]
    assert (group["alpha"], group["beta3"], group["warmup_steps"]) == (5.0, 0.9999, 10000)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--optimizer.ademamix_beta3", "0.8"],
            "AdEMAMix's warm-up takes the slow momentum's decay from optimizer.beta1 (0.9) up to "
            "optimizer.ademamix_beta3 (0.8), so it needs 0 < beta1 <= ademamix_beta3; change one of them, or set "
            "optimizer.ademamix_warmup_steps 0",
        ),
        (["--optimizer.beta1", "0"], "so it needs 0 < beta1 <= ademamix_beta3"),
        (["--optimizer.ademamix_beta3", "1"], "optimizer.ademamix_beta3 must be"),
        (["--optimizer.ademamix_alpha", "-1"], "optimizer.ademamix_alpha must be"),
    ],
)
def test_bad_values_are_one_line_user_errors(argv, message):
    with pytest.raises(UserError) as error:
        optimizer_settings(job_config("--optimizer.name", "AdEMAMix", *argv))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_without_warm_up_beta3_below_beta1_is_allowed():
    job = job_config("--optimizer.name", "AdEMAMix", "--optimizer.ademamix_beta3", "0.8")
    job.optimizer.ademamix_warmup_steps = 0
    assert optimizer_settings(job).get("ademamix_beta3") == 0.8


# Float64 weights step eagerly (no compile): "float32" state is then float64, at least the weights' precision.
@pytest.mark.parametrize("state_dtype, bytes_per_value", [("float32", 8), ("bfloat16", 2)])
def test_state_is_three_moments_per_element_in_its_dtype(state_dtype, bytes_per_value):
    model = tiny_model(TINY, torch.float64)
    optimizers = build_optimizers(
        [model], job_config("--optimizer.name", "AdEMAMix", "--optimizer.state_dtype", state_dtype)
    )
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    assert initial_state_bytes(optimizers) == 3 * bytes_per_value * numel + 4 * len(params)  # + a step count each
    (optimizer,) = optimizers.optimizers
    dtypes = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
    assert dtypes == {torch.float64 if state_dtype == "float32" else torch.bfloat16}


def test_bfloat16_state_trains_as_float32_state_does():
    """Three bfloat16 moments (rounded stochastically) move the weights as full-precision moments do, up to their
    rounding (float64 weights: the eager step, the same function the compiled one runs)."""
    runs = {}
    for state_dtype in ("float32", "bfloat16"):
        model = tiny_model(TINY, torch.float64)
        (optimizer,) = build_optimizers(
            [model], job_config(*config_for(4), "--optimizer.state_dtype", state_dtype)
        ).optimizers
        for step in range(5):
            set_synthetic_grads(model, step)
            optimizer.step()
        assert optimizer.state[model.output.weight]["exp_avg_slow"].dtype == (
            torch.float64 if state_dtype == "float32" else torch.bfloat16
        )
        runs[state_dtype] = weights(model)
    start = weights(tiny_model(TINY, torch.float64))
    moved = max_difference(runs["float32"], start)
    assert moved > 1e-2 and 0 < max_difference(runs["float32"], runs["bfloat16"]) < 0.02 * moved
