"""SOAP's math for one whole matrix, as functions over tensors.

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321) runs Adam in the
eigenbasis of Shampoo's preconditioner. For a matrix ``W`` (``rows x cols``) with gradient ``G``, step ``t``::

    L <- lerp(L, G G^T, 1 - shampoo_beta)          R <- lerp(R, G^T G, 1 - shampoo_beta)     (Shampoo's statistics)
    Q_L, Q_R: eigenvectors of L and R, by decreasing eigenvalue     (a side longer than max_precondition_dim: I)
    m <- lerp(m, G, 1 - beta1)                                      (in the weights' basis)
    v <- lerp(v, (Q_L^T G Q_R)^2, 1 - beta2)                        (in the eigenbasis)
    D <- Q_L ((Q_L^T m Q_R) / (sqrt(v) + eps)) Q_R^T
    W <- (W - lr sqrt(1 - beta2^(t-1)) / (1 - beta1^(t-1)) D) (1 - lr weight_decay)

as the reference code computes it (nikhilvyas/SOAP; ``pytorch_optimizer.SOAP`` follows it): the first step only
fills ``L`` and ``R`` and takes their eigenvectors (``eigh``), with no update; ``D`` uses the bases from before the
step's gradient is added to ``L`` and ``R``; after every ``precondition_frequency`` updates the bases are refreshed
by one power iteration and a QR decomposition, ``v``'s rows and columns reordered to follow the new order of the
estimated eigenvalues. The decay is applied after the update, as the reference applies it.

The state of a matrix (:func:`new_matrix_state`) is a dict: ``exp_avg`` and ``exp_avg_sq`` shaped like the matrix,
and per rotated side its statistics ``gram_left``/``gram_right`` and basis ``basis_left``/``basis_right``
(square, that side's length); a side that is not rotated has neither.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "EXP_AVG",
    "EXP_AVG_SQ",
    "GRAMS",
    "BASES",
    "rotated_sides",
    "new_matrix_state",
    "matrix_state_numel",
    "accumulate_grams",
    "eigenbasis",
    "refresh_eigenbases",
    "project",
    "project_back",
    "matrix_step",
    "step_size",
]

EXP_AVG, EXP_AVG_SQ = "exp_avg", "exp_avg_sq"
GRAMS = ("gram_left", "gram_right")  # Shampoo's statistics: G G^T (rows x rows) and G^T G (cols x cols)
BASES = ("basis_left", "basis_right")  # their eigenvectors, by decreasing eigenvalue
# The reference adds this multiple of the identity before eigh.
EIGH_JITTER = 1e-30


def rotated_sides(shape: tuple[int, ...], max_precondition_dim: int) -> tuple[bool, bool]:
    """Whether the rows' side and the columns' side are rotated (no longer than ``max_precondition_dim``)."""
    return shape[0] <= max_precondition_dim, shape[1] <= max_precondition_dim


def matrix_state_numel(shape: tuple[int, ...], max_precondition_dim: int) -> int:
    """Entries of a matrix's state: two moments shaped like it, a statistic and a basis per rotated side."""
    rows, cols = shape
    left, right = rotated_sides(shape, max_precondition_dim)
    return 2 * rows * cols + 2 * (rows * rows if left else 0) + 2 * (cols * cols if right else 0)


def new_matrix_state(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, max_precondition_dim: int
) -> dict[str, Tensor]:
    """Zeros for a ``shape`` matrix's state (the bases are set by the first step)."""
    state = {
        EXP_AVG: torch.zeros(shape, dtype=dtype, device=device),
        EXP_AVG_SQ: torch.zeros(shape, dtype=dtype, device=device),
    }
    for side, rotated in enumerate(rotated_sides(shape, max_precondition_dim)):
        if rotated:
            length = shape[side]
            state[GRAMS[side]] = torch.zeros((length, length), dtype=dtype, device=device)
            state[BASES[side]] = torch.zeros((length, length), dtype=dtype, device=device)
    return state


def _bases(state: dict[str, Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    return state.get(BASES[0]), state.get(BASES[1])


def accumulate_grams(state: dict[str, Tensor], grad: Tensor, shampoo_beta: float) -> None:
    """``L <- lerp(L, G G^T, 1 - shampoo_beta)``, ``R <- lerp(R, G^T G, 1 - shampoo_beta)``, in place."""
    if GRAMS[0] in state:
        state[GRAMS[0]].lerp_(grad @ grad.T, 1 - shampoo_beta)
    if GRAMS[1] in state:
        state[GRAMS[1]].lerp_(grad.T @ grad, 1 - shampoo_beta)


def eigenbasis(gram: Tensor) -> Tensor:
    """The eigenvectors of the symmetric ``gram``, by decreasing eigenvalue (as columns).

    Where the solver does not converge in ``gram``'s dtype (an ill-conditioned float32 statistic on a GPU), it runs
    again in float64, as the reference does."""
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    try:
        _, vectors = torch.linalg.eigh(gram + EIGH_JITTER * identity)
    except torch.linalg.LinAlgError:
        _, vectors = torch.linalg.eigh(gram.double() + EIGH_JITTER * identity.double())
        vectors = vectors.to(gram.dtype)
    return vectors.flip(1)


def refresh_eigenbases(state: dict[str, Tensor]) -> None:
    """One power iteration and a QR decomposition per rotated side (in place).

    Each basis is sorted by its estimated eigenvalues ``diag(Q^T S Q)`` (decreasing), ``S Q`` orthonormalised by
    QR (in at least float32); ``exp_avg_sq`` follows the new order along that side, as the reference does."""
    exp_avg_sq = state[EXP_AVG_SQ]
    for side in (0, 1):
        if GRAMS[side] not in state:
            continue
        gram, basis = state[GRAMS[side]], state[BASES[side]]
        product = gram @ basis
        estimated = (basis * product).sum(dim=0)
        order = torch.argsort(estimated, descending=True)
        exp_avg_sq = exp_avg_sq.index_select(side, order)
        q, _ = torch.linalg.qr(product.index_select(1, order))  # grams and bases are float32 or wider
        basis.copy_(q)
    state[EXP_AVG_SQ].copy_(exp_avg_sq)


def project(x: Tensor, left: Optional[Tensor], right: Optional[Tensor]) -> Tensor:
    """``Q_L^T x Q_R`` (a missing basis is the identity)."""
    if left is not None:
        x = left.T @ x
    if right is not None:
        x = x @ right
    return x


def project_back(x: Tensor, left: Optional[Tensor], right: Optional[Tensor]) -> Tensor:
    """``Q_L x Q_R^T`` (a missing basis is the identity)."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


def step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """The factor on the direction at ``step`` (counting the first, update-free step): Adam's bias correction for
    ``step - 1`` updates."""
    updates = step - 1
    return lr * (math.sqrt(1 - beta2**updates) / (1 - beta1**updates))


def matrix_step(
    grad: Tensor,
    state: dict[str, Tensor],
    step: int,
    beta1: float,
    beta2: float,
    shampoo_beta: float,
    eps: float,
    precondition_frequency: int,
) -> Optional[Tensor]:
    """Advance one whole matrix's ``state`` (in place) by ``grad`` at ``step`` (1 for the first) and return the
    direction ``D`` (None at the first step, which only sets the bases)."""
    grad = grad.to(state[EXP_AVG].dtype)
    if step == 1:
        accumulate_grams(state, grad, shampoo_beta)
        for side in (0, 1):
            if GRAMS[side] in state:
                state[BASES[side]].copy_(eigenbasis(state[GRAMS[side]]))
        return None
    left, right = _bases(state)
    exp_avg, exp_avg_sq = state[EXP_AVG], state[EXP_AVG_SQ]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(project(grad, left, right).square(), 1 - beta2)
    denominator = exp_avg_sq.sqrt().add_(eps)
    direction = project_back(project(exp_avg, left, right) / denominator, left, right)
    accumulate_grams(state, grad, shampoo_beta)
    if (step - 1) % precondition_frequency == 0:
        refresh_eigenbases(state)
    return direction
