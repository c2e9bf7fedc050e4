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
import functools
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.optim.compile_cache import optimizer_compile, signature
from torchtitan.optim.state.storage import dequantized, is_quantized, laid_out_like, quantized_layout
from torchtitan.optim.state.torchao_import import import_torchao_optim

_low_bit_classes: dict[str, type] = {}


def low_bit_class(name: str) -> type:
    """torchao's optimizer ``name`` whose step compiles into a cache folder of its own."""
    if name not in _low_bit_classes:
        base = getattr(import_torchao_optim(), name)

        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with torch.no_grad(), torch._dynamo.utils.disable_cache_limit():
                calls = [
                    _step_arguments(self, group, p)
                    for group in self.param_groups
                    for p in group["params"]
                    if p.grad is not None
                ]
                # The first step compiles the graphs (one per argument layout), once per machine: ranks whose
                # shards have the same shapes load them from inductor's cache. Later steps reuse them.
                # (Meta and fake parameters, memory estimates, run it eagerly: nothing is compiled or marked.)
                dataless = _dataless(calls)
                once = None if self._graphs_compiled or dataless else signature(name, calls)
                device_type = calls[0][0].device.type if calls else None
                with optimizer_compile(name, subclass_inputs=True, signature=once, device_type=device_type):
                    for arguments in calls:
                        _compiled_single_param_step()(*arguments)
                self._graphs_compiled = self._graphs_compiled or not dataless
            return loss

        def _new_buffer(self, p, signed):
            # torchao judges the local shard (at least 4096 values, a whole number of blocks): one parameter would
            # be quantized on one rank and not on eight. Judge the whole parameter instead.
            local = local_tensor(p)
            if quantized_layout(p, self.block_size):
                out = self._subclass_zeros(local, signed, self.block_size)
            else:
                out = torch.zeros_like(local)
            return laid_out_like(p, out).to(p.device)  # as torchao: kept on the parameter's device (CPU offload)

        members = {"step": step, "_new_buffer": _new_buffer, "_graphs_compiled": False, "__module__": __name__}
        _low_bit_classes[name] = type(name, (base,), members)
    return _low_bit_classes[name]


def _step_arguments(optimizer, group: dict, p: torch.Tensor) -> tuple:
    """torchao's per-parameter Adam step's arguments for ``p``, its state created and its step counted, on this
    rank's shards.

    torchao steps each parameter as it is (a DTensor under FSDP or TP); here the step gets the rank's local shards
    instead: the step is elementwise, and each quantized state's blocks lie within its shard (the state is a DTensor
    over a quantized local tensor), so the shards' update is the DTensor's. The compiled graphs are then keyed by
    the shards alone, as the project's own compiled steps are: a DTensor's device mesh, among a graph's inputs,
    keys it differently on every rank, so that no rank could load a graph another rank had compiled."""
    grad = grad_like_param(p, type(optimizer).__name__)  # torchao reads p.grad: hand it in p's layout
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = optimizer._new_buffer(p, True)
        state["exp_avg_sq"] = optimizer._new_buffer(p, False)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = optimizer._new_buffer(p, False)
    state["step"] += 1
    if not isinstance(group["lr"], torch.Tensor):
        raise TypeError(f"{type(optimizer).__name__}'s lr must stay a tensor (set it with fill_)")
    max_exp_avg_sq = state.get("max_exp_avg_sq")
    return (
        local_tensor(p.detach()),
        local_tensor(grad),
        state["step"],
        local_tensor(state["exp_avg"]),
        local_tensor(state["exp_avg_sq"]),
        None if max_exp_avg_sq is None else local_tensor(max_exp_avg_sq),
        group["lr"],
        group["betas"][0],
        group["betas"][1],
        group["weight_decay"],
        group["eps"],
        optimizer.is_adamw,
        optimizer.bf16_stochastic_round and p.dtype is torch.bfloat16,
    )


def _dataless(calls: list[tuple]) -> bool:
    """Whether the step's tensors are meta or fake (a memory estimate)."""
    tensors = [value for arguments in calls for value in arguments if isinstance(value, torch.Tensor)]
    return any(value.is_meta or is_fake(value) for value in tensors)


@functools.lru_cache(maxsize=None)
def _compiled_single_param_step():
    """torchao's per-parameter Adam step, compiled as torchao compiles it (whole graph, static shapes)."""
    from torchao.optim.adam import single_param_adam

    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


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
