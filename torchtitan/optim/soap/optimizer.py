"""SOAP on the hidden matrices, AdamW for every other weight (the split Muon makes).

The math of one whole matrix is in ``update.py``. Hidden matrices are the 2-D weights inside the transformer blocks
(Muon's :func:`~torchtitan.optim.muon.optimizer.split_hidden_matrices`); the embedding, the output projection,
norms and everything else go to an AdamW built exactly as ``optimizer.name = "AdamW"`` builds it. Both are one
``torch.optim.Optimizer``: the SOAP group first, then AdamW's groups, with one state dict.

Where a matrix is sharded (FSDP2, TP, both, HSDP), the ranks that split it send their pieces of the gradient to the
rank that owns the whole matrix (Muon's owner rounds, ``muon.distributed.transform_sharded``); the owner alone keeps
the matrix's SOAP state (its moments and both sides' statistics and bases, whole), advances it, and sends every rank
its piece of the direction. Nothing is replicated within a group, and the matrices of a group are spread
round-robin over its ranks. A step costs Muon's collectives: two ``all_to_all`` per round of the group's size, in
at least float32. A matrix that no mesh dimension splits is stepped where it is. Every rank keeps a ``step`` count
for every matrix, counted from that matrix's own first gradient (one whose first gradient comes late starts its
state, bases and bias corrections then, as a SOAP of its own would).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.errors import UserError
from torchtitan.optim.muon.optimizer import MatricesAndOthers, check_matrices
from torchtitan.optim.soap.update import BASES, EXP_AVG, EXP_AVG_SQ, GRAMS, matrix_step, new_matrix_state, step_size
from torchtitan.optim.state.storage import FLOAT32, at_least_float32, keep_state_dtypes_on_load

logger = logging.getLogger(__name__)

__all__ = ["SOAP", "DEFAULT_PRECONDITION_FREQUENCY", "DEFAULT_MAX_PRECONDITION_DIM"]

# The reference's defaults (nikhilvyas/SOAP, as pytorch_optimizer.SOAP has them).
DEFAULT_PRECONDITION_FREQUENCY = 10
DEFAULT_MAX_PRECONDITION_DIM = 10000
DEFAULT_BETAS = (0.95, 0.95)


class SOAP(MatricesAndOthers):
    """SOAP over ``matrices`` (2-D weights, plain tensors or DTensors), stepped with ``others``.

    Args:
        matrices: the hidden matrices (see :func:`~torchtitan.optim.muon.optimizer.split_hidden_matrices`).
        lr, betas, eps, weight_decay: Adam's, in the eigenbasis; weight decay is decoupled and applied after the
            update, as the reference applies it.
        shampoo_beta: decay of Shampoo's statistics (None: ``betas[1]``, as the reference).
        precondition_frequency: the bases are refreshed after every this many updates (10).
        max_precondition_dim: a side longer than this is not rotated (10000).
        others: an optimizer over the remaining parameters, or None. Its param groups follow SOAP's in
            ``param_groups`` and its state lives in this optimizer's ``state``.
    """

    def __init__(
        self,
        matrices: Iterable[Tensor],
        lr: float = 3e-3,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        shampoo_beta: Optional[float] = None,
        precondition_frequency: int = DEFAULT_PRECONDITION_FREQUENCY,
        max_precondition_dim: int = DEFAULT_MAX_PRECONDITION_DIM,
        others: Optional[torch.optim.Optimizer] = None,
    ):
        matrices = list(matrices)
        _check_arguments(
            matrices, lr, betas, eps, weight_decay, shampoo_beta, precondition_frequency, max_precondition_dim
        )
        soap_group = {
            "params": matrices,
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": float(eps),
            "weight_decay": float(weight_decay),
            "shampoo_beta": float(betas[1] if shampoo_beta is None else shampoo_beta),
            "precondition_frequency": int(precondition_frequency),
            "max_precondition_dim": int(max_precondition_dim),
            # Weight decay scales with lr: the state initialisation's zero step may leave it on.
            "decoupled_weight_decay": True,
        }
        super().__init__([soap_group] + (list(others.param_groups) if others is not None else []), {})
        self.others = others
        # torch's load casts state to the weights' dtype; SOAP's (and its AdamW part's moments) stay float32.
        keep_state_dtypes_on_load(self, {key: FLOAT32 for key in (EXP_AVG, EXP_AVG_SQ, *GRAMS, *BASES)})
        self._matrices = {}  # see MatricesAndOthers

    def _matrix_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
            state["step"] += 1
        # Each matrix counts its own steps from its own first gradient (a matrix may get its first one later).
        steps = [int(self.state[p]["step"]) for p in params]
        grads = [local_tensor(grad_like_param(p, "SOAP")) for p in params]
        directions = self._directions(group, params, grads, steps)
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        for p, direction, step in zip(params, directions, steps):
            if step == 1:
                continue  # a matrix's first step only sets its bases, as the reference's does
            local = local_tensor(p)
            local.add_(direction, alpha=-step_size(lr, beta1, beta2, step))  # in the state's precision, rounded once
            if group["weight_decay"] != 0.0:
                local.mul_(1 - lr * group["weight_decay"])

    def _directions(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], steps: list[int]
    ) -> list[Optional[Tensor]]:
        """Each matrix's direction (this rank's piece), computed whole by the rank that keeps its state."""
        beta1, beta2 = group["betas"]

        def advance(index: int, whole_grad: Tensor) -> Tensor:
            p = params[index]
            state = self.state[p]
            if EXP_AVG not in state:
                dtype = at_least_float32(p.dtype)
                state.update(new_matrix_state(tuple(p.shape), dtype, whole_grad.device, group["max_precondition_dim"]))
            direction = matrix_step(
                whole_grad,
                state,
                steps[index],
                beta1,
                beta2,
                group["shampoo_beta"],
                group["eps"],
                group["precondition_frequency"],
            )
            return torch.zeros_like(state[EXP_AVG]) if direction is None else direction

        return self._whole_matrices(params, grads, advance, at_least_float32(params[0].dtype))


def _check_arguments(
    matrices: list[Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    shampoo_beta: Optional[float],
    precondition_frequency: int,
    max_precondition_dim: int,
) -> None:
    check_matrices("SOAP", "preconditions", matrices, lr, weight_decay)
    if len(tuple(betas)) != 2 or not all(0.0 <= float(beta) < 1.0 for beta in betas):
        raise UserError(f"SOAP betas must be two numbers in [0, 1); got {tuple(betas)}")
    if not eps >= 0.0:
        raise UserError(f"SOAP eps must be at least 0; got {eps}")
    if shampoo_beta is not None and not 0.0 <= shampoo_beta < 1.0:
        raise UserError(f"SOAP shampoo_beta must be in [0, 1); got {shampoo_beta}")
    if isinstance(precondition_frequency, bool) or not int(precondition_frequency) == precondition_frequency >= 1:
        raise UserError(
            f"SOAP precondition_frequency must be a whole number of steps, at least 1; got {precondition_frequency}"
        )
    if isinstance(max_precondition_dim, bool) or not int(max_precondition_dim) == max_precondition_dim >= 1:
        raise UserError(f"SOAP max_precondition_dim must be a whole number, at least 1; got {max_precondition_dim}")


def log_split(matrices: list[tuple[str, Tensor]], others: list[tuple[str, Tensor]], max_precondition_dim: int) -> None:
    """One line: what SOAP preconditions (and which sides it rotates) and what AdamW takes."""
    one_sided = sum(1 for _, p in matrices if max(p.shape) > max_precondition_dim >= min(p.shape))
    unrotated = sum(1 for _, p in matrices if min(p.shape) > max_precondition_dim)
    logger.info(
        "SOAP: %d hidden matrices (%s parameters; %d rotated on one side only, %d on neither, sides longer than %d "
        "are not rotated); %d other tensors (%s parameters) with AdamW",
        len(matrices),
        f"{sum(p.numel() for _, p in matrices):,}",
        one_sided,
        unrotated,
        max_precondition_dim,
        len(others),
        f"{sum(p.numel() for _, p in others):,}",
    )
