"""The ``[optimizer]`` options as the builder reads them, and the one check of the Adam hyperparameters.

The rules are torch.optim's own (``torch.optim.Adam``/``AdamW``): lr, eps and weight_decay at least 0, each beta in
[0, 1). The job config, the optimizer builder and ``AdamMini``'s constructor all call
:func:`check_adam_hyperparameters`, naming the values the way their users wrote them. This module does not import
torch, so that the job config is checked (and ``--help`` answers) without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torchtitan.errors import UserError

# [optimizer] options that only some optimizers take; the rest (lr, betas, eps, weight_decay) apply to all.
IMPLEMENTATION, VALUE_BLOCKS, BLOCK_SIZE, BF16_STOCHASTIC_ROUND, STATE_DTYPE = (
    "implementation",
    "value_blocks",
    "block_size",
    "bf16_stochastic_round",
    "state_dtype",
)
MOMENTUM, NESTEROV, NS_STEPS, NS_DTYPE, ADJUST_LR = "momentum", "nesterov", "ns_steps", "ns_dtype", "adjust_lr"
MUON_OPTIONS = (MOMENTUM, NESTEROV, NS_STEPS, NS_DTYPE, ADJUST_LR)
NEURON_BETA2, NEURON_EPS = "neuron_beta2", "neuron_eps"
NORMUON_OPTIONS = (NEURON_BETA2, NEURON_EPS)  # NorMuon's own, besides Muon's
OPTIONAL_OPTIONS = (
    (IMPLEMENTATION, VALUE_BLOCKS, BLOCK_SIZE, BF16_STOCHASTIC_ROUND, STATE_DTYPE) + MUON_OPTIONS + NORMUON_OPTIONS
)

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
    momentum: Optional[float] = None
    nesterov: Optional[bool] = None
    ns_steps: Optional[int] = None
    ns_dtype: Optional[str] = None
    adjust_lr: Optional[str] = None
    neuron_beta2: Optional[float] = None
    neuron_eps: Optional[float] = None

    @classmethod
    def from_job_config(cls, job_config: Any) -> "Hyperparameters":
        o = job_config.optimizer
        return cls(
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            implementation=o.implementation,
            value_blocks=o.value_blocks,
            block_size=o.block_size,
            bf16_stochastic_round=o.bf16_stochastic_round,
            state_dtype=o.state_dtype,
            **{name: getattr(o, name) for name in MUON_OPTIONS + NORMUON_OPTIONS},
        )

    def options_set(self) -> set[str]:
        """The optional options the user set (left unset they are None)."""
        return {name for name in OPTIONAL_OPTIONS if getattr(self, name) is not None}

    def check(self) -> None:
        """The Adam hyperparameters checked by :func:`check_adam_hyperparameters`, named as config keys."""
        check_adam_hyperparameters(self.lr, self.betas, self.eps, self.weight_decay)
