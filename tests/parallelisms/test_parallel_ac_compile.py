"""Activation checkpointing (full, every k-th block, op policy) and per-block compile change how a step runs, not
what it computes: the loss and gradients match the plain model's.

Tolerances: checkpointing recomputes the same float64 ops on the same shapes, so results are expected to be
bit-identical. Compile is checked in float32, the dtype CPU runs train in (torch 2.11's inductor mis-types the CPU
attention backward for float64); inductor fuses and reorders float32 arithmetic, so it gets 1e-5 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import adamw_step, batch, grads, job_config, materialize, meta_model
from torchtitan.parallelisms import ParallelDims, parallelize_llama
from torchtitan.parallelisms.activation_checkpoint import checkpointed_layer_indices

ONE_PROCESS = ParallelDims(1, -1, 1, 1)
AC_MODES = {
    "full": {"mode": "full"},
    "every_layer": {"mode": "selective", "selective_ac_option": "1"},
    "every_2nd_layer": {"mode": "selective", "selective_ac_option": "2"},
    "op_policy": {"mode": "selective", "selective_ac_option": "op"},
}


def _model(dtype=torch.float64, **sections):
    return materialize(parallelize_llama(meta_model(dtype=dtype), None, ONE_PROCESS, job_config(**sections)))


@functools.lru_cache(maxsize=None)
def _plain_step(dtype=torch.float64) -> dict:
    return adamw_step(_model(dtype), *batch())


def _assert_same_step(actual: dict, expected: dict, **tolerance) -> None:
    assert actual["loss"] == pytest.approx(expected["loss"], rel=tolerance.get("rtol", 0.0), abs=0.0)
    assert actual["grads"].keys() == expected["grads"].keys()
    for name, grad in actual["grads"].items():
        torch.testing.assert_close(grad, expected["grads"][name], msg=name, **(tolerance or dict(rtol=0, atol=0)))


@pytest.mark.parametrize("mode", list(AC_MODES))
def test_activation_checkpointing_keeps_loss_and_gradients(mode):
    _assert_same_step(adamw_step(_model(activation_checkpoint=AC_MODES[mode]), *batch()), _plain_step())


@pytest.mark.parametrize(
    "mode, wrapped",
    [("full", [0, 1, 2, 3]), ("every_layer", [0, 1, 2, 3]), ("every_2nd_layer", [1, 3]), ("op_policy", [0, 1, 2, 3])],
)
def test_checkpointed_blocks(mode, wrapped):
    config = job_config(activation_checkpoint=AC_MODES[mode]).activation_checkpoint
    assert checkpointed_layer_indices(4, config) == wrapped
    assert checkpointed_layer_indices(4, job_config().activation_checkpoint) == []


def test_wrapped_blocks_keep_canonical_parameter_names():
    model = _model(activation_checkpoint=AC_MODES["every_2nd_layer"])
    names = [name for name, _ in model.named_parameters()]
    assert "layers.1._checkpoint_wrapped_module.attention.wq.weight" in names
    assert "layers.0.attention.wq.weight" in names  # layer 0 is not wrapped with k = 2
    assert set(adamw_step(model, *batch())["grads"]) == set(_plain_step()["grads"])


def _backward_flops(model) -> int:
    inputs, labels = batch()
    loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_op_policy_recomputes_less_than_full_checkpointing():
    """Backward redoes all forward matmuls under full AC, about half of them under the op policy, none without AC."""
    plain = _backward_flops(_model())
    op_policy = _backward_flops(_model(activation_checkpoint=AC_MODES["op_policy"]))
    full = _backward_flops(_model(activation_checkpoint=AC_MODES["full"]))
    assert plain < op_policy < full


def test_compiled_blocks_compute_the_same_step():
    model = _model(torch.float32, training={"compile": True})
    assert all(type(block).__name__ == "OptimizedModule" for block in model.layers.values())
    # The chunked loss after compiled blocks first (gradients only, the weights unchanged), then the whole step.
    inputs, labels = batch()
    chunked_loss = model(inputs, labels=labels, loss_chunks=5)
    chunked_loss.backward()
    chunked = {"loss": chunked_loss.item(), "grads": grads(model)}
    model.zero_grad(set_to_none=True)
    _assert_same_step(adamw_step(model, inputs, labels), _plain_step(torch.float32), rtol=1e-5, atol=1e-7)
    _assert_same_step(chunked, _plain_step(torch.float32), rtol=1e-5, atol=1e-7)
