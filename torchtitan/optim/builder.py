"""Build the job's optimizer from ``[optimizer]`` and wrap one optimizer per model part in a container.

The container is what the trainer, the LR schedulers and the checkpoint manager see: ``step``/``zero_grad`` for the
loop, ``optimizers`` (each a plain ``torch.optim.Optimizer`` with ``param_groups[i]["lr"]``) for one scheduler per
optimizer, a flattened DCP-ready ``state_dict`` that reshards across world sizes, and ``state_bytes`` for memory
reporting.

Optimizer names are case-insensitive and ignore ``-`` and ``_`` (``adam_mini``, ``Adam-mini`` and ``AdamMini`` are
one optimizer). Every ``[optimizer]`` option is either used by the chosen optimizer or rejected: a silently ignored
option would make two runs look different when they are not.

The low-bit AdamW variants come from torchao (the ``lowbit`` extra). Their quantized moments are written to
checkpoints as plain float32 tensors shaped like the parameter and quantized again on load, so a low-bit checkpoint
reshards across world sizes like an AdamW one and loads without torchao's tensor classes (saving briefly holds
that float32 copy of the state).
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.errors import UserError
from torchtitan.optim.state_storage import dequantized, is_quantized

# Flattened keys ("state.<param fqn>.exp_avg") let DCP match state to parameters by name, whatever the sharding.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

# [optimizer] options that only some optimizers take; the rest (lr, betas, eps, weight_decay) apply to all.
IMPLEMENTATION, VALUE_BLOCKS, BLOCK_SIZE, BF16_STOCHASTIC_ROUND, STATE_DTYPE = (
    "implementation", "value_blocks", "block_size", "bf16_stochastic_round", "state_dtype"
)
OPTIONAL_OPTIONS = (IMPLEMENTATION, VALUE_BLOCKS, BLOCK_SIZE, BF16_STOCHASTIC_ROUND, STATE_DTYPE)
_LOW_BIT_OPTIONS = frozenset({BLOCK_SIZE, BF16_STOCHASTIC_ROUND})


# ----------------------------------------------------------------------------------------------------------------
# Hyperparameters


@dataclass(frozen=True)
class Hyperparameters:
    """The ``[optimizer]`` options, read once from the job config."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    implementation: Optional[str] = None
    value_blocks: Optional[str] = None
    block_size: Optional[int] = None
    bf16_stochastic_round: Optional[bool] = None
    state_dtype: Optional[str] = None

    @classmethod
    def from_job_config(cls, job_config: Any) -> "Hyperparameters":
        o = job_config.optimizer
        return cls(
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            implementation=o.implementation, value_blocks=o.value_blocks, block_size=o.block_size,
            bf16_stochastic_round=o.bf16_stochastic_round, state_dtype=o.state_dtype,
        )

    def options_set(self) -> set[str]:
        """The optional options the user set (left unset they are None)."""
        return {name for name in OPTIONAL_OPTIONS if getattr(self, name) is not None}


def check_hyperparameters(kind: "OptimizerKind", hp: Hyperparameters) -> None:
    """Raise UserError for values no Adam-family optimizer can use and for options the chosen one does not take."""
    beta1, beta2 = hp.betas
    if not hp.lr > 0:
        raise UserError(f"optimizer.lr must be positive; got {hp.lr}")
    if not hp.eps > 0:
        raise UserError(f"optimizer.eps must be positive (it keeps the update's denominator above 0); got {hp.eps}")
    for key, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise UserError(
                f"optimizer.{key} must be in [0, 1) (1.0 would freeze the moment at its initial zeros); got {beta}"
            )
    if not hp.weight_decay >= 0:
        raise UserError(f"optimizer.weight_decay must be at least 0; got {hp.weight_decay}")
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


def _low_precision_adam(model: nn.Module, hp: Hyperparameters, decoupled: bool) -> Optional[torch.optim.Optimizer]:
    """AdamW/Adam with bfloat16 moments (our compiled step: torch's kernels need moments in the parameter's dtype)."""
    if hp.state_dtype in (None, "float32"):
        return None
    if hp.implementation is not None:
        raise UserError(f"optimizer.implementation chooses torch's kernels, which keep float32 state; remove it "
                        f"to use optimizer.state_dtype = {hp.state_dtype} (a compiled step of its own)")
    from torchtitan.optim.adamw_low_precision import LowPrecisionAdam

    return LowPrecisionAdam(trainable_parameters(model), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, decoupled=decoupled, state_dtype=hp.state_dtype)


def _build_adamw(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
    low_precision = _low_precision_adam(model, hp, decoupled=True)
    if low_precision is not None:
        return low_precision
    return torch.optim.AdamW(
        trainable_parameters(model), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
        **implementation_flags(hp.implementation),
    )


def _build_adam(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
    low_precision = _low_precision_adam(model, hp, decoupled=False)
    if low_precision is not None:
        return low_precision
    return torch.optim.Adam(
        trainable_parameters(model), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
        **implementation_flags(hp.implementation),
    )


def _adam_mini_factory(quantized: Optional[str]) -> Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]:
    """AdamMini with its momentum stored as ``state_dtype`` or, for AdamMini8bit/4bit, ``quantized``."""

    def build(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
        storage = quantized or hp.state_dtype or "float32"
        optimizer = _build_adam_mini(model, hp, momentum_storage=storage, block_size=hp.block_size,
                                     implementation=hp.implementation)
        if quantized:
            _portable_quantized_state(optimizer)
        return optimizer

    return build


def _build_adam_mini(model: nn.Module, hp: Hyperparameters, **storage: Any) -> torch.optim.Optimizer:
    from torchtitan.optim.adam_mini import AdamMini

    args = getattr(model, "args", None)
    if args is None or not hasattr(model, "named_param_roles"):
        raise UserError(
            f"AdamMini needs the model's shape and weight roles (model.args, model.named_param_roles()); "
            f"{type(model).__name__} lacks them. Use AdamW for this model."
        )
    extra = {} if hp.value_blocks is None else {"value_blocks": hp.value_blocks}
    return AdamMini(
        [(name, p) for name, p in model.named_parameters() if p.requires_grad],
        lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
        dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
        param_roles=model.named_param_roles(), **extra, **storage,
    )


def _low_bit_factory(name: str) -> Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]:
    def build(model: nn.Module, hp: Hyperparameters) -> torch.optim.Optimizer:
        cls = _low_bit_class(name)
        extra: dict[str, Any] = {}
        if hp.block_size is not None:
            extra["block_size"] = hp.block_size
        if hp.bf16_stochastic_round is not None:
            extra["bf16_stochastic_round"] = hp.bf16_stochastic_round
        optimizer = cls(
            trainable_parameters(model), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
            **extra,
        )
        _portable_quantized_state(optimizer)
        return optimizer

    return build


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    build: Callable[[nn.Module, Hyperparameters], torch.optim.Optimizer]
    options: frozenset[str] = frozenset()  # optional [optimizer] options it takes

OPTIMIZERS: dict[str, OptimizerKind] = {
    kind.name: kind
    for kind in (
        OptimizerKind("AdamW", _build_adamw, frozenset({IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind("Adam", _build_adam, frozenset({IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind("AdamMini", _adam_mini_factory(None), frozenset({VALUE_BLOCKS, IMPLEMENTATION, STATE_DTYPE})),
        OptimizerKind("AdamMini8bit", _adam_mini_factory("int8"), frozenset({VALUE_BLOCKS, IMPLEMENTATION, BLOCK_SIZE})),
        OptimizerKind("AdamMini4bit", _adam_mini_factory("int4"), frozenset({VALUE_BLOCKS, IMPLEMENTATION, BLOCK_SIZE})),
        OptimizerKind("AdamW8bit", _low_bit_factory("AdamW8bit"), _LOW_BIT_OPTIONS),
        OptimizerKind("AdamW4bit", _low_bit_factory("AdamW4bit"), _LOW_BIT_OPTIONS),
        OptimizerKind("AdamWFp8", _low_bit_factory("AdamWFp8"), _LOW_BIT_OPTIONS),
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


def build_optimizers(model_parts: Iterable[nn.Module], job_config: Any) -> "OptimizersContainer":
    """One optimizer per model part, all of the kind and hyperparameters in ``job_config.optimizer``."""
    kind = resolve_optimizer_name(job_config.optimizer.name)
    hp = Hyperparameters.from_job_config(job_config)
    check_hyperparameters(kind, hp)
    model_parts = list(model_parts)
    return OptimizersContainer(model_parts, [kind.build(part, hp) for part in model_parts], kind.name)


# ----------------------------------------------------------------------------------------------------------------
# The container


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
        """Flattened state of all parts, keyed by parameter name: DCP saves it and reshards it on load."""
        state: dict[str, Any] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            initialise_state(optimizer)
            state.update(get_optimizer_state_dict(model, optimizer, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, optimizer in zip(self.model_parts, self.optimizers):
            # A fresh optimizer has no state to load into yet; create it (as zeros) first.
            initialise_state(optimizer)
            set_optimizer_state_dict(model, optimizer, state_dict, options=_FLAT)

    def state_bytes(self) -> int:
        """This rank's bytes of optimizer state (local shards only; meta and fake tensors count their size).

        State that optimizers create on their first step is created here (as a fresh optimizer would have it).
        """
        total = 0
        for optimizer in self.optimizers:
            initialise_state(optimizer)
            total += sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values())
        return total


# ----------------------------------------------------------------------------------------------------------------
# State helpers


def tensor_bytes(value: Any) -> int:
    """Bytes a state value holds on this rank: a DTensor counts its local shard, a quantized subclass its parts."""
    if not isinstance(value, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(value):
        inner_names, _ = value.__tensor_flatten__()
        return sum(tensor_bytes(getattr(value, inner)) for inner in inner_names)
    return value.numel() * value.element_size()


@torch.no_grad()
def initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily made state as a fresh optimizer would have it, without changing parameters.

    Optimizers create their state on the first step, but a checkpoint can only be saved from or loaded into state
    that exists. We run one step with zero gradients, zero lr and zero weight decay (so no parameter and no moment
    moves), then set the step counters back to 0, so that training continues exactly as if nothing had happened.
    (AdamW-style decay is left on: at lr 0 it does nothing.)
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params:
        return
    saved_grads = [p.grad for p in params]
    saved_groups = [(group["lr"], group.get("weight_decay")) for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            # A tensor lr keeps its type (torchao requires one); the original object is restored below.
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            if "weight_decay" in group and not _decoupled_weight_decay(optimizer, group):
                group["weight_decay"] = 0.0
        # Meta and fake parameters (memory estimates) have no data to compile kernels for: run such steps eagerly.
        dataless = any(_is_dataless(p) for p in params)
        with torch.compiler.set_stance("force_eager") if dataless else contextlib.nullcontext():
            optimizer.step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for group, (lr, weight_decay) in zip(optimizer.param_groups, saved_groups):
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
    for state in optimizer.state.values():
        _reset_step(state)


def _is_dataless(t: torch.Tensor) -> bool:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.device.type == "meta" or is_fake(local)


def _decoupled_weight_decay(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether weight decay scales with lr (AdamW-style), so that lr 0 already stops it.

    Such decay may stay on during the zero step, which spares torchao a recompile for a changed constant; L2 decay
    (Adam's, added to the gradient) would fill the moments and is switched off.
    """
    return group.get("decoupled_weight_decay") is True or getattr(optimizer, "is_adamw", False) is True


def _reset_step(state: dict[str, Any]) -> None:
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        step.zero_()
    elif step is not None:
        state["step"] = type(step)(0)


# ----------------------------------------------------------------------------------------------------------------
# torchao low-bit optimizers


def _import_torchao_optim():
    # torchao's import warns about things that do not concern its optimizers: CUDA kernels that a CPU-only machine
    # cannot load, and a deprecated pytree registration. Keep those lines out of the user's log.
    noisy = [logging.getLogger("torch.utils._pytree")]
    if not torch.cuda.is_available():
        noisy.append(logging.getLogger("torchao"))
    levels = [log.level for log in noisy]
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        import torchao.optim as torchao_optim
    except ImportError as e:
        raise UserError(
            f"the low-bit optimizers need torchao, which is not importable ({e}); "
            "install it with: pip install 'torchtitan[lowbit]' (or pip install torchao)"
        ) from None
    finally:
        for log, level in zip(noisy, levels):
            log.setLevel(level)
    return torchao_optim


_low_bit_classes: dict[str, type] = {}


def _low_bit_class(name: str) -> type:
    """torchao's optimizer ``name`` whose step compiles into a cache folder of its own."""
    if name not in _low_bit_classes:
        base = getattr(_import_torchao_optim(), name)

        def step(self, closure=None):
            with separate_compile_cache(name):
                return base.step(self, closure)

        _low_bit_classes[name] = type(name, (base,), {"step": step, "__module__": __name__})
    return _low_bit_classes[name]


@contextlib.contextmanager
def separate_compile_cache(tag: str) -> Iterator[None]:
    """Compile inside ``<inductor cache>/optim_<tag>`` while the block runs.

    torchao compiles each low-bit step for its own quantized state classes; sharing one on-disk inductor cache
    between optimizer kinds can hand one kind's cached graph to another. One folder per kind keeps them apart (and
    keeps warm restarts warm).
    """
    original = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    base = original or _default_inductor_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"optim_{tag}")
    try:
        yield
    finally:
        if original is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = original


def _default_inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return default_cache_dir()
    except ImportError:  # the helper moved; the same place by hand
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")


def _portable_quantized_state(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` hold plain float tensors and ``load_state_dict`` quantize them again.

    Plain tensors shaped like the parameter reshard through DCP like any AdamW state; the quantized classes do not
    (their block scales follow the local shard) and need torchao's classes to unpickle. Quantizing the saved values
    again is exact for the second moment and for FP8; a first-moment block whose largest value is negative comes back
    with a slightly smaller scale (torchao's signed code tables end below -1: -0.993 for 8-bit, -0.8875 for 4-bit),
    so a resumed run matches an uninterrupted one up to that quantization noise.
    """
    # Live quantized tensors, per parameter, between the pre- and the post-hook of one load_state_dict call.
    live_quantized: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def quantize_into_live_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        # Copy now, from the incoming float32 values: torch is about to cast them to the parameter's dtype.
        live_quantized.clear()
        for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
            for key, param in zip(saved_group["params"], group["params"]):
                incoming = state_dict["state"].get(key, {})
                live = {name: value for name, value in optimizer.state.get(param, {}).items()
                        if is_quantized(value) and name in incoming}
                for name, value in live.items():
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


def _dequantize_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    # The per-parameter dicts in state_dict are the optimizer's own: build new ones rather than edit them.
    state_dict["state"] = {
        index: {key: dequantized(v) if is_quantized(v) else v for key, v in param_state.items()}
        for index, param_state in state_dict["state"].items()
    }
    return state_dict
