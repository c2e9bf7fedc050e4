"""The Muon family (Muon and NorMuon) across processes (gloo, float64 Newton–Schulz), for what the layout matrix does
not prove: a step's collectives are the owner rounds of ``muon.distributed`` (counted, with the entries sent), NorMuon's
plus all-reduces of row sums and norms; a Muon checkpoint saved on 2 ranks resumes exactly in one process; NorMuon
with the paper's step size equals one process under FSDP, TP and FSDP x TP (the worlds: ``parallel_worlds.py``).
Muon and NorMuon with their default settings against one process in every layout (FSDP 2, uneven FSDP 3, TP 2,
FSDP x TP, HSDP, DDP), resumes into other layouts, built the way train.py builds them, are the layout matrix's
(tests/optim/test_layout_matrix.py)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import max_difference, muon_for, tiny_model
from tests.optim.parallel_worlds import hidden_matrices, muon_path, result, resume

pytestmark = pytest.mark.timeout(600)
FAMILY = "muon"  # the worlds this module spawns (tests/optim/conftest.py)


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


@pytest.mark.parametrize(
    "world_name, layout",
    [("world2", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp")],  # row-wise TP: the rows' sums are partial
)
def test_normuon_rms_step_size_parallel_run_equals_single_process(request, one_process, world_name, layout):
    params = result(request.getfixturevalue(world_name), f"normuon_rms_{layout}")
    assert max_difference(params, one_process["normuon_rms"]) < 1e-9
    assert max_difference(one_process["normuon_rms"], one_process["normuon"]) > 1e-5  # another step size


@pytest.mark.parametrize("world_name, layout, ranks", [("world2", "fsdp", 2), ("world4", "fsdp_tp", 4)])
def test_normuon_step_is_muons_rounds_plus_all_reduces_of_row_sums_and_norms(request, world_name, layout, ranks):
    """Muon's owner rounds, then the two norms of every matrix, all-reduced over the mesh dimensions that split its
    rows (one all-reduce per dimension and group of matrices) and, where TP splits the columns (attention output,
    w2), one all-reduce of those matrices' row sums first."""
    comm = result(request.getfixturevalue(world_name), f"normuon_comm_{layout}")
    matrices = hidden_matrices()
    print(f"NorMuon {layout} {ranks} ranks: {comm['counts']}; rank 0 sends {comm['sizes']}")
    alltoalls = 2 * math.ceil(len(matrices) / ranks)
    reduced = [size for op, size in comm["sizes"] if op != "alltoall_base_"]
    if layout == "fsdp":
        assert comm["counts"] == {"alltoall_base_": alltoalls, "all_reduce": 1}
        assert reduced == [2 * len(matrices)]
    else:
        model = tiny_model()
        column_split = [
            p for name, p in model.named_parameters() if name.endswith(("attention.wo.weight", "w2.weight"))
        ]
        row_split = len(matrices) - len(column_split)  # split by rows over both dp and tp
        dp = ranks // 2  # each rank holds 1/dp of a column-split matrix's rows
        assert comm["counts"] == {"alltoall_base_": alltoalls, "all_reduce": 4}
        expected = [sum(p.shape[0] for p in column_split) // dp, 2 * row_split, 2 * row_split, 2 * len(column_split)]
        assert sorted(reduced) == sorted(expected)
