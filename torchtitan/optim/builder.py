"""The optimizer registry: build the job's optimizer from ``[optimizer]``, one per model part, in a container.

Optimizer names are case-insensitive and ignore ``-`` and ``_`` (``adam_mini``, ``Adam-mini`` and ``AdamMini`` are
one optimizer). Every ``[optimizer]`` option is either used by the chosen optimizer or rejected: a silently ignored
option would make two runs look different when they are not. The container is in ``container.py``, torchao's
low-bit optimizers are adapted in ``torchao_adapter.py``, and the options are read and checked in
``hyperparameters.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from torchtitan.errors import UserError
from torchtitan.optim.container import OptimizersContainer
from torchtitan.optim.hyperparameters import (
    BF16_STOCHASTIC_ROUND,
    BLOCK_SIZE,
    IMPLEMENTATION,
    MUON_OPTIONS,
    NORMUON_OPTIONS,
    STATE_DTYPE,
    VALUE_BLOCKS,
    Hyperparameters,
)
from torchtitan.optim.lowbit.torchao_adapter import low_bit_class, portable_quantized_state

_LOW_BIT_OPTIONS = frozenset({BLOCK_SIZE, BF16_STOCHASTIC_ROUND})


def check_hyperparameters(kind: "OptimizerKind", hp: Hyperparameters, weights_dtype: Optional[str] = None) -> None:
    """Raise UserError for values torch's Adam refuses and for options the chosen optimizer does not take
    (``weights_dtype``: ``training.param_dtype``, where known)."""
    hp.check()
    if kind.name in ("AdamW", "Adam", "Muon", "NorMuon") and weights_dtype == "bfloat16":  # Muon: its AdamW part
        _check_own_step_for_bfloat16_weights(hp)
    for option in sorted(hp.options_set() - kind.options):
        users = sorted(k.name for k in OPTIMIZERS.values() if option in k.options)
        raise UserError(
            f"optimizer.{option} does not apply to {kind.name} (only to {', '.join(users)}); remove it from the config"
        )
    if kind.name in ("AdamW4bit", "AdamMini4bit") and hp.block_size is not None and hp.block_size % 2:
        raise UserError(
            f"optimizer.block_size must be even for {kind.name} (two 4-bit codes per byte); got {hp.block_size}"
        )
    if kind.name == "AdamMini" and hp.implementation == "for-loop":
        raise UserError("optimizer.implementation for AdamMini is foreach or fused (it has no for-loop version)")


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
    params: list[nn.Parameter], hp: Hyperparameters, decoupled: bool
) -> Optional[torch.optim.Optimizer]:
    """AdamW/Adam with moments in a dtype other than the weights': bfloat16 moments, or the float32 moments that
    ``state_dtype`` promises for bfloat16 weights (our compiled step: torch's kernels keep moments in the weights'
    dtype). None where torch's own optimizer keeps what ``state_dtype`` says."""
    state_dtype = hp.state_dtype or "float32"
    low_precision_weights = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if state_dtype == "float32" and not low_precision_weights:
        return None
    _check_own_step_for_bfloat16_weights(hp)
    from torchtitan.optim.lowbit.adamw import LowPrecisionAdam

    return LowPrecisionAdam(
        params,
        lr=hp.lr,
        betas=hp.betas,
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        decoupled=decoupled,
        state_dtype=state_dtype,
    )


def _check_own_step_for_bfloat16_weights(hp: Hyperparameters) -> None:
    """Moments in a dtype other than the weights' come from our compiled step, never from torch's kernels."""
    if hp.implementation is not None:
        raise UserError(
            f"optimizer.implementation chooses torch's kernels, which keep the moments in the weights' dtype; remove "
            f"it to get {hp.state_dtype or 'float32'} moments (optimizer.state_dtype) from a compiled step of our own"
        )


def _adamw_over(params: list[nn.Parameter], hp: Hyperparameters) -> torch.optim.Optimizer:
    """AdamW as ``optimizer.name = "AdamW"`` makes it, over ``params`` (all of a model's, or Muon's others)."""
    low_precision = _low_precision_adam(params, hp, decoupled=True)
    if low_precision is not None:
        return low_precision
    return torch.optim.AdamW(
        params,
        lr=hp.lr,
        betas=hp.betas,
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        **implementation_flags(hp.implementation),
    )


def _build_adamw(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
    return _adamw_over(trainable_parameters(model), hp)


def _build_adam(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
    low_precision = _low_precision_adam(trainable_parameters(model), hp, decoupled=False)
    if low_precision is not None:
        return low_precision
    return torch.optim.Adam(
        trainable_parameters(model),
        lr=hp.lr,
        betas=hp.betas,
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        **implementation_flags(hp.implementation),
    )


def _muon_family_factory(name: str) -> Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]:
    """Muon or NorMuon on the hidden matrices; AdamW, exactly as ``optimizer.name = "AdamW"`` has it, on everything
    else."""

    def build(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
        from torchtitan.optim.muon.normuon import NorMuon
        from torchtitan.optim.muon.optimizer import Muon, log_split, split_hidden_matrices

        roles = model.named_param_roles() if hasattr(model, "named_param_roles") else None
        matrices, others = split_hidden_matrices(model.named_parameters(), roles)
        if not matrices:
            raise UserError(
                f"{name} found no hidden matrices in {type(model).__name__} (2-D query, key, value, attention output "
                "or MLP weights, by declared role or name); use AdamW for this model"
            )
        log_split(matrices, others)
        # Options left unset take the optimizer's own defaults; [optimizer] names them as its constructor does.
        own = (*MUON_OPTIONS, STATE_DTYPE) + (NORMUON_OPTIONS if name == "NorMuon" else ())
        chosen = {option: getattr(hp, option) for option in own if getattr(hp, option) is not None}
        return {"Muon": Muon, "NorMuon": NorMuon}[name](
            [p for _, p in matrices],
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            others=_adamw_over([p for _, p in others], hp) if others else None,
            **chosen,
        )

    return build


def _adam_mini_factory(quantized: Optional[str]) -> Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]:
    """AdamMini with its momentum stored as ``state_dtype`` or, for AdamMini8bit/4bit, ``quantized``."""

    def build(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
        storage = quantized or hp.state_dtype or "float32"
        optimizer = _build_adam_mini(
            model, hp, momentum_storage=storage, block_size=hp.block_size, implementation=hp.implementation
        )
        if quantized:
            portable_quantized_state(optimizer)
        return optimizer

    return build


def _build_adam_mini(model: nn.Module, hp: Hyperparameters, **storage: Any) -> torch.optim.Optimizer:
    from torchtitan.optim.adam_mini.optimizer import AdamMini

    args = getattr(model, "args", None)
    if args is None or not hasattr(model, "named_param_roles"):
        raise UserError(
            f"AdamMini needs the model's shape and weight roles (model.args, model.named_param_roles()); "
            f"{type(model).__name__} lacks them. Use AdamW for this model."
        )
    extra = {} if hp.value_blocks is None else {"value_blocks": hp.value_blocks}
    return AdamMini(
        [(name, p) for name, p in model.named_parameters() if p.requires_grad],
        lr=hp.lr,
        betas=hp.betas,
        eps=hp.eps,
        weight_decay=hp.weight_decay,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        param_roles=model.named_param_roles(),
        **extra,
        **storage,
    )


def _low_bit_factory(name: str) -> Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]:
    def build(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
        cls = low_bit_class(name)
        extra: dict[str, Any] = {}
        if hp.block_size is not None:
            extra["block_size"] = hp.block_size
        if hp.bf16_stochastic_round is not None:
            extra["bf16_stochastic_round"] = hp.bf16_stochastic_round
        optimizer = cls(
            trainable_parameters(model),
            lr=hp.lr,
            betas=hp.betas,
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            **extra,
        )
        portable_quantized_state(optimizer)
        return optimizer

    return build


@dataclass(frozen=True)
class OptionRule:
    """What an optional ``[optimizer]`` option does to a checkpoint.

    ``shapes_state``: runs that differ in it hold optimizer states that do not load into each other (dtype, block
    shape, quantization blocks), so their checkpoint folders are apart and a load refuses the other's.
    ``unset_means``: the value an unset option stands for in every optimizer that takes it, so that leaving it
    unset and naming that value are one state.
    """

    shapes_state: bool
    unset_means: Optional[str] = None


# Every optional option an optimizer may take is declared here (a test checks it).
OPTION_RULES: dict[str, OptionRule] = {
    IMPLEMENTATION: OptionRule(shapes_state=False),  # foreach, fused: the same state
    BF16_STOCHASTIC_ROUND: OptionRule(shapes_state=False),  # how weights are rounded, not the state
    STATE_DTYPE: OptionRule(shapes_state=True, unset_means="float32"),
    VALUE_BLOCKS: OptionRule(shapes_state=True, unset_means="per_row"),
    BLOCK_SIZE: OptionRule(shapes_state=True),
    # Muon's update rule (momentum, Nesterov, Newton-Schulz steps and dtype, lr scale): one momentum buffer whatever
    # they are.
    **{option: OptionRule(shapes_state=False) for option in MUON_OPTIONS},
    # NorMuon's per-row second moment (its decay and epsilon): one value per row whatever they are.
    **{option: OptionRule(shapes_state=False) for option in NORMUON_OPTIONS},
}


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    build: Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]
    options: frozenset[str] = frozenset()  # optional [optimizer] options it takes, each declared in OPTION_RULES

    @property
    def state_options(self) -> tuple[str, ...]:
        """Its options that shape the optimizer state, sorted."""
        return tuple(sorted(o for o in self.options if OPTION_RULES[o].shapes_state))


OPTIMIZERS: dict[str, OptimizerKind] = {
    kind.name: kind
    for kind in (
        OptimizerKind("AdamW", _build_adamw, frozenset({IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind("Adam", _build_adam, frozenset({IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind("AdamMini", _adam_mini_factory(None), frozenset({VALUE_BLOCKS, IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind(
            "AdamMini8bit", _adam_mini_factory("int8"), frozenset({VALUE_BLOCKS, IMPLEMENTATION, BLOCK_SIZE})
        ),
        OptimizerKind(
            "AdamMini4bit", _adam_mini_factory("int4"), frozenset({VALUE_BLOCKS, IMPLEMENTATION, BLOCK_SIZE})
        ),
        OptimizerKind("AdamW8bit", _low_bit_factory("AdamW8bit"), _LOW_BIT_OPTIONS),
        OptimizerKind("AdamW4bit", _low_bit_factory("AdamW4bit"), _LOW_BIT_OPTIONS),
        OptimizerKind("AdamWFp8", _low_bit_factory("AdamWFp8"), _LOW_BIT_OPTIONS),
        # implementation and state_dtype apply to its AdamW part as to AdamW (state_dtype also to the momentum).
        OptimizerKind("Muon", _muon_family_factory("Muon"), frozenset({IMPLEMENTATION, STATE_DTYPE, *MUON_OPTIONS})),
        OptimizerKind(
            "NorMuon",
            _muon_family_factory("NorMuon"),
            frozenset({IMPLEMENTATION, STATE_DTYPE, *MUON_OPTIONS, *NORMUON_OPTIONS}),
        ),
    )
}


def _lookup_key(name: str) -> str:
    """Case, '-' and '_' do not matter: 'adam_mini', 'Adam-mini' and 'AdamMini' are one optimizer."""
    return name.lower().replace("-", "").replace("_", "")


def resolve_optimizer_name(name: str) -> OptimizerKind:
    by_key = {_lookup_key(canonical): kind for canonical, kind in OPTIMIZERS.items()}
    kind = by_key.get(_lookup_key(name))
    if kind is None:
        raise UserError(f"unknown optimizer.name '{name}'; valid names: {', '.join(OPTIMIZERS)} (case-insensitive)")
    return kind


def state_signature(job_config: Any) -> dict[str, Any]:
    """The job's values of its optimizer's state-shaping options (unset ones as the value they stand for, or None).

    Two jobs of one optimizer whose signatures differ hold states that must not load into each other.
    """
    kind = resolve_optimizer_name(job_config.optimizer.name)
    signature = {}
    for option in kind.state_options:
        value = getattr(job_config.optimizer, option)
        signature[option] = OPTION_RULES[option].unset_means if value is None else value
    return signature


def state_label(job_config: Any) -> str:
    """The optimizer's name, then each state-shaping option that differs from its unset value, e.g.
    ``AdamMini`` or ``AdamMini-state_dtype=bfloat16-value_blocks=per_tensor``: a folder name per optimizer state."""
    kind = resolve_optimizer_name(job_config.optimizer.name)
    set_options = [
        f"{option}={value}"
        for option, value in state_signature(job_config).items()
        if value is not None and value != OPTION_RULES[option].unset_means
    ]
    return "-".join([kind.name, *set_options])


def build_optimizers(model_parts: Iterable[nn.Module], job_config: Any) -> OptimizersContainer:
    """One optimizer per model part, all of the kind and hyperparameters in ``job_config.optimizer``."""
    kind = resolve_optimizer_name(job_config.optimizer.name)
    hp = Hyperparameters.from_job_config(job_config)
    check_hyperparameters(kind, hp)
    model_parts = list(model_parts)
    return OptimizersContainer(model_parts, [kind.build(part, hp) for part in model_parts], kind.name)
