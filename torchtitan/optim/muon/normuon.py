"""NorMuon: Muon's orthogonalised momentum, each output row (neuron) then normalised by its own second moment.

NorMuon is described in Zichong Li et al., "NorMuon: Making Muon more efficient and scalable" (arXiv:2510.05491,
2025); the reference implementation is ``dion/normuon.py`` of microsoft/dion. For each hidden matrix ``p`` with
``rows`` output rows and ``cols`` columns, after Muon's momentum and Newton–Schulz (``muon.py``) give ``o``::

    v <- lerp(v, mean_cols(o * o), 1 - neuron_beta2)          (one value per output row, at least float32)
    n <- o / (sqrt(v) + neuron_eps)                           (each row divided by its own root mean square)
    n <- n * ||o||_F / max(||n||_F, 1e-8)                     (the update keeps o's Frobenius norm)
    p <- p * (1 - lr * weight_decay) - lr * scale(p.shape) * n

as the reference computes it (``step_size = "reference"``, the default). The paper writes the last two lines as one
step, ``0.2 lr sqrt(rows cols) / ||n||_F`` (``step_size = "rms"``): an update RMS of exactly ``0.2 lr``. With
``adjust_lr = "match_rms_adamw"`` (the reference's ``rms_norm`` rule) the two agree when ``o`` is orthogonal;
Newton–Schulz returns a matrix only near orthogonal (its singular values spread around 1, and a rank-deficient
momentum keeps its zero singular values), so in training they differ.

Momentum, Nesterov, the Newton–Schulz iteration and its dtype,
``adjust_lr``, decoupled weight decay, the split into hidden matrices (Muon's) and everything else (an AdamW built
exactly as ``optimizer.name = "AdamW"`` builds it) are Muon's, with Muon's defaults, so that NorMuon and Muon differ
in the normalisation only. (The reference defaults to plain momentum and other Newton–Schulz coefficients.)

Sharded matrices go through Muon's owner rounds (``muon_distributed``) whole, and the normalisation runs where
``v`` lives: on this rank's piece of ``o``, for its rows. A row is whole on a rank unless a mesh dimension splits
the columns (row-wise tensor parallelism): there the rows' sums of squares are partial and are completed over those
dimensions. The two Frobenius norms are then sums over a rank's rows, completed over the dimensions that split the
rows. Each completion is one batched DTensor all-reduce per (mesh, dimensions) for all matrices (the reference keeps
per-shard norms on sharded matrices instead; here every layout computes what one process computes). ``v`` is
``(rows, 1)``, laid out like the parameter's rows (a DTensor with every split of the columns replaced by
``Replicate``), so checkpoints reshard across world sizes like Muon's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.distributed.utils import local_tensor, split_dim
from torchtitan.errors import UserError
from torchtitan.optim.adam_mini.statistics import _sum_over_shards
from torchtitan.optim.muon.optimizer import Muon
from torchtitan.optim.state.storage import FLOAT32, at_least_float32, keep_state_dtypes_on_load

__all__ = ["NorMuon", "normalize_rows", "NEURON_SECOND_MOMENT"]

DEFAULT_NEURON_BETA2, DEFAULT_NEURON_EPS = 0.95, 1e-8  # the reference's
REFERENCE, RMS = "reference", "rms"  # step sizes: the reference code's, the paper's
STEP_SIZES = (REFERENCE, RMS)
RMS_STEP = 0.2  # the paper's update RMS, in units of lr
NORM_FLOOR = 1e-8  # the reference's floor on the normalised update's Frobenius norm
# State key: the per-row second moment of the orthogonalised update, (rows, 1).
NEURON_SECOND_MOMENT = "neuron_second_moment"


# ----------------------------------------------------------------------------------------------------------------
# The math, as functions
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Completion:
    """Over which mesh dimensions a rank's sums are partial (none: they are whole here)."""

    mesh: Any = None
    sum_dims: tuple[int, ...] = ()


def _split_dims(param: Tensor, dims: tuple[int, ...]) -> _Completion:
    """The mesh dimensions (of more than one rank) that split ``param`` along any of tensor dimensions ``dims``."""
    if not isinstance(param, DTensor):
        return _Completion()
    mesh = param.device_mesh
    split = [split_dim(placement) for placement in param.placements]
    return _Completion(mesh, tuple(d for d, s in enumerate(split) if s in dims and mesh.shape[d] > 1))


def normalize_rows(
    params: list[Tensor],
    orthogonal: list[Tensor],
    second_moments: list[Tensor],
    beta2: float,
    eps: float,
    step_size: str = REFERENCE,
) -> list[Tensor]:
    """NorMuon's normalisation of every matrix's orthogonalised update; advances ``second_moments`` in place.

    ``step_size`` "reference" gives each normalised update ``o``'s Frobenius norm; "rms" gives it an RMS of 1
    (Frobenius norm ``sqrt(rows cols)``), the paper's step before its ``0.2 lr``.

    ``orthogonal`` and ``second_moments`` are this rank's pieces (plain tensors) of the matrices ``params``
    (plain tensors or DTensors, for their global shape and layout). Returns the normalised pieces, in the second
    moments' dtype. One pass over a piece gives its rows' sums of squares; both Frobenius norms follow from those
    (``||n||^2`` is the sum of each row's ``sum(o^2) / (sqrt(v) + eps)^2``), and one more pass scales each row by
    its factor."""
    pieces = [o.to(v.dtype) for o, v in zip(orthogonal, second_moments)]
    row_sums = [(o * o).sum(dim=1) for o in pieces]
    row_sums = _sum_over_shards(row_sums, [_split_dims(p, (1,)) for p in params])
    denominators, squares = [], []
    for p, v, row_sum in zip(params, second_moments, row_sums):
        v.lerp_((row_sum / p.shape[1]).view(-1, 1), 1 - beta2)
        denominator = v.view(-1).sqrt() + eps
        denominators.append(denominator)
        squares.append(torch.stack([row_sum.sum(), (row_sum / denominator.square()).sum()]))
    # A rank's rows are whole now: the norms are partial over the dimensions that split the rows only.
    squares = _sum_over_shards(squares, [_split_dims(p, (0,)) for p in params])
    normalized = []
    for p, o, denominator, (o_square, n_square) in zip(params, pieces, denominators, squares):
        target = o_square.sqrt() if step_size == REFERENCE else math.sqrt(p.shape[0] * p.shape[1])
        scale = target / n_square.sqrt().clamp(min=NORM_FLOOR)
        normalized.append(o * (scale / denominator).view(-1, 1))
    return normalized


def new_row_second_moment(param: Tensor) -> Tensor:
    """Zeros ``(rows, 1)`` (float32, float64 for float64 weights), laid out like ``param``'s rows."""
    dtype = at_least_float32(param.dtype)
    local = local_tensor(param)
    zeros = torch.zeros((local.shape[0], 1), dtype=dtype, device=local.device)
    if not isinstance(param, DTensor):
        return zeros
    placements = tuple(pl if split_dim(pl) == 0 else Replicate() for pl in param.placements)
    return DTensor.from_local(
        zeros, param.device_mesh, placements, run_check=False, shape=(param.shape[0], 1), stride=(1, 1)
    )


# ----------------------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------------------


class NorMuon(Muon):
    """NorMuon over ``matrices`` (2-D weights, plain tensors or DTensors), stepped with ``others``.

    Args:
        matrices, lr, weight_decay, momentum, nesterov, ns_steps, ns_dtype, adjust_lr, state_dtype, others: as
            :class:`~torchtitan.optim.muon.Muon` (``state_dtype`` stores the momentum and the AdamW part's moments;
            the per-row second moment is always at least float32: one value per row).
        neuron_beta2: decay of the per-row second moment (0.95, the reference's).
        neuron_eps: added to the root of the per-row second moment (1e-8, the reference's).
        step_size: "reference" (the reference code's, ``lr scale(shape) ||o||_F / ||n||_F``) or "rms" (the paper's,
            ``0.2 lr sqrt(rows cols) / ||n||_F``: an update RMS of exactly ``0.2 lr``; ``adjust_lr`` is then unused).
    """

    def __init__(
        self,
        matrices: Iterable[Tensor],
        *,
        neuron_beta2: float = DEFAULT_NEURON_BETA2,
        neuron_eps: float = DEFAULT_NEURON_EPS,
        step_size: str = REFERENCE,
        others: Optional[torch.optim.Optimizer] = None,
        **muon_options: Any,
    ):
        if not 0.0 <= neuron_beta2 < 1.0:
            raise UserError(f"NorMuon neuron_beta2 must be in [0, 1); got {neuron_beta2}")
        if not neuron_eps >= 0.0:
            raise UserError(f"NorMuon neuron_eps must be at least 0; got {neuron_eps}")
        if step_size not in STEP_SIZES:
            raise UserError(f"NorMuon step_size must be one of {', '.join(STEP_SIZES)}; got {step_size!r}")
        super().__init__(matrices, others=others, **muon_options)
        self.param_groups[0]["neuron_beta2"] = float(neuron_beta2)
        self.param_groups[0]["neuron_eps"] = float(neuron_eps)
        self.param_groups[0]["step_size"] = step_size
        # torch's load casts state to the weights' dtype; the per-row second moment stays at least float32.
        keep_state_dtypes_on_load(self, {NEURON_SECOND_MOMENT: FLOAT32})

    def _apply_updates(self, group: dict[str, Any], params: list[Tensor], orthogonal: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if NEURON_SECOND_MOMENT not in state:
                state[NEURON_SECOND_MOMENT] = new_row_second_moment(p)
        second_moments = [local_tensor(self.state[p][NEURON_SECOND_MOMENT]) for p in params]
        normalized = normalize_rows(
            params,
            orthogonal,
            second_moments,
            group["neuron_beta2"],
            group["neuron_eps"],
            group.get("step_size", REFERENCE),
        )
        super()._apply_updates(group, params, normalized)

    def _lr_scale(self, group: dict[str, Any], shape: tuple[int, ...]) -> float:
        """The paper's step: the normalised update has RMS 1, and ``lr`` means an update RMS of ``0.2 lr``."""
        return RMS_STEP if group.get("step_size") == RMS else super()._lr_scale(group, shape)
