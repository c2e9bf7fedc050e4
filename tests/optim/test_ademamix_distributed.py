"""AdEMAMix across processes (gloo, float64): under FSDP2 and TP it equals one process, and its step communicates
nothing (the worlds: ``parallel_worlds.py``). Its other layouts (uneven FSDP 3, FSDP x TP, HSDP, DDP, resumes), built
the way train.py builds them, are the layout matrix's (tests/optim/test_layout_matrix.py)."""

from __future__ import annotations

import pytest

from tests.helpers import max_difference, tiny_model, weights
from tests.optim.parallel_worlds import result

pytestmark = pytest.mark.timeout(600)
FAMILY = "ademamix"  # the worlds this module spawns (tests/optim/conftest.py)


@pytest.mark.parametrize(
    "world_name, layout",
    [("world2", "fsdp"), ("world2", "tp")],
)
def test_ademamix_parallel_run_equals_single_process(request, one_process, world_name, layout):
    params = result(request.getfixturevalue(world_name), f"ademamix_{layout}")
    assert max_difference(params, one_process["ademamix"]) < 1e-12
    assert max_difference(one_process["ademamix"], weights(tiny_model())) > 1e-3  # it trained


def test_ademamix_step_communicates_nothing(world2):
    assert result(world2, "ademamix_comm_fsdp")["counts"] == {}
