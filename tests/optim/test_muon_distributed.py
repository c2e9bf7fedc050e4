"""Muon across processes (gloo, float64 Newton–Schulz): FSDP2, TP, FSDP x TP and HSDP equal one process; a step's
collectives are the owner rounds of ``muon.distributed`` (counted, with the entries sent); a checkpoint saved on 2
ranks resumes exactly in one process (the worlds: ``parallel_worlds.py``). Uneven shards (FSDP 3), resumes into
other layouts and Muon built the way train.py builds it are the layout matrix's (tests/optim/test_layout_matrix.py)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import max_difference, muon_for, tiny_model, weights
from tests.optim.parallel_worlds import hidden_matrices, muon_path, result, resume

pytestmark = pytest.mark.timeout(600)
FAMILY = "muon"  # the worlds this module spawns (tests/optim/conftest.py)


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world2", "tp"),
        ("world4", "fsdp_tp"),
        ("world4", "hsdp"),
    ],
)
def test_muon_parallel_run_equals_single_process(request, one_process, world_name, layout):
    params = result(request.getfixturevalue(world_name), f"muon_{layout}")
    assert max_difference(params, one_process["muon"]) < 1e-9
    assert max_difference(one_process["muon"], weights(tiny_model())) > 1e-3  # it trained


@pytest.mark.parametrize("world_name, layout, ranks", [("world2", "fsdp", 2), ("world4", "fsdp_tp", 4)])
def test_muon_step_sends_each_matrix_to_one_owner_and_back(request, world_name, layout, ranks):
    """Owner rounds: 2 all-to-alls per round of ``ranks`` matrices. Rank 0 sends its piece of every matrix and, for
    each matrix it owns (every ``ranks``-th), every rank's piece of the result: the whole matrix."""
    comm = result(request.getfixturevalue(world_name), f"muon_comm_{layout}")
    matrices = hidden_matrices()
    total = sum(p.numel() for p in matrices)
    owned = sum(p.numel() for p in matrices[::ranks])
    gather_everything = total * (ranks - 1) // ranks
    print(
        f"Muon {layout} {ranks} ranks: {comm['counts']}; rank 0 sends {comm['sizes']} of {total} matrix entries; "
        f"gathering every matrix would receive {gather_everything} per rank in {len(matrices)} all-gathers"
    )
    assert comm["counts"] == {"alltoall_base_": 2 * math.ceil(len(matrices) / ranks)}
    assert sum(size for _, size in comm["sizes"]) == total // ranks + owned  # even shards of the tiny matrices


def test_muon_checkpoint_from_2_ranks_resumes_exactly_on_1_rank(world2, checkpoint_dir, one_process):
    result(world2, "muon_save")
    resumed = resume(tiny_model(seed=7), muon_path(checkpoint_dir), muon_for)
    assert max_difference(resumed, one_process["muon_uninterrupted"]) < 1e-9
