"""torchao's low-bit optimizers, adapted to the trainer: a quiet import, a compile cache per optimizer kind, and
checkpoints of plain tensors.

The low-bit AdamW variants come from torchao (the ``lowbit`` extra), except for one thing: which states are
quantized is decided on the whole parameter (``state_storage.quantized_layout``), not on each rank's shard as torchao
does, so that the state is the same in every layout. Their quantized moments are written to checkpoints as plain
float32 tensors shaped like the parameter and quantized again on load, so a low-bit checkpoint reshards across world
sizes like an AdamW one and loads without torchao's tensor classes. AdamMini8bit/4bit store their momentum in
torchao's quantized classes too and use the same hooks. The trainer's checkpoints make those float32 values one
tensor at a time and save each state's block scales beside them, so that a load restores the quantized state bit for
bit (``quantized_checkpoint``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.optim.compile_cache import optimizer_compile
from torchtitan.optim.state.storage import dequantized, is_quantized, laid_out_like, quantized_layout
from torchtitan.optim.state.torchao_import import import_torchao_optim

_low_bit_classes: dict[str, type] = {}


def low_bit_class(name: str) -> type:
    """torchao's optimizer ``name`` whose step compiles into a cache folder of its own."""
    if name not in _low_bit_classes:
        base = getattr(import_torchao_optim(), name)

        def step(self, closure=None):
            # torchao's step reads p.grad: hand it each gradient in its parameter's layout (grad_like_param).
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = grad_like_param(p, name)
            # torchao compiles its step on the parameters (DTensors). Not once per machine: inductor's cache keys
            # for these graphs differ between the ranks of a run (two ranks of FSDP 2, or of DDP 2, each compiled
            # every graph though one had finished it first), so a rank that waited would compile again after.
            with optimizer_compile(name, subclass_inputs=True):
                return base.step(self, closure)

        def _new_buffer(self, p, signed):
            # torchao judges the local shard (at least 4096 values, a whole number of blocks): one parameter would
            # be quantized on one rank and not on eight. Judge the whole parameter instead.
            local = local_tensor(p)
            if quantized_layout(p, self.block_size):
                out = self._subclass_zeros(local, signed, self.block_size)
            else:
                out = torch.zeros_like(local)
            return laid_out_like(p, out).to(p.device)  # as torchao: kept on the parameter's device (CPU offload)

        members = {"step": step, "_new_buffer": _new_buffer, "__module__": __name__}
        _low_bit_classes[name] = type(name, (base,), members)
    return _low_bit_classes[name]


def portable_quantized_state(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` hold plain float tensors and ``load_state_dict`` quantize them again.

    Plain tensors shaped like the parameter reshard through DCP like any AdamW state; the quantized classes need
    torchao's classes to unpickle. Values alone do not carry the block scales: quantizing them again here takes each
    block's largest magnitude, which for a first-moment block whose largest value is negative is slightly smaller
    than the saved scale (torchao's signed code tables end above -1: -0.993 for 8-bit, -0.8875 for 4-bit). The
    trainer's checkpoints therefore also save the scales and restore the state bit for bit
    (``quantized_checkpoint``); this plain path is within one re-quantization.
    """
    # Live quantized tensors, per parameter, between the pre- and the post-hook of one load_state_dict call.
    live_quantized: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def quantize_into_live_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        # Copy now, from the incoming float32 values: torch is about to cast them to the parameter's dtype.
        live_quantized.clear()
        for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
            for key, param in zip(saved_group["params"], group["params"]):
                incoming = state_dict["state"].get(key, {})
                live = {
                    name: value
                    for name, value in optimizer.state.get(param, {}).items()
                    if is_quantized(value) and name in incoming
                }
                for name, value in live.items():
                    # A quantized incoming value is the live state itself, already loaded in place (group by group).
                    if not is_quantized(incoming[name]):
                        value.copy_(incoming[name])
                if live:
                    live_quantized[param] = live

    def restore_quantized_state(optimizer: torch.optim.Optimizer) -> None:
        for param, live in live_quantized.items():
            optimizer.state[param].update(live)
        live_quantized.clear()

    optimizer.register_state_dict_post_hook(_dequantize_state_dict)
    optimizer.register_load_state_dict_pre_hook(quantize_into_live_state)
    optimizer.register_load_state_dict_post_hook(restore_quantized_state)


# Optimizers whose state_dict() keeps the live quantized tensors, for a caller that makes their float32 values one
# at a time (torchtitan.optim.state.quantized_checkpoint).
_keeping_quantized: set[int] = set()


@contextlib.contextmanager
def quantized_state_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While the block runs, ``optimizer.state_dict()`` holds the live quantized tensors instead of float32 copies."""
    _keeping_quantized.add(id(optimizer))
    try:
        yield
    finally:
        _keeping_quantized.discard(id(optimizer))


def _dequantize_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    if id(optimizer) in _keeping_quantized:
        return state_dict
    # The per-parameter dicts in state_dict are the optimizer's own: build new ones rather than edit them.
    state_dict["state"] = {
        index: {key: dequantized(v) if is_quantized(v) else v for key, v in param_state.items()}
        for index, param_state in state_dict["state"].items()
    }
    return state_dict
