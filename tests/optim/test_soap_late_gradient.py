"""SOAP per matrix: a matrix whose first gradient comes late starts its state, its bases and its step count then,
exactly as the reference SOAP (pytorch_optimizer's) run as one optimizer per matrix; and under FSDP its owner rank
is the same whichever matrices have a gradient at a step, so its state never moves or restarts.

Float64 weights and gradients; the reference refreshes its bases with a float32 QR (ours keeps float64), so the two
agree to 1e-6 after a refresh (1e-16 before), far below what a restarted or misplaced state changes (the first
update of a matrix whose bases were never set is about ten times a normal one).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from torchtitan.optim.soap.optimizer import SOAP
from torchtitan.optim.soap.update import EXP_AVG

# 12 x 8 (both sides rotated), 10 x 6 (both), 6 x 20 (the rows' side only: 20 > MAX_DIM).
SHAPES = ((12, 8), (10, 6), (6, 20))
MAX_DIM = 16
STEPS, FREQUENCY = 9, 3  # refreshes inside the run, for the late matrix too
OPTIONS = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, precondition_frequency=FREQUENCY)
LATE, FIRST_STEP = 1, 3  # matrix 1 gets its first gradient at step 3 (none at steps 1 and 2)


def _matrices() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def _gradient(shape: tuple[int, int], step: int, index: int) -> torch.Tensor:
    """Rows of very different scales, so that the statistics have distinct eigenvalues."""
    generator = torch.Generator().manual_seed(1000 * index + step)
    scales = torch.linspace(0.2, 3.0, shape[0], dtype=torch.float64).view(-1, 1)
    return torch.randn(shape, generator=generator, dtype=torch.float64) * scales


def _has_gradient(index: int, step: int) -> bool:
    return index != LATE or step >= FIRST_STEP


def _reference_trajectory() -> list[list[torch.Tensor]]:
    """pytorch_optimizer.SOAP, one optimizer per matrix, each stepped only when its matrix has a gradient."""
    from pytorch_optimizer import SOAP as ReferenceSOAP

    params = [torch.nn.Parameter(m) for m in _matrices()]
    optimizers = [ReferenceSOAP([p], max_precondition_dim=MAX_DIM, correct_bias=True, **OPTIONS) for p in params]
    trajectory = []
    for step in range(1, STEPS + 1):
        for index, (p, optimizer) in enumerate(zip(params, optimizers)):
            if _has_gradient(index, step):
                p.grad = _gradient(SHAPES[index], step, index)
                optimizer.step()
        trajectory.append([p.detach().clone() for p in params])
    return trajectory


def _ours_trajectory(params: list[torch.Tensor], to_param, full) -> tuple[list[list[torch.Tensor]], SOAP]:
    optimizer = SOAP(params, max_precondition_dim=MAX_DIM, **OPTIONS)
    trajectory = []
    for step in range(1, STEPS + 1):
        for index, p in enumerate(params):
            p.grad = to_param(_gradient(SHAPES[index], step, index), p) if _has_gradient(index, step) else None
        optimizer.step()
        trajectory.append([full(p).detach().clone() for p in params])
    return trajectory, optimizer


def _assert_same_trajectory(ours: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> None:
    for step, (mine, theirs) in enumerate(zip(ours, reference), start=1):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            assert (a - b).abs().max().item() < 1e-6, f"step {step}, matrix {index} {SHAPES[index]}"


def test_a_late_first_gradient_equals_the_reference_run_as_one_optimizer_per_matrix():
    params = [torch.nn.Parameter(m) for m in _matrices()]
    ours, optimizer = _ours_trajectory(params, lambda grad, p: grad, lambda p: p)
    reference = _reference_trajectory()
    _assert_same_trajectory(ours, reference)
    # Each matrix counts its own steps: the late one two fewer.
    assert [int(optimizer.state[p]["step"]) for p in params] == [STEPS, STEPS - FIRST_STEP + 1, STEPS]
    assert torch.equal(ours[FIRST_STEP - 1][LATE], _matrices()[LATE])  # its first step only set its bases


def _fsdp_run(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    params = [torch.nn.Parameter(distribute_tensor(m, mesh, [Shard(0)])) for m in _matrices()]

    def to_param(grad: torch.Tensor, p) -> torch.Tensor:
        return distribute_tensor(grad, mesh, [Shard(0)])

    trajectory, optimizer = _ours_trajectory(params, to_param, lambda p: p.full_tensor())
    owned = [EXP_AVG in optimizer.state[p] for p in params]
    return {"trajectory": trajectory, "owned": owned}


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict]:
    return run_workers(_fsdp_run, 2)


def test_under_fsdp_the_late_matrix_keeps_one_owner_and_equals_the_reference(fsdp_results):
    reference = _reference_trajectory()
    for result in fsdp_results:
        _assert_same_trajectory(result["trajectory"], reference)
    # Owners by position among all three matrices (0, 1, 0), not among those with a gradient at the first step
    # (which would have given matrix 2 to rank 1, then to rank 0 once matrix 1 had a gradient).
    assert [result["owned"] for result in fsdp_results] == [[True, False, True], [False, True, False]]
