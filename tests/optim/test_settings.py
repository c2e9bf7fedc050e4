"""One pass over [optimizer]: the tables of which optimizer takes which option, and what optimizer_settings resolves."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import job_config
from torchtitan.config.tables.optimizer import Optimizer
from torchtitan.errors import UserError
from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.optim.settings import OPTION_RULES, OPTIONAL_OPTIONS, TAKES, optimizer_settings

COMMON = {"name", "lr", "beta1", "beta2", "eps", "weight_decay"}


def a_value(option: str) -> str:
    """A value the config parser accepts for ``option`` (its first choice, or a number in its range)."""
    metadata = {f.name: f.metadata for f in dataclasses.fields(Optimizer)}[option]
    if metadata.get("choices"):
        return str(metadata["choices"][0])
    kind = {f.name: f.type for f in dataclasses.fields(Optimizer)}[option]
    if "bool" in str(kind):
        return "true"
    if "int" in str(kind):
        return "4"
    return "0.5"


def test_every_optimizer_field_is_common_or_declared_once():
    fields = {f.name for f in dataclasses.fields(Optimizer)}
    assert fields - COMMON == set(OPTION_RULES), "declare each optional [optimizer] option in settings.OPTION_RULES"
    assert set(OPTIONAL_OPTIONS) == set(OPTION_RULES)
    for name, taken in TAKES.items():
        assert set(taken) <= set(OPTION_RULES), name
        assert len(set(taken)) == len(taken), name
    assert list(OPTIMIZERS) == list(TAKES)  # a factory for every optimizer of the table, and no other
    assert all(any(option in taken for taken in TAKES.values()) for option in OPTION_RULES)  # no orphan option


@pytest.mark.parametrize("name", list(TAKES))
def test_every_option_another_optimizer_takes_is_refused_in_one_line(name):
    refused = [option for option in OPTION_RULES if option not in TAKES[name]]
    for option in refused:
        extra = ["--training.param_dtype", "bfloat16"] if option == "bf16_stochastic_round" else []
        job = job_config("--optimizer.name", name, f"--optimizer.{option}", a_value(option), *extra)
        with pytest.raises(UserError) as error:
            optimizer_settings(job)
        users = ", ".join(other for other, taken in TAKES.items() if option in taken)
        assert str(error.value) == (
            f"optimizer.{option} does not apply to {name} (only to {users}); remove it from the config"
        )


def test_settings_are_resolved_once_and_hold_only_the_options_taken():
    settings = optimizer_settings(job_config("--optimizer.name", "adam-mini", "--optimizer.lr", "0.002"))
    assert settings.name == "AdamMini" and settings.lr == 0.002 and settings.betas == (0.9, 0.95)
    # Unset: what unset means for the state, or None (the optimizer's own default).
    assert dict(settings.options) == {
        "value_blocks": "per_row",
        "embedding_blocks": "per_row",
        "output_blocks": "per_row",
        "attn_out_blocks": "per_row",
        "mlp_blocks": "per_row",
        "norm_weight_decay": False,
        "implementation": None,
        "state_dtype": "float32",
    }
    with pytest.raises(KeyError):
        settings.get("block_size")
    with pytest.raises(TypeError):
        settings.options["state_dtype"] = "bfloat16"  # frozen
    muon = optimizer_settings(job_config("--optimizer.name", "Muon", "--optimizer.ns_steps", "3"))
    assert muon.chosen("ns_steps", "momentum", "state_dtype") == {"ns_steps": 3, "state_dtype": "float32"}


def test_settings_read_the_weights_dtype_for_the_checks_that_need_it():
    job = job_config("--optimizer.name", "AdamW", "--optimizer.implementation", "fused")
    assert optimizer_settings(job).weights_dtype == "float32"
    job.training.param_dtype = "bfloat16"
    with pytest.raises(UserError, match="optimizer.implementation chooses torch's kernels"):
        optimizer_settings(job)


@pytest.mark.parametrize(
    "written, meant", [("adamini", "AdamMini"), ("Adamw8bits", "AdamW8bit"), ("muom", "Muon"), ("lion", None)]
)
def test_a_near_miss_optimizer_name_gets_did_you_mean(written, meant):
    with pytest.raises(UserError) as error:
        optimizer_settings(job_config("--optimizer.name", written))
    message = str(error.value)
    assert message.startswith(f"unknown optimizer.name '{written}'; ") and "valid names: AdamW, Adam," in message
    assert (f"did you mean {meant}? " in message) if meant else ("did you mean" not in message)
