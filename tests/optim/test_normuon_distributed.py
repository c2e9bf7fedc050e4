"""NorMuon across processes (gloo, float64): in Muon's layouts it equals one process, with either step size; a step's
collectives are Muon's owner rounds plus all-reduces of row sums and norms (the worlds: ``parallel_worlds.py``).
Uneven shards (FSDP 3) and NorMuon built the way train.py builds it are the layout matrix's
(tests/optim/test_layout_matrix.py)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import max_difference, tiny_model
from tests.optim.parallel_worlds import hidden_matrices, result

pytestmark = pytest.mark.timeout(600)
FAMILY = "normuon"  # the worlds this module spawns (tests/optim/conftest.py)


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world2", "tp"),  # row-wise TP: the rows' sums of squares are partial
        ("world4", "fsdp_tp"),
        ("world4", "hsdp"),
    ],
)
def test_normuon_parallel_run_equals_single_process(request, one_process, world_name, layout):
    params = result(request.getfixturevalue(world_name), f"normuon_{layout}")
    assert max_difference(params, one_process["normuon"]) < 1e-9
    assert max_difference(one_process["normuon"], one_process["muon"]) > 1e-4  # the rows were normalised


@pytest.mark.parametrize("world_name, layout", [("world2", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp")])
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
