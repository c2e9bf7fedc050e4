"""Muon: orthogonalised momentum for the hidden matrices, AdamW for every other weight.

``torch.optim.Muon``'s update (written here: not every torch we support has it, and ours also runs on sharded
parameters) for each hidden matrix ``p`` with gradient ``g``::

    m <- lerp(m, g, 1 - momentum)
    u <- lerp(g, m, momentum)                     (Nesterov; plain momentum uses u = m)
    o <- NS(u)                                     (quintic Newton–Schulz, ns_steps iterations, in ns_dtype)
    p <- p * (1 - lr * weight_decay) - lr * scale(p.shape) * o

``scale`` is ``0.2 sqrt(max(rows, cols))`` (``match_rms_adamw``: the update's RMS matches AdamW's, so ``lr`` and
``weight_decay`` mean what they mean for AdamW) or ``sqrt(max(1, rows / cols))`` (``original``). Hidden matrices
are the 2-D weights inside the transformer blocks (query, key, value, attention output, feed-forward, by the
model's declared roles or the name rules); the embedding, the output projection, norms and everything else go to
an AdamW built exactly as ``optimizer.name = "AdamW"`` builds it. Both are one ``torch.optim.Optimizer``: the
Muon group first, then AdamW's groups, with one state dict, so schedulers, checkpoints and memory reports see
one optimizer.

Sharded matrices (FSDP2, TP, both, HSDP) are orthogonalised whole, once per step, by the ranks that split them in
turn (``muon_distributed``); everything else is local. The state is ``momentum_buffer`` shaped like the
parameter (a DTensor exactly when the parameter is one), so checkpoints reshard across world sizes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.errors import UserError
from torchtitan.models.roles import ATTN_OUT, KEY, MLP, QUERY, VALUE, canonical_name
from torchtitan.optim.adam_mini.partition import role_from_name
from torchtitan.optim.muon.distributed import ShardedMatrix, sharded_matrix, transform_sharded
from torchtitan.optim.state.storage import (
    BFLOAT16,
    FLOAT32,
    at_least_float32,
    keep_state_dtypes_on_load,
    new_state,
    read_state,
    write_state,
)

logger = logging.getLogger(__name__)

__all__ = ["Muon", "newton_schulz", "lr_scale", "split_hidden_matrices"]

# Keller Jordan's quintic Newton–Schulz coefficients and epsilon, as torch.optim.Muon uses them.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
DEFAULT_MOMENTUM, DEFAULT_NESTEROV, DEFAULT_NS_STEPS = 0.95, True, 5
MATCH_RMS_ADAMW, ORIGINAL = "match_rms_adamw", "original"
ADJUST_LR_CHOICES = (MATCH_RMS_ADAMW, ORIGINAL)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
DEFAULT_NS_DTYPE = "bfloat16"
# Roles of the matrices Muon orthogonalises: the 2-D weights inside the transformer blocks.
HIDDEN_MATRIX_ROLES = frozenset({QUERY, KEY, VALUE, ATTN_OUT, MLP})
# State keys (torch.optim.Muon's and AdamW's), kept in bfloat16 across a load when state_dtype is bfloat16.
MOMENTUM_BUFFER = "momentum_buffer"
_STATE_KEYS = (MOMENTUM_BUFFER, "exp_avg", "exp_avg_sq")  # Muon's and its AdamW part's


# ----------------------------------------------------------------------------------------------------------------
# The math, as functions
# ----------------------------------------------------------------------------------------------------------------


def newton_schulz(update: Tensor, steps: int, dtype: torch.dtype, coefficients=NS_COEFFICIENTS) -> Tensor:
    """An approximately orthogonal matrix with ``update``'s singular vectors: quintic Newton–Schulz in ``dtype``.

    The iteration runs on the wide orientation (the Gram matrix is the smaller one) after scaling to Frobenius
    norm 1 (so the spectral norm is at most 1); the operations are torch.optim.Muon's, in its order, so that the
    same dtype gives the same bits.
    """
    a, b, c = coefficients
    tall = update.shape[0] > update.shape[1]
    x = update.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def lr_scale(shape: tuple[int, ...], adjust_lr: str) -> float:
    """The factor on ``lr`` for a matrix of ``shape`` (its global shape, however it is sharded)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr == MATCH_RMS_ADAMW:
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def momentum_updates(
    grads: list[Tensor], buffers: list[Tensor], momentum: float, nesterov: bool, step: int = 0
) -> list[Tensor]:
    """Advance the momentum buffers (in place, whatever their storage) and return the updates to orthogonalise.

    The math runs in at least float32, whatever the weights' dtype. A buffer stored in another dtype gets the new
    momentum through ``write_state`` (bfloat16: rounded stochastically, salted by ``step``, so that a decaying
    momentum still decays); the update uses it unrounded."""
    updates = []
    salt = None
    for grad, buffer in zip(grads, buffers):
        dtype = at_least_float32(grad.dtype)
        grad = grad.to(dtype)
        m = read_state(buffer, dtype)
        m.lerp_(grad, 1 - momentum)
        if m is not buffer:
            if salt is None or salt.device != m.device:
                salt = torch.tensor(step, dtype=torch.int64, device=m.device)
            write_state(buffer, m, salt)
        updates.append(grad.lerp(m, momentum) if nesterov else m)
    return updates


# ----------------------------------------------------------------------------------------------------------------
# Which weights are hidden matrices
# ----------------------------------------------------------------------------------------------------------------


def split_hidden_matrices(
    named_parameters: Iterable[tuple[str, Tensor]], param_roles: Optional[Mapping[str, str]] = None
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(hidden matrices, everything else) of the trainable parameters, by declared role, else by name rules."""
    roles = {canonical_name(name): role for name, role in (param_roles or {}).items()}
    matrices, others = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        role = roles.get(canonical_name(name)) or role_from_name(name)
        (matrices if role in HIDDEN_MATRIX_ROLES and p.dim() == 2 else others).append((name, p))
    return matrices, others


# ----------------------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------------------


class MatricesAndOthers(torch.optim.Optimizer):
    """The front of an optimizer of the hidden matrices (group 0, stepped by ``_matrix_step``) whose other
    parameters an inner optimizer ``others`` (AdamW) steps, sharing this one's groups and state: Muon, NorMuon
    and SOAP."""

    others: Optional[torch.optim.Optimizer]
    _matrices: dict[Tensor, Optional[ShardedMatrix]]
    _ordinals: Optional[dict[Tensor, int]] = None  # see _owner_ordinals

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._matrix_step(self.param_groups[0])
        if self.others is not None:
            # The same group dicts and state (a load replaces both with new objects).
            self.others.param_groups = self.param_groups[1:]
            self.others.state = self.state
            self.others.step()
        return loss

    def _matrix_step(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _sharded_matrix(self, p: Tensor) -> Optional[ShardedMatrix]:
        """How ``p``'s whole matrix is split over ranks (None for a plain tensor), worked out once per parameter."""
        if not isinstance(p, DTensor):
            return None
        if p not in self._matrices:
            self._matrices[p] = sharded_matrix(p)
        return self._matrices[p]

    def _owner_ordinals(self) -> dict[Tensor, int]:
        """Each sharded matrix's position among all the matrices of its process group, in the first group's order,
        whether or not it has a gradient: its owner (position mod the group's size) never depends on which matrices
        have a gradient this step, so the state a rank keeps for a matrix stays on that rank."""
        if self._ordinals is None:
            counts: dict[Any, int] = {}
            ordinals = {}
            for p in self.param_groups[0]["params"]:
                matrix = self._sharded_matrix(p)
                if matrix is not None:
                    ordinals[p] = counts.get(matrix.group, 0)
                    counts[matrix.group] = ordinals[p] + 1
            self._ordinals = ordinals
        return self._ordinals

    def _whole_matrices(
        self, params: list[Tensor], inputs: list[Tensor], transform: Callable[[int, Tensor], Tensor], dtype: torch.dtype
    ) -> list[Tensor]:
        """``transform(i, whole)`` of each matrix ``params[i]``, ``whole`` being the whole matrix of which
        ``inputs[i]`` is this rank's piece: here where this rank holds it whole, else by the rank that owns it
        (the owner rounds of ``muon.distributed``, in ``dtype``); the results' local pieces, in ``params``' order."""
        results: list[Optional[Tensor]] = [None] * len(params)
        sharded = []
        for i, p in enumerate(params):
            matrix = self._sharded_matrix(p)
            if matrix is None:
                results[i] = transform(i, inputs[i])
            else:
                sharded.append((i, matrix))
        if sharded:
            indices, matrices = zip(*sharded)

            def by_position(position: int, whole: Tensor) -> Tensor:
                return transform(indices[position], whole)

            ordinals = self._owner_ordinals()
            pieces = transform_sharded(
                [inputs[i] for i in indices], list(matrices), by_position, dtype, [ordinals[params[i]] for i in indices]
            )
            for i, piece in zip(indices, pieces):
                results[i] = piece
        return results


class Muon(MatricesAndOthers):
    """Muon over ``matrices`` (2-D weights, plain tensors or DTensors), stepped with ``others`` (e.g. AdamW over
    every other weight).

    Args:
        matrices: the hidden matrices (see :func:`split_hidden_matrices`).
        lr, weight_decay: as for AdamW; weight decay is decoupled (``p * (1 - lr * weight_decay)``).
        momentum, nesterov, ns_steps: as torch.optim.Muon (0.95, True, 5).
        ns_dtype: dtype of the Newton–Schulz iteration: ``"bfloat16"`` (torch's), ``"float32"`` or ``"float64"``.
        adjust_lr: ``"match_rms_adamw"`` (default) or ``"original"``, see the module docstring.
        state_dtype: storage of the momentum: ``"float32"`` (at least: float64 for float64 weights, float32 for
            bfloat16 weights) or ``"bfloat16"`` (rounded stochastically).
        others: an optimizer over the remaining parameters, or None. Its param groups follow the Muon group in
            ``param_groups`` and its state lives in this optimizer's ``state``.
    """

    def __init__(
        self,
        matrices: Iterable[Tensor],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = DEFAULT_MOMENTUM,
        nesterov: bool = DEFAULT_NESTEROV,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_dtype: str = DEFAULT_NS_DTYPE,
        adjust_lr: str = MATCH_RMS_ADAMW,
        state_dtype: str = FLOAT32,
        others: Optional[torch.optim.Optimizer] = None,
    ):
        matrices = list(matrices)
        _check_arguments(matrices, lr, weight_decay, momentum, ns_steps, ns_dtype, adjust_lr, state_dtype)
        muon_group = {
            "params": matrices,
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": float(momentum),
            "nesterov": bool(nesterov),
            "ns_steps": int(ns_steps),
            "ns_dtype": ns_dtype,
            "adjust_lr": adjust_lr,
            # Weight decay scales with lr: the state initialisation's zero step may leave it on.
            "decoupled_weight_decay": True,
        }
        # No defaults: the groups carry every value, and AdamW's groups take none of Muon's keys.
        super().__init__([muon_group] + (list(others.param_groups) if others is not None else []), {})
        self.others = others
        self.state_dtype = state_dtype
        # torch's load casts state to the weights' dtype; keep each state in the dtype state_dtype says.
        keep_state_dtypes_on_load(self, {key: state_dtype for key in _STATE_KEYS})
        self._matrices: dict[Tensor, Optional[ShardedMatrix]] = {}

    def _matrix_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                # A CPU step count like AdamW's: the salt of bfloat16 momentum's stochastic rounding.
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                state[MOMENTUM_BUFFER] = new_state(p, self.state_dtype)
            state["step"] += 1
        grads = [local_tensor(grad_like_param(p, "Muon")) for p in params]
        buffers = [local_tensor(self.state[p][MOMENTUM_BUFFER]) for p in params]
        step = int(self.state[params[0]]["step"])  # every matrix steps together
        updates = momentum_updates(grads, buffers, group["momentum"], group["nesterov"], step)
        orthogonal = self._orthogonalize(params, updates, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
        self._apply_updates(group, params, orthogonal)

    def _apply_updates(self, group: dict[str, Any], params: list[Tensor], orthogonal: list[Tensor]) -> None:
        """Decoupled weight decay, then each matrix's update (local pieces of the orthogonalised momentum)."""
        lr = float(group["lr"])
        for p, o in zip(params, orthogonal):
            local = local_tensor(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o, alpha=-lr * self._lr_scale(group, p.shape))

    def _lr_scale(self, group: dict[str, Any], shape: tuple[int, ...]) -> float:
        return lr_scale(shape, group["adjust_lr"])

    def _orthogonalize(self, params: list[Tensor], updates: list[Tensor], steps: int, dtype: torch.dtype):
        """Newton–Schulz of every whole matrix: locally where a rank holds it whole, else shared by its ranks."""

        def orthogonalize(index: int, update: Tensor) -> Tensor:
            return newton_schulz(update, steps, dtype)

        return self._whole_matrices(params, updates, orthogonalize, dtype)


def check_matrices(name: str, does: str, matrices: list[Tensor], lr: float, weight_decay: float) -> None:
    """What every optimizer of the hidden matrices refuses: no matrices, a matrix that is not 2-D, a negative lr or
    weight decay (``name`` and what it ``does`` to the matrices, for the message)."""
    if not matrices:
        raise UserError(f"{name} got no hidden matrices (2-D query, key, value, attention output or MLP weights)")
    for p in matrices:
        if p.dim() != 2:
            raise UserError(f"{name} {does} 2-D matrices only; got a parameter of shape {tuple(p.shape)}")
    if not isinstance(lr, Tensor) and not lr >= 0.0:
        raise UserError(f"{name} lr must be at least 0; got {lr}")
    if not weight_decay >= 0.0:
        raise UserError(f"{name} weight_decay must be at least 0; got {weight_decay}")


def _check_arguments(
    matrices: list[Tensor],
    lr: float,
    weight_decay: float,
    momentum: float,
    ns_steps: int,
    ns_dtype: str,
    adjust_lr: str,
    state_dtype: str,
) -> None:
    check_matrices("Muon", "orthogonalises", matrices, lr, weight_decay)
    if not 0.0 <= momentum < 1.0:
        raise UserError(f"Muon momentum must be in [0, 1); got {momentum}")
    if not 0 < ns_steps < 100:
        raise UserError(f"Muon ns_steps must be in 1..99; got {ns_steps}")
    if ns_dtype not in NS_DTYPES:
        raise UserError(f"Muon ns_dtype must be one of {', '.join(NS_DTYPES)}; got {ns_dtype!r}")
    if adjust_lr not in ADJUST_LR_CHOICES:
        raise UserError(f"Muon adjust_lr must be one of {', '.join(ADJUST_LR_CHOICES)}; got {adjust_lr!r}")
    if state_dtype not in (FLOAT32, BFLOAT16):
        raise UserError(f"Muon state_dtype must be float32 or bfloat16; got {state_dtype!r}")


def log_split(matrices: list[tuple[str, Tensor]], others: list[tuple[str, Tensor]]) -> None:
    """One line: what Muon orthogonalises and what AdamW takes."""
    logger.info(
        "Muon: %d hidden matrices (%s parameters) orthogonalised; %d other tensors (%s parameters) with AdamW",
        len(matrices),
        f"{sum(p.numel() for _, p in matrices):,}",
        len(others),
        f"{sum(p.numel() for _, p in others):,}",
    )
