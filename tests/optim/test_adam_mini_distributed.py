"""Adam-mini across processes (gloo, float64), for what the layout matrix does not prove.

Adam-mini's default rules, its fused back end and bf16 momentum against one process under FSDP 2, uneven FSDP 3, TP
2, FSDP x TP 2x2, HSDP 2x2 and DDP, and resumes across layouts, are the matrix's cells, built as train.py builds a
run (tests/optim/test_layout_matrix.py); equality with the official adam-mini and its first release in one process
is tests/optim/test_adam_mini.py. Here, against one process: every optional partition rule at once (blocks that are
whole tensors, partial over every split) under FSDP, TP, FSDP x TP and HSDP; FSDP x TP on 3 x 2, the one layout where
FSDP cuts the heads of the TP shards unevenly; bf16 momentum under FSDP, TP, FSDP x TP and HSDP, and 8-bit momentum
under HSDP and FSDP x TP, held to float64 rounding (8-bit blocks are the one-process blocks); the fused step on
ranks that hold empty shards; the fused back end's one-pass operator stepping every tensor in one call, and its
compiled graphs alone. And what the matrix cannot see: an FSDP step sends only per-block sums (one all-reduce, no
all-gather), TP and FSDP x TP steps no parameter-sized tensor; a DCP checkpoint saved on 2 ranks resumes exactly in
one process without a process group. The worlds are shared with the other families (``parallel_worlds.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import max_difference, tiny_model
from tests.optim.parallel_worlds import (
    ONE_PASS_RUNS,
    STEPS,
    block_sums_per_step,
    result,
    resume,
    train_with_empty_shards,
)
from torchtitan.optim.adam_mini.partition import PER_ROW
from torchtitan.optim.state.storage import BFLOAT16, INT8

pytestmark = pytest.mark.timeout(600)
FAMILY = "adam_mini"  # the worlds this module spawns (tests/optim/conftest.py)


def test_fsdp_tp_with_heads_cut_unevenly_equals_single_process(world6, one_process):
    """3 x 2: FSDP cuts the 8 key rows of each TP shard into 3, 3 and 2, across the head boundary."""
    assert max_difference(result(world6, "fsdp_tp"), one_process[PER_ROW]) < 1e-10


@pytest.mark.parametrize(
    "world_name, layout", [("world2", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp"), ("world4", "hsdp")]
)
def test_every_other_partition_rule_equals_single_process(request, one_process, world_name, layout):
    params = result(request.getfixturevalue(world_name), f"{layout}_other_partition")
    assert max_difference(params, one_process["other_partition"]) < 1e-10
    assert max_difference(one_process["other_partition"], one_process[PER_ROW]) > 1e-4  # the rules mattered


@pytest.mark.parametrize(
    "world_name, layout", [("world2", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp"), ("world4", "hsdp")]
)
def test_bfloat16_momentum_equals_single_process(request, one_process, world_name, layout):
    """Rounded to bf16 alike in every layout: exact (the matrix holds its bf16 rows only to a share of one update)."""
    params = result(request.getfixturevalue(world_name), f"{layout}_{BFLOAT16}")
    assert max_difference(params, one_process[BFLOAT16]) < 1e-10
    assert max_difference(one_process[BFLOAT16], one_process[PER_ROW]) > 1e-6  # the rounding mattered


def test_fsdp_step_sends_only_block_sums(world2):
    comm = result(world2, "comm_fsdp")
    print(f"FSDP step collectives: {comm['counts']}, elements sent: {comm['sizes']}")
    assert comm["counts"] == {"all_reduce": 1}
    assert comm["sizes"] == [("all_reduce", block_sums_per_step())]
    assert max(size for _, size in comm["sizes"]) < comm["smallest_param"]


def test_tp_and_fsdp_tp_steps_send_no_parameter_sized_tensor(world2, world4):
    for name, comm in (("TP 2", result(world2, "comm_tp")), ("FSDP x TP 2x2", result(world4, "comm_fsdp_tp"))):
        print(f"{name} step collectives: {comm['counts']}, elements sent: {comm['sizes']}")
        assert "all_gather_into_tensor" not in comm["counts"]
        # Per-row and per-block statistics only: never more than one entry per row of every matrix.
        all_rows = sum(p.shape[0] for p in tiny_model().parameters() if p.dim() == 2)
        assert sum(size for _, size in comm["sizes"]) <= all_rows + block_sums_per_step()


def test_checkpoint_from_2_ranks_resumes_exactly_on_1_rank(world2, checkpoint_dir, one_process):
    result(world2, "save")
    resumed = resume(tiny_model(seed=7), checkpoint_dir)
    assert max_difference(resumed, one_process["uninterrupted"]) < 1e-10


def test_fused_step_with_empty_local_shards_equals_single_process(world2):
    # The second of 2 ranks holds no row of any parameter, yet takes part in the block sums' all-reduce.
    assert max_difference(result(world2, "empty_shards"), train_with_empty_shards(1, STEPS)) < 1e-10


def test_fused_fsdp_step_still_sends_one_all_reduce_of_block_sums(world2):
    comm = result(world2, "comm_fsdp_fused")
    assert comm["counts"] == {"all_reduce": 1}
    assert comm["sizes"] == [("all_reduce", block_sums_per_step())]


# Weights that the FSDP x TP layout splits by columns (row-wise wo and w2, the embedding): their 8-bit blocks are
# other runs of entries than in one process.
COLUMN_SPLIT = ("tok_embeddings.weight", "attention.wo.weight", "feed_forward.w2.weight")


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_8bit_momentum_hsdp_and_fsdp_tp_equal_single_process(world4, one_process, layout):
    """The quantization blocks are the one-process blocks in every layout (FSDP's rows; TP's column parts, whole
    blocks): the same run to float64 rounding (the matrix holds its 8-bit rows only to a share of one update)."""
    params = result(world4, f"{layout}_{INT8}")
    single, unquantized = one_process[f"wide_{INT8}"], one_process["wide"]
    assert max_difference(single, unquantized) > 1e-4  # quantization changes the one-process run
    assert any(name.endswith(COLUMN_SPLIT) for name in params)
    for name, value in params.items():
        assert (value - single[name]).abs().max().item() < 1e-10, name


ONE_PASS_LAYOUTS = [
    (f"world{size}", f"{layout}_one_pass{'_other_partition' if options else ''}")
    for size, runs in ONE_PASS_RUNS.items()
    for layout, options in runs
]


@pytest.mark.parametrize("world_name, layout", ONE_PASS_LAYOUTS)
def test_one_pass_operator_steps_every_tensor_at_once_and_equals_single_process(
    request, one_process, world_name, layout
):
    """Blocks split over ranks (heads cut by uneven shards, norms, row-wise TP) take the given means."""
    run = result(request.getfixturevalue(world_name), layout)
    assert run["calls"] == [len(list(tiny_model().parameters()))] * STEPS  # one call a step, every tensor
    expected = one_process["other_partition" if layout.endswith("other_partition") else PER_ROW]
    assert max_difference(run["weights"], expected) < 1e-10


def test_fused_compiled_graphs_alone_fsdp_tp_equal_single_process(world4, one_process):
    run = result(world4, "fsdp_tp_fused_graphs")
    assert run["calls"] == []
    assert max_difference(run["weights"], one_process[PER_ROW]) < 1e-10
