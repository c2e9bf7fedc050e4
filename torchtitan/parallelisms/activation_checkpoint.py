"""Activation checkpointing of transformer blocks: none, full, every k-th block, or an op-based selective policy.

Blocks are wrapped with ``checkpoint_wrapper`` (non-reentrant, RNG state not preserved: the model has no dropout),
which inserts ``_checkpoint_wrapped_module.`` into parameter names; ``canonical_name`` strips it.

The "op" policy keeps what is expensive to recompute and cheap to hold: attention outputs, the results of
reduce-scatters (recomputing them would communicate again), and every other matmul output; everything else
(norms, activations, rotary embedding, the remaining matmuls) is recomputed in backward.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.tables.training import ActivationCheckpoint


def _ops(*names: str) -> frozenset:
    """The ATen overloads named ``namespace.op.overload`` that exist in this build of torch."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


_ALWAYS_SAVED = _ops(
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
)
_MATMULS = _ops("aten.mm.default", "aten.bmm.default", "aten.addmm.default")


def op_policy_context():
    """Forward and recompute contexts for one checkpointed call under the "op" policy.

    Matmuls are counted separately in forward and in recompute, so both passes agree on which ones were saved.
    """
    matmuls_seen = Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _ALWAYS_SAVED:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed_layer_indices(n_layers: int, config: ActivationCheckpoint) -> list[int]:
    """Which blocks a layer-selective policy wraps: every k-th one, counting from the first (k=1: all)."""
    if config.mode == "full" or (config.mode == "selective" and config.selective_ac_option == "op"):
        return list(range(n_layers))
    if config.mode == "selective":
        every = int(config.selective_ac_option)
        return [i for i in range(n_layers) if (i + 1) % every == 0]
    return []


def wrap_block(block: nn.Module, use_op_policy: bool) -> nn.Module:
    extra = {"context_fn": op_policy_context} if use_op_policy else {}
    return checkpoint_wrapper(block, preserve_rng_state=False, **extra)


def apply_activation_checkpointing(model: nn.Module, config: ActivationCheckpoint) -> None:
    """Wrap ``model.layers`` blocks in place according to ``config`` (no-op for mode "none")."""
    use_op_policy = config.mode == "selective" and config.selective_ac_option == "op"
    blocks = list(model.layers.named_children())
    for index in checkpointed_layer_indices(len(blocks), config):
        name, block = blocks[index]
        model.layers.register_module(name, wrap_block(block, use_op_policy))
