"""model.norm_type: each of torchtitan's five normalisation layers trains, and Adam-mini blocks its parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import TINY, adam_mini_for, batch, tiny_model
from torchtitan.models.llama.model import NORM_BUILDERS
from torchtitan.models.norm_types import NORM_TYPES, RMSNORM_TYPES
from torchtitan.models.roles import BIAS, NORM
from torchtitan.optim.adam_mini.partition import PER_ELEMENT, PER_TENSOR, plan_blocks, unmatched_matrices


def _model(norm_type: str):
    return tiny_model(dataclasses.replace(TINY, norm_type=norm_type))


def test_every_norm_type_has_a_builder():
    assert tuple(NORM_BUILDERS) == NORM_TYPES


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_each_norm_type_trains_with_adam_mini(norm_type):
    model = _model(norm_type)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = adam_mini_for(model)
    inputs, labels = batch()
    for _ in range(2):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not train"


@pytest.mark.parametrize(
    "norm_type, expected",
    [
        ("rmsnorm", {"weight": (NORM, PER_TENSOR)}),
        ("layernorm", {"weight": (NORM, PER_TENSOR), "bias": (BIAS, PER_ELEMENT)}),
        ("np_layernorm", {}),
    ],
)
def test_adam_mini_partitions_every_norm_parameter(norm_type, expected):
    model = _model(norm_type)
    roles = model.named_param_roles()
    plans = plan_blocks(
        [(name, tuple(p.shape)) for name, p in model.named_parameters()], head_dim=TINY.head_dim, param_roles=roles
    )
    assert not unmatched_matrices(plans)
    norms = {plan.name: (plan.role, plan.rule, plan.decay) for plan in plans if "norm" in plan.name}
    # Two norms per block and the final one; each parameter declared by the model, none decayed.
    assert len(norms) == (2 * TINY.n_layers + 1) * len(expected)
    for name, (role, rule, decay) in norms.items():
        assert name in roles and (role, rule) == expected[name.rsplit(".", 1)[-1]] and not decay


def test_layernorm_starts_as_the_identity_affine_map():
    norm = _model("layernorm").norm
    assert torch.equal(norm.weight, torch.ones_like(norm.weight)) and torch.equal(
        norm.bias, torch.zeros_like(norm.bias)
    )


def test_rmsnorm_variants_compute_the_same_function():
    inputs, _ = batch()
    reference = _model("rmsnorm")(inputs)
    for norm_type in RMSNORM_TYPES[1:]:
        torch.testing.assert_close(_model(norm_type)(inputs), reference, rtol=1e-12, atol=1e-12, msg=norm_type)
