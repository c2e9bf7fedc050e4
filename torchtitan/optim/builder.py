"""The optimizer registry: build the job's optimizer from its settings, one per model part, in a container.

The settings are read, checked and resolved in one pass by ``settings.optimizer_settings`` (names are
case-insensitive and ignore ``-`` and ``_``; every ``[optimizer]`` option is either taken by the chosen optimizer or
refused, as ``settings.TAKES`` says); each factory here receives them ready. The container is in ``container.py``,
torchao's low-bit optimizers are adapted in ``lowbit/torchao_adapter.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from torchtitan.errors import UserError
from torchtitan.optim.container import OptimizersContainer
from torchtitan.optim.lowbit.torchao_adapter import low_bit_class, portable_quantized_state
from torchtitan.optim.settings import (
    ADAM_MINI_PARTITION_OPTIONS,
    ADEMAMIX_ALPHA,
    ADEMAMIX_BETA3,
    ADEMAMIX_WARMUP_STEPS,
    BF16_STOCHASTIC_ROUND,
    BLOCK_SIZE,
    IMPLEMENTATION,
    MAX_PRECONDITION_DIM,
    MUON_OPTIONS,
    NORMUON_OPTIONS,
    NORMUON_STEP_SIZE,
    SOAP_OPTIONS,
    STATE_DTYPE,
    TAKES,
    OptimizerSettings,
    canonical_name,
    optimizer_settings,
    refuse_torch_kernels,
    state_options,
)


def implementation_flags(implementation: Optional[str]) -> dict[str, bool]:
    """torch.optim keyword flags for ``optimizer.implementation``; unset leaves torch's own choice."""
    if implementation is None:
        return {}
    return {
        "for-loop": {"foreach": False, "fused": False},
        "foreach": {"foreach": True, "fused": False},
        "fused": {"foreach": False, "fused": True},
    }[implementation]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------------------------
# Optimizer factories (one per canonical name)


def _low_precision_adam(
    params: list[nn.Parameter], settings: OptimizerSettings, decoupled: bool
) -> Optional[torch.optim.Optimizer]:
    """AdamW/Adam with moments in a dtype other than the weights': bfloat16 moments, or the float32 moments that
    ``state_dtype`` promises for bfloat16 weights (our compiled step: torch's kernels keep moments in the weights'
    dtype). None where torch's own optimizer keeps what ``state_dtype`` says."""
    state_dtype = settings.get(STATE_DTYPE)
    low_precision_weights = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if state_dtype == "float32" and not low_precision_weights:
        return None
    refuse_torch_kernels(settings)  # the weights are what they are, whatever training.param_dtype said
    from torchtitan.optim.lowbit.adamw import LowPrecisionAdam

    return LowPrecisionAdam(
        params,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        decoupled=decoupled,
        state_dtype=state_dtype,
    )


def _adamw_over(params: list[nn.Parameter], settings: OptimizerSettings) -> torch.optim.Optimizer:
    """AdamW as ``optimizer.name = "AdamW"`` makes it, over ``params`` (all of a model's, or Muon's others)."""
    low_precision = _low_precision_adam(params, settings, decoupled=True)
    if low_precision is not None:
        return low_precision
    return torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        **implementation_flags(settings.get(IMPLEMENTATION)),
    )


def _build_adamw(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    return _adamw_over(trainable_parameters(model), settings)


def _build_adam(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    low_precision = _low_precision_adam(trainable_parameters(model), settings, decoupled=False)
    if low_precision is not None:
        return low_precision
    return torch.optim.Adam(
        trainable_parameters(model),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        **implementation_flags(settings.get(IMPLEMENTATION)),
    )


def _hidden_split(model: nn.Module, name: str) -> tuple[list, list]:
    """(hidden matrices, other parameters) of ``model`` for optimizer ``name``, by declared role or name; a model
    with no hidden matrix is refused in one line."""
    from torchtitan.optim.muon.optimizer import split_hidden_matrices

    roles = model.named_param_roles() if hasattr(model, "named_param_roles") else None
    matrices, others = split_hidden_matrices(model.named_parameters(), roles)
    if not matrices:
        raise UserError(
            f"{name} found no hidden matrices in {type(model).__name__} (2-D query, key, value, attention output or "
            "MLP weights, by declared role or name); use AdamW for this model"
        )
    return matrices, others


def _muon_family_factory(name: str) -> Callable[[nn.Module, OptimizerSettings], torch.optim.Optimizer]:
    """Muon or NorMuon on the hidden matrices; AdamW, exactly as ``optimizer.name = "AdamW"`` has it, on everything
    else."""

    def build(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
        from torchtitan.optim.muon.normuon import NorMuon
        from torchtitan.optim.muon.optimizer import Muon, log_split

        matrices, others = _hidden_split(model, name)
        log_split(matrices, others)
        # Options left unset take the optimizer's own defaults; [optimizer] names them as its constructor does.
        own = (*MUON_OPTIONS, STATE_DTYPE) + (NORMUON_OPTIONS if name == "NorMuon" else ())
        chosen = settings.chosen(*own)
        if NORMUON_STEP_SIZE in chosen:
            chosen["step_size"] = chosen.pop(NORMUON_STEP_SIZE)
        return {"Muon": Muon, "NorMuon": NorMuon}[name](
            [p for _, p in matrices],
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            others=_adamw_over([p for _, p in others], settings) if others else None,
            **chosen,
        )

    return build


def _build_soap(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """SOAP on the hidden matrices (Muon's split); AdamW, as ``optimizer.name = "AdamW"`` has it with float32
    moments, on everything else."""
    from torchtitan.optim.soap.optimizer import SOAP, log_split

    matrices, others = _hidden_split(model, "SOAP")
    chosen = settings.chosen(*SOAP_OPTIONS)
    log_split(matrices, others, chosen[MAX_PRECONDITION_DIM])
    adamw_settings = dataclasses.replace(
        settings, options=MappingProxyType({IMPLEMENTATION: settings.get(IMPLEMENTATION), STATE_DTYPE: "float32"})
    )
    return SOAP(
        [p for _, p in matrices],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        others=_adamw_over([p for _, p in others], adamw_settings) if others else None,
        **chosen,
    )


def _adam_mini_factory(quantized: Optional[str]) -> Callable[[nn.Module, OptimizerSettings], torch.optim.Optimizer]:
    """AdamMini with its momentum stored as ``state_dtype`` or, for AdamMini8bit/4bit, ``quantized``."""

    def build(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
        storage = quantized or settings.get(STATE_DTYPE)
        optimizer = _build_adam_mini(
            model,
            settings,
            momentum_storage=storage,
            block_size=settings.get(BLOCK_SIZE) if quantized else None,
            implementation=settings.get(IMPLEMENTATION),
        )
        if quantized:
            portable_quantized_state(optimizer)
        return optimizer

    return build


def _build_adam_mini(model: nn.Module, settings: OptimizerSettings, **storage: Any) -> torch.optim.Optimizer:
    from torchtitan.optim.adam_mini.optimizer import AdamMini

    args = getattr(model, "args", None)
    if args is None or not hasattr(model, "named_param_roles"):
        raise UserError(
            f"AdamMini needs the model's shape and weight roles (model.args, model.named_param_roles()); "
            f"{type(model).__name__} lacks them. Use AdamW for this model."
        )
    return AdamMini(
        [(name, p) for name, p in model.named_parameters() if p.requires_grad],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        param_roles=model.named_param_roles(),
        **{option: settings.get(option) for option in ADAM_MINI_PARTITION_OPTIONS},
        **storage,
    )


def _low_bit_factory(name: str) -> Callable[[nn.Module, OptimizerSettings], torch.optim.Optimizer]:
    def build(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
        cls = low_bit_class(name)
        extra = settings.chosen(BLOCK_SIZE, BF16_STOCHASTIC_ROUND)  # unset: torchao's own defaults
        optimizer = cls(
            trainable_parameters(model),
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            **extra,
        )
        portable_quantized_state(optimizer)
        return optimizer

    return build


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    build: Callable[[nn.Module, OptimizerSettings], torch.optim.Optimizer]

    @property
    def options(self) -> frozenset[str]:
        """The optional [optimizer] options it takes (``settings.TAKES``)."""
        return frozenset(TAKES[self.name])

    @property
    def state_options(self) -> tuple[str, ...]:
        """Its options that shape the optimizer state, sorted."""
        return state_options(self.name)


def _build_ademamix(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    from torchtitan.optim.ademamix.optimizer import AdEMAMix

    return AdEMAMix(
        trainable_parameters(model),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        alpha=settings.get(ADEMAMIX_ALPHA),
        beta3=settings.get(ADEMAMIX_BETA3),
        warmup_steps=settings.get(ADEMAMIX_WARMUP_STEPS),
        state_dtype=settings.get(STATE_DTYPE),
    )


# The factory of each optimizer, in settings.TAKES' order (a test checks that the two name the same optimizers).
_FACTORIES: dict[str, Callable[[nn.Module, OptimizerSettings], torch.optim.Optimizer]] = {
    "AdamW": _build_adamw,
    "Adam": _build_adam,
    "AdamMini": _adam_mini_factory(None),
    "AdamMini8bit": _adam_mini_factory("int8"),
    "AdamMini4bit": _adam_mini_factory("int4"),
    "AdamW8bit": _low_bit_factory("AdamW8bit"),
    "AdamW4bit": _low_bit_factory("AdamW4bit"),
    "AdamWFp8": _low_bit_factory("AdamWFp8"),
    "Muon": _muon_family_factory("Muon"),
    "NorMuon": _muon_family_factory("NorMuon"),
    "AdEMAMix": _build_ademamix,
    "SOAP": _build_soap,
}
OPTIMIZERS: dict[str, OptimizerKind] = {name: OptimizerKind(name, _FACTORIES[name]) for name in TAKES}


def resolve_optimizer_name(name: str) -> OptimizerKind:
    """The registry entry for ``optimizer.name`` as a user wrote it; UserError for an unknown one."""
    return OPTIMIZERS[canonical_name(name)]


def build_optimizers(model_parts: Iterable[nn.Module], job_config: Any) -> OptimizersContainer:
    """One optimizer per model part, all of the kind and settings in ``job_config.optimizer``."""
    return build_from_settings(model_parts, optimizer_settings(job_config))


def build_from_settings(model_parts: Iterable[nn.Module], settings: OptimizerSettings) -> OptimizersContainer:
    """One optimizer per model part from settings already checked and resolved."""
    model_parts = list(model_parts)
    build = OPTIMIZERS[settings.name].build
    return OptimizersContainer(model_parts, [build(part, settings) for part in model_parts], settings.name)
