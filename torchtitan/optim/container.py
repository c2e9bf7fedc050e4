"""The optimizers of all model parts as one: what the trainer, the LR schedulers and the checkpoint manager see.

``step``/``zero_grad`` for the loop, ``optimizers`` (each a plain ``torch.optim.Optimizer`` with
``param_groups[i]["lr"]``) for one scheduler per optimizer, a flattened DCP-ready ``state_dict`` that reshards
across world sizes, ``initialise_state`` to create the state before the first step (as that step would), and
``state_bytes`` for memory reporting.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.logging import logger
from torchtitan.optim.lowbit.torchao_adapter import quantized_state_kept
from torchtitan.optim.state.initialise import initialise_state
from torchtitan.optim.state.quantized_checkpoint import entries_for_quantized, entry_sources, without_scales

# Flattened keys ("state.<param fqn>.exp_avg") let DCP match state to parameters by name, whatever the sharding.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """The optimizers of all model parts, stepped, zeroed, checkpointed and measured as one."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], name: str):
        if len(model_parts) != len(optimizers):
            raise ValueError("need exactly one optimizer per model part")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.name = name

    def __len__(self) -> int:
        return len(self.optimizers)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's param groups, in order (the same dicts, so reading ``lr`` here sees the schedule)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Flattened state of all parts, keyed by parameter name: DCP saves it and reshards it on load.

        Quantized states are :class:`QuantizedEntry` objects, which DCP writes as float32 one tensor at a time (with
        ``QuantizedStateSavePlanner``) and which ``read_in_groups`` reads back, each with its block scales beside it
        (``<key>.block_scales``); ``plain_values`` makes them tensors.
        """
        state: dict[str, Any] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            initialise_state(optimizer)
            with quantized_state_kept(optimizer):
                state.update(entries_for_quantized(get_optimizer_state_dict(model, optimizer, options=_FLAT)))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a flat state: plain tensors (quantized states as float32, quantized again here within one
        re-quantization), or the entries of ``state_dict()`` whose values ``read_in_groups`` already put in place
        (bit for bit). Block scales are read by ``read_in_groups`` only."""
        state_dict = entry_sources(without_scales(state_dict))
        replaced: dict[str, tuple[Any, Any]] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            # A fresh optimizer has no state to load into yet; create it (as zeros) first.
            initialise_state(optimizer)
            settings = job_settings(optimizer)
            set_optimizer_state_dict(model, optimizer, state_dict, options=_FLAT)
            replaced.update(restore_job_settings(optimizer, settings))
        if replaced:
            changes = ", ".join(f"{key} {saved} -> {value}" for key, (saved, value) in replaced.items())
            logger.info(f"optimizer: this job's settings replace the checkpoint's: {changes}")

    def initialise_state(self) -> None:
        """Create the state that optimizers create on their first step, as a fresh optimizer would have it.

        This runs one step with zero gradients at lr 0 (compiling the step where the optimizer compiles it) and
        changes no parameter; a no-op where the state exists. See ``state_init.initialise_state``.
        """
        for optimizer in self.optimizers:
            initialise_state(optimizer)

    def state_bytes(self) -> int:
        """This rank's bytes of optimizer state (local shards only; meta and fake tensors count their size).

        Counts the state that exists: call ``initialise_state()`` first for the size before the first step.
        """
        missing = [i for i, optimizer in enumerate(self.optimizers) if _has_params(optimizer) and not optimizer.state]
        if missing:
            raise RuntimeError(f"optimizers {missing} have no state yet; call initialise_state() before state_bytes()")
        return sum(
            tensor_bytes(value)
            for optimizer in self.optimizers
            for state in optimizer.state.values()
            for value in state.values()
        )


# Set by the lr schedule at every step: where the checkpoint stopped, kept as loaded (the resumed schedule sets it
# again at its next step); never a setting to replace or report.
_SCHEDULED = frozenset({"lr"})


def job_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (all but its parameters) as this job built them."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def restore_job_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> dict[str, tuple]:
    """Put this job's ``settings`` back into the param groups a load replaced with the checkpoint's.

    torch's ``load_state_dict`` takes every param-group value from the checkpoint; the job says how to train on
    (betas, eps, weight decay, momentum, Newton–Schulz steps, ...), the checkpoint only where it stopped. Returns
    ``{key: (checkpoint's value, job's value)}`` for the values that differed; the lr, which the schedule sets,
    stays the checkpoint's.
    """
    if len(settings) != len(optimizer.param_groups):
        raise RuntimeError(
            f"the load changed the number of param groups ({len(settings)} -> {len(optimizer.param_groups)})"
        )
    replaced: dict[str, tuple] = {}
    for group, job in zip(optimizer.param_groups, settings):
        saved = {key: value for key, value in group.items() if key != "params"}
        for key in saved.keys() - job.keys():
            del group[key]
        for key, value in job.items():
            if key in _SCHEDULED and key in saved:
                continue
            if not _same(saved.get(key), value):
                replaced.setdefault(key, (_plain(saved.get(key)), _plain(value)))
            group[key] = value
    return replaced


def _plain(value: Any) -> Any:
    """A setting as plain data (a checkpoint may hold a tuple as a list, a tensor lr as a number)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _same(a: Any, b: Any) -> bool:
    return _plain(a) == _plain(b)


def _has_params(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.requires_grad for group in optimizer.param_groups for p in group["params"])


def tensor_bytes(value: Any) -> int:
    """Bytes a state value holds on this rank: a DTensor counts its local shard, a quantized subclass its parts."""
    if not isinstance(value, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(value):
        inner_names, _ = value.__tensor_flatten__()
        return sum(tensor_bytes(getattr(value, inner)) for inner in inner_names)
    return value.numel() * value.element_size()
