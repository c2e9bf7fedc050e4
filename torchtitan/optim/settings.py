"""One pass over ``[optimizer]``: every option read, checked and resolved here, and handed to the builder ready.

:func:`optimizer_settings` turns a job config into :class:`OptimizerSettings` (the canonical optimizer name, the
Adam hyperparameters, and each optional option the optimizer takes, resolved). Two tables say which optimizer takes
which option: :data:`TAKES` (per optimizer, its optional options; every other optimizer refuses them with one line
naming those that take them) and :data:`OPTION_RULES` (per option, what it does to a checkpoint and what unset
means). Checks that concern one optimizer alone are in :data:`OWN_CHECKS`.

The Adam rules are torch.optim's own (``torch.optim.Adam``/``AdamW``): lr, eps and weight_decay at least 0, each beta
in [0, 1). The job config (:func:`check_values`, as it parses), the builder and ``AdamMini``'s constructor all call
:func:`check_adam_hyperparameters`, naming the values the way their users wrote them. This module does not import
torch, so that the job config is checked (and ``--help`` answers) without it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from torchtitan.errors import UserError

# The optional [optimizer] options (the rest, lr, betas, eps and weight_decay, apply to every optimizer).
IMPLEMENTATION, VALUE_BLOCKS, BLOCK_SIZE, BF16_STOCHASTIC_ROUND, STATE_DTYPE = (
    "implementation",
    "value_blocks",
    "block_size",
    "bf16_stochastic_round",
    "state_dtype",
)
MOMENTUM, NESTEROV, NS_STEPS, NS_DTYPE, ADJUST_LR = "momentum", "nesterov", "ns_steps", "ns_dtype", "adjust_lr"
MUON_OPTIONS = (MOMENTUM, NESTEROV, NS_STEPS, NS_DTYPE, ADJUST_LR)
NEURON_BETA2, NEURON_EPS, NORMUON_STEP_SIZE = "neuron_beta2", "neuron_eps", "normuon_step_size"
NORMUON_OPTIONS = (NEURON_BETA2, NEURON_EPS, NORMUON_STEP_SIZE)  # NorMuon's own, besides Muon's
LOW_BIT_OPTIONS = (BLOCK_SIZE, BF16_STOCHASTIC_ROUND)
PRECONDITION_FREQUENCY, MAX_PRECONDITION_DIM, SHAMPOO_BETA = (
    "precondition_frequency",
    "max_precondition_dim",
    "shampoo_beta",
)
SOAP_OPTIONS = (PRECONDITION_FREQUENCY, MAX_PRECONDITION_DIM, SHAMPOO_BETA)
EMBEDDING_BLOCKS, OUTPUT_BLOCKS, ATTN_OUT_BLOCKS, MLP_BLOCKS = (
    "embedding_blocks",
    "output_blocks",
    "attn_out_blocks",
    "mlp_blocks",
)
NORM_WEIGHT_DECAY = "norm_weight_decay"
# Adam-mini's partition: a rule per role (value_blocks, then these), and weight decay on norms.
ADAM_MINI_PARTITION_OPTIONS = (
    VALUE_BLOCKS,
    EMBEDDING_BLOCKS,
    OUTPUT_BLOCKS,
    ATTN_OUT_BLOCKS,
    MLP_BLOCKS,
    NORM_WEIGHT_DECAY,
)
ADEMAMIX_ALPHA, ADEMAMIX_BETA3, ADEMAMIX_WARMUP_STEPS = "ademamix_alpha", "ademamix_beta3", "ademamix_warmup_steps"
ADEMAMIX_OPTIONS = (ADEMAMIX_ALPHA, ADEMAMIX_BETA3, ADEMAMIX_WARMUP_STEPS)


@dataclass(frozen=True)
class OptionRule:
    """What an optional ``[optimizer]`` option does to a checkpoint.

    ``shapes_state``: runs that differ in it hold optimizer states that do not load into each other (dtype, block
    shape, quantization blocks), so their checkpoint folders are apart and a load refuses the other's.
    ``unset_means``: the value an unset option stands for in every optimizer that takes it, so that leaving it
    unset and naming that value are one state (and one setting: :class:`OptimizerSettings` holds that value).
    ``unset_from``: where the value of an unset option comes from when it depends on the rest of the job.
    """

    shapes_state: bool
    unset_means: Optional[Any] = None
    unset_from: Optional[Callable[[Any], Any]] = None

    def resolve(self, value: Any, job_config: Any) -> Any:
        """The option's setting: ``value`` if set, else what unset stands for (None: the optimizer's own default)."""
        if value is not None:
            return value
        return self.unset_from(job_config) if self.unset_from is not None else self.unset_means


# Every optional option, declared once (a test checks that every [optimizer] field is here or common to all).
OPTION_RULES: dict[str, OptionRule] = {
    IMPLEMENTATION: OptionRule(shapes_state=False),  # foreach, fused: the same state
    BF16_STOCHASTIC_ROUND: OptionRule(shapes_state=False),  # how weights are rounded, not the state
    STATE_DTYPE: OptionRule(shapes_state=True, unset_means="float32"),
    VALUE_BLOCKS: OptionRule(shapes_state=True, unset_means="per_row"),
    # Adam-mini's other rules shape v ((blocks, 1), or the parameter's shape per element); decay shapes nothing.
    **{option: OptionRule(shapes_state=True, unset_means="per_row") for option in (EMBEDDING_BLOCKS, OUTPUT_BLOCKS)},
    **{option: OptionRule(shapes_state=True, unset_means="per_row") for option in (ATTN_OUT_BLOCKS, MLP_BLOCKS)},
    NORM_WEIGHT_DECAY: OptionRule(shapes_state=False, unset_means=False),
    BLOCK_SIZE: OptionRule(shapes_state=True),
    # Muon's update rule (momentum, Nesterov, Newton-Schulz steps and dtype, lr scale): one momentum buffer whatever
    # they are.
    **{option: OptionRule(shapes_state=False) for option in MUON_OPTIONS},
    # NorMuon's per-row second moment (its decay and epsilon) and its step size: one value per row whatever they are.
    NEURON_BETA2: OptionRule(shapes_state=False),
    NEURON_EPS: OptionRule(shapes_state=False),
    NORMUON_STEP_SIZE: OptionRule(shapes_state=False, unset_means="reference"),
    # AdEMAMix's slow momentum: its weight and decay, and their warm-up (the paper's defaults; its warm-up spans the
    # whole run). Three moments shaped like the parameter whatever they are.
    ADEMAMIX_ALPHA: OptionRule(shapes_state=False, unset_means=5.0),
    ADEMAMIX_BETA3: OptionRule(shapes_state=False, unset_means=0.9999),
    ADEMAMIX_WARMUP_STEPS: OptionRule(shapes_state=False, unset_from=lambda job_config: job_config.training.steps),
    # SOAP's refresh interval and Shampoo decay: the same state whatever they are.
    PRECONDITION_FREQUENCY: OptionRule(shapes_state=False),
    SHAMPOO_BETA: OptionRule(shapes_state=False),
    # Which sides of a matrix keep a statistic and a basis.
    MAX_PRECONDITION_DIM: OptionRule(shapes_state=True, unset_means=10000),
}
OPTIONAL_OPTIONS = tuple(OPTION_RULES)

# Which optional options each optimizer takes, by canonical name (the registry's order): the one table of what
# applies where. An option set for an optimizer that does not take it is refused.
TAKES: dict[str, tuple[str, ...]] = {
    "AdamW": (IMPLEMENTATION, STATE_DTYPE),
    "Adam": (IMPLEMENTATION, STATE_DTYPE),
    "AdamMini": (*ADAM_MINI_PARTITION_OPTIONS, IMPLEMENTATION, STATE_DTYPE),
    "AdamMini8bit": (*ADAM_MINI_PARTITION_OPTIONS, IMPLEMENTATION, BLOCK_SIZE),
    "AdamMini4bit": (*ADAM_MINI_PARTITION_OPTIONS, IMPLEMENTATION, BLOCK_SIZE),
    "AdamW8bit": LOW_BIT_OPTIONS,
    "AdamW4bit": LOW_BIT_OPTIONS,
    "AdamWFp8": LOW_BIT_OPTIONS,
    # implementation and state_dtype apply to their AdamW part as to AdamW (state_dtype also to the momentum).
    "Muon": (IMPLEMENTATION, STATE_DTYPE, *MUON_OPTIONS),
    "NorMuon": (IMPLEMENTATION, STATE_DTYPE, *MUON_OPTIONS, *NORMUON_OPTIONS),
    "AdEMAMix": (STATE_DTYPE, *ADEMAMIX_OPTIONS),
    # implementation applies to its AdamW part as to AdamW.
    "SOAP": (IMPLEMENTATION, *SOAP_OPTIONS),
}
OPTIMIZER_NAMES = tuple(TAKES)

# How messages name the checked values: the job config's keys by default.
CONFIG_KEYS = {
    "lr": "optimizer.lr",
    "betas": "optimizer.beta1 and optimizer.beta2",
    "beta1": "optimizer.beta1",
    "beta2": "optimizer.beta2",
    "eps": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay",
}


def check_adam_hyperparameters(
    lr: Optional[float], betas: Any, eps: float, weight_decay: float, *, keys: Mapping[str, str] = CONFIG_KEYS
) -> None:
    """Raise UserError (one line, naming the value by ``keys``) for values torch.optim's Adam would refuse.

    ``lr`` None is not checked (a learning rate held in a meta or fake tensor has no value to read).
    """
    if lr is not None and not lr >= 0.0:
        raise UserError(f"{keys['lr']} must be at least 0; got {lr}")
    betas = tuple(betas)
    if len(betas) != 2:
        raise UserError(f"{keys['betas']} must be two numbers in [0, 1); got {betas}")
    for key, beta in (("beta1", betas[0]), ("beta2", betas[1])):
        if not 0.0 <= float(beta) < 1.0:
            raise UserError(
                f"{keys[key]} must be in [0, 1) (1.0 would freeze the moment at its initial zeros); got {beta}"
            )
    if not eps >= 0.0:
        raise UserError(f"{keys['eps']} must be at least 0; got {eps}")
    if not weight_decay >= 0.0:
        raise UserError(f"{keys['weight_decay']} must be at least 0; got {weight_decay}")


def _lookup_key(name: str) -> str:
    """Case, '-' and '_' do not matter: 'adam_mini', 'Adam-mini' and 'AdamMini' are one optimizer."""
    return name.lower().replace("-", "").replace("_", "")


def canonical_name(name: str) -> str:
    """The registry's name for ``optimizer.name`` as a user wrote it; UserError for an unknown one."""
    by_key = {_lookup_key(canonical): canonical for canonical in OPTIMIZER_NAMES}
    canonical = by_key.get(_lookup_key(name))
    if canonical is None:
        close = difflib.get_close_matches(_lookup_key(name), list(by_key), n=1, cutoff=0.75)
        hint = f"did you mean {by_key[close[0]]}? " if close else ""
        raise UserError(
            f"unknown optimizer.name '{name}'; {hint}valid names: {', '.join(OPTIMIZER_NAMES)} (case-insensitive)"
        )
    return canonical


@dataclass(frozen=True)
class OptimizerSettings:
    """A job's optimizer settings, checked and resolved: what the builder builds from.

    ``options`` holds every optional option the optimizer takes: the user's value, else what unset means
    (:data:`OPTION_RULES`), else None (the optimizer's own default).
    """

    name: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    weights_dtype: str = "float32"  # training.param_dtype
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, option: str) -> Any:
        """The resolved value of an option this optimizer takes (KeyError for one it does not take)."""
        return self.options[option]

    def chosen(self, *options: str) -> dict[str, Any]:
        """Those of ``options`` that have a value, as keyword arguments (unset ones: the optimizer's own default)."""
        return {option: self.options[option] for option in options if self.options[option] is not None}


def check_values(job_config: Any) -> None:
    """The checks of ``[optimizer]`` that do not depend on the optimizer: torch.optim's Adam rules, and options
    that act on the weights' dtype. The job config runs them as it parses."""
    o = job_config.optimizer
    check_adam_hyperparameters(o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
    param_dtype = job_config.training.param_dtype
    if o.bf16_stochastic_round is not None and param_dtype != "bfloat16":
        raise UserError(
            f"optimizer.bf16_stochastic_round rounds bfloat16 weights, but training.param_dtype is "
            f"{param_dtype}; remove it, or train bfloat16 weights"
        )


def options_set(job_config: Any) -> list[str]:
    """The optional options the job sets (left unset they are None), in :data:`OPTION_RULES`' order."""
    return [option for option in OPTIONAL_OPTIONS if getattr(job_config.optimizer, option) is not None]


def _refuse_options_not_taken(name: str, job_config: Any) -> None:
    for option in sorted(set(options_set(job_config)) - set(TAKES[name])):
        users = [other for other, taken in TAKES.items() if option in taken]
        raise UserError(
            f"optimizer.{option} does not apply to {name} (only to {', '.join(users)}); remove it from the config"
        )


def optimizer_settings(job_config: Any) -> OptimizerSettings:
    """Read, check and resolve every ``[optimizer]`` option of ``job_config``; UserError (one line) for the first
    mistake: an unknown name, a value torch.optim refuses, an option the optimizer does not take, or a value that
    the optimizer cannot use."""
    o = job_config.optimizer
    name = canonical_name(o.name)
    check_values(job_config)
    _refuse_options_not_taken(name, job_config)
    options = {option: OPTION_RULES[option].resolve(getattr(o, option), job_config) for option in TAKES[name]}
    settings = OptimizerSettings(
        name=name,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        weights_dtype=job_config.training.param_dtype,
        options=MappingProxyType(options),
    )
    for check in OWN_CHECKS.get(name, ()):
        check(settings)
    return settings


# ----------------------------------------------------------------------------------------------------------------
# Checks that concern one optimizer's values


def check_own_step_for_bfloat16_weights(settings: OptimizerSettings) -> None:
    """Moments in a dtype other than the weights' come from our compiled step, never from torch's kernels: for
    bfloat16 weights, ``implementation`` (which picks torch's kernels) is refused."""
    if settings.weights_dtype == "bfloat16":
        refuse_torch_kernels(settings)


def refuse_torch_kernels(settings: OptimizerSettings) -> None:
    if settings.get(IMPLEMENTATION) is not None:
        raise UserError(
            f"optimizer.implementation chooses torch's kernels, which keep the moments in the weights' dtype; remove "
            f"it to get {settings.get(STATE_DTYPE)} moments (optimizer.state_dtype) from a compiled step of our own"
        )


def _check_even_block_size(settings: OptimizerSettings) -> None:
    block_size = settings.get(BLOCK_SIZE)
    if block_size is not None and block_size % 2:
        raise UserError(
            f"optimizer.block_size must be even for {settings.name} (two 4-bit codes per byte); got {block_size}"
        )


def _check_adam_mini_implementation(settings: OptimizerSettings) -> None:
    if settings.get(IMPLEMENTATION) == "for-loop":
        raise UserError("optimizer.implementation for AdamMini is foreach or fused (it has no for-loop version)")


def _check_normuon_step_size(settings: OptimizerSettings) -> None:
    if settings.get(NORMUON_STEP_SIZE) == "rms" and settings.get(ADJUST_LR) is not None:
        raise UserError(
            "optimizer.adjust_lr does nothing with optimizer.normuon_step_size rms (its step, 0.2 lr sqrt(rows cols) "
            "/ ||n||_F, gives every matrix an update RMS of 0.2 lr whatever its shape); remove one of them"
        )


def _check_ademamix_warmup(settings: OptimizerSettings) -> None:
    """The beta3 warm-up interpolates between beta1 and beta3 in log space (the paper's schedule)."""
    beta1, beta3 = settings.betas[0], settings.get(ADEMAMIX_BETA3)
    if settings.get(ADEMAMIX_WARMUP_STEPS) and not 0.0 < beta1 <= beta3:
        raise UserError(
            f"AdEMAMix's warm-up takes the slow momentum's decay from optimizer.beta1 ({beta1}) up to "
            f"optimizer.ademamix_beta3 ({beta3}), so it needs 0 < beta1 <= ademamix_beta3; change one of them, or set "
            "optimizer.ademamix_warmup_steps 0"
        )


def _check_soap_adamw_part(settings: OptimizerSettings) -> None:
    """SOAP's AdamW part keeps float32 moments; for bfloat16 weights those come from our own step."""
    if settings.weights_dtype == "bfloat16" and settings.get(IMPLEMENTATION) is not None:
        raise UserError(
            "optimizer.implementation chooses torch's kernels, which keep the moments in the weights' dtype; remove "
            "it to get float32 moments for SOAP's AdamW part from a compiled step of our own"
        )


OWN_CHECKS: dict[str, tuple[Callable[[OptimizerSettings], None], ...]] = {
    "AdamW": (check_own_step_for_bfloat16_weights,),
    "Adam": (check_own_step_for_bfloat16_weights,),
    "Muon": (check_own_step_for_bfloat16_weights,),  # its AdamW part
    "NorMuon": (check_own_step_for_bfloat16_weights, _check_normuon_step_size),
    "AdamMini": (_check_adam_mini_implementation,),
    "AdamMini4bit": (_check_even_block_size,),
    "AdamW4bit": (_check_even_block_size,),
    "AdEMAMix": (_check_ademamix_warmup,),
    "SOAP": (_check_soap_adamw_part,),
}


# ----------------------------------------------------------------------------------------------------------------
# What the settings do to checkpoints


def state_options(name: str) -> tuple[str, ...]:
    """The options of optimizer ``name`` that shape its state, sorted."""
    return tuple(sorted(o for o in TAKES[name] if OPTION_RULES[o].shapes_state))


def state_signature(job_config: Any) -> dict[str, Any]:
    """The job's values of its optimizer's state-shaping options (unset ones as the value they stand for, or None).

    Two jobs of one optimizer whose signatures differ hold states that must not load into each other.
    """
    name = canonical_name(job_config.optimizer.name)
    signature = {}
    for option in state_options(name):
        signature[option] = OPTION_RULES[option].resolve(getattr(job_config.optimizer, option), job_config)
    return signature


def state_label(job_config: Any) -> str:
    """The optimizer's name, then each state-shaping option that differs from its unset value, e.g.
    ``AdamMini`` or ``AdamMini-state_dtype=bfloat16-value_blocks=per_tensor``: a folder name per optimizer state."""
    set_options = [
        f"{option}={value}"
        for option, value in state_signature(job_config).items()
        if value is not None and value != OPTION_RULES[option].unset_means
    ]
    return "-".join([canonical_name(job_config.optimizer.name), *set_options])
