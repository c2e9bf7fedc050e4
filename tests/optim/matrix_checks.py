"""Every optimizer in every layout, as users run it: the matrix of tests/optim/layout_matrix.py.

Rows: every name in the optimizer registry and the state options that change the code path; a new registry entry
joins with no edit. The float64 grid holds the rows whose float32 run takes no path of its own, the float32 grid
(dynamo on, as users run it) the rows with a compiled step, rounded state or bfloat16 Newton-Schulz (see
layout_matrix.rows). Columns: one process, FSDP 2, FSDP 3 (uneven shards), TP 2, FSDP x TP 2x2, HSDP 2x2, DDP 2; a
new layout joins as a line of ``COLUMNS``. Each cell is a job built by train.py's build (``build_job``) from its job
config and trained 3 steps by ``Job.step`` on the trainer's data loader (2 micro-batches a step, clipping engaged,
the guard on, lr warm-up), optimizer health at every step, a checkpoint at step 2; three resumed cells per row load a
step-2 checkpoint saved in another column (one process -> TP 2, TP 2 -> FSDP 3, FSDP 2 -> FSDP x TP) and train
step 3. Every cell must equal the same row in one process: losses, every weight, every health metric. Cells a
layout rules out (``REFUSED``) must be refused by preflight and by the build alike, and no other cell may be.

Tolerances, derived (u: the unit roundoff, 2^-53 in float64, 2^-24 in float32):

* What differs between layouts is summation order (gradients reduced over ranks and shards, norms over shards):
  each reduced value differs by at most ~ sqrt(K) u relative, K <= 10^4 terms here (tokens x micro-batches x
  the widest inner dimension), so ~ 100 u.
* Adam-like steps divide by |g| + eps: an entry's update (~lr in size) is insensitive to a 100 u relative change
  of its gradient except where |g| itself is within that noise of zero, where the update's sign can flip (up to
  2 lr a step). Stored rounding (bfloat16 moments, 8-bit/4-bit/fp8 blocks, bfloat16 Newton-Schulz inputs) adds
  the same kind of event: a value within 100 u of a code boundary lands on the neighbouring code, one code's share
  of that entry's update. Both are sparse: an entry is affected with probability ~ 100 u / (its spread), and a
  wrong layout (a shard stepped with another's state, a partial gradient) moves every entry by ~lr instead.
* So weights are compared by their whole update, U = W_3 - W_0: ||U_layout - U_one|| / ||U_one|| <= 2 sqrt(p) + q,
  with p the affected share of entries and q the dense part (100 u). float64: p ~ 100 u * 10 (spread) ~ 1e-13,
  so 2 sqrt(p) ~ 1e-6 (``EXACT``, 1e-6). float32: p ~ 1e-4 (100 u * 10 with u = 6e-8, and one code's share of an
  update at most 1), so 2 sqrt(p) = 0.02 (``FLOAT32``, 0.02; a wrong layout gives ~1).
* bfloat16 state rounds stochastically: a moment's rounding differs between layouts wherever its random draw does,
  a dense error of at most one bfloat16 ulp (2^-8 relative) on every moment, so q <= 2^-8 / 2 on the update: the
  float64 rows with bfloat16 state get the float32 bounds after step 1 (step 1 reads no rounded state).
* Losses: step 1's differs by the forward's rounding only, ~ 100 u relative (1e-13 / 1e-5); later steps' follow
  their weights: the loss moves by ~ (L_1 - L_3) over the run, so a 2 sqrt(p) share of that, ~ 1e-3 relative
  in float32 (1e-10 in float64).
* Health metrics (norms and ratios of gradients, updates, weights): the same relative bounds as the updates.

The matrix's wall time on 2 cores is measured by the fixtures (printed with ``-s``).
"""

from __future__ import annotations

import functools
import math
import tempfile
import time

import numpy as np
import pytest

from tests.distributed import run_workers
from tests.optim import layout_matrix
from tests.optim.layout_matrix import COLUMNS, MAX_NORM, RESUMES, Row, rows

WORLD_SIZES = sorted({size for size, _ in COLUMNS.values()})
DISTRIBUTED = [column for column, (size, _) in COLUMNS.items() if size > 1]
EXACT = dict(update=1e-6, first_loss=1e-13, loss=1e-10, health=1e-6)
FLOAT32 = dict(update=0.02, first_loss=1e-5, loss=1e-3, health=0.02)
NOT_DETERMINED = dict(first_loss=1e-13, loss=1e-3)  # see layout_matrix.NOT_DETERMINED
_BASES: list[tempfile.TemporaryDirectory] = []
PARTS = ("float64", "float32", "torchao")


def part_of(row: Row) -> str:
    """Which test file runs the row's cells (one launch of each world size per file, so that the files run side
    by side): the float64 grid, torchao's compiled steps, the project's compiled float32 steps."""
    if row.dtype == "float64":
        return "float64"
    return "torchao" if layout_matrix.torchao_step(row) else "float32"


def _run_world_of(rank: int, world_size: int, base: str, tokens: str, labels: list[str]) -> dict:
    return layout_matrix.run_world(rank, world_size, base, tokens, labels)


def define(namespace: dict, part: str):
    """Define the matrix's tests for the rows of ``part`` (see ``part_of``) in a test module's ``namespace``; returns
    its launches' results by world size."""
    ROWS = {row.label: row for row in rows() if part_of(row) == part}
    REFUSED_HERE = [(row, column) for row, column in layout_matrix.REFUSED if part_of(row) == part]
    CELLS = [(label, column) for label in ROWS for column in DISTRIBUTED] + [
        (label, f"{resumed}<-{saved}") for label in ROWS for saved, resumed in RESUMES
    ]
    TIMES: dict[int, float] = {}
    LABELS = [*ROWS, *(row.label for row, _ in REFUSED_HERE)]

    @functools.lru_cache(maxsize=None)
    def _base() -> str:
        _BASES.append(tempfile.TemporaryDirectory(prefix=f"layout-matrix-{part}-"))
        return _BASES[-1].name

    @functools.lru_cache(maxsize=None)
    def _tokens() -> str:
        return layout_matrix.sample_tokens(_base())

    _LAUNCHES: dict[int, object] = {}  # world size -> its results, or the error its launch failed with

    def _results(world_size: int) -> dict:
        """Every cell of ``world_size`` (rank 0's view), launched once, a failed launch failing every test that needs it
        without launching again; smaller worlds first (their checkpoints are resumed by larger ones)."""
        if world_size not in _LAUNCHES:
            try:
                _LAUNCHES[world_size] = _launch(world_size)
            except Exception as e:  # noqa: BLE001 - kept, and raised for each test that needs this launch
                _LAUNCHES[world_size] = e
        if isinstance(_LAUNCHES[world_size], Exception):
            raise AssertionError(f"the world of {world_size} ranks failed") from _LAUNCHES[world_size]
        return _LAUNCHES[world_size]

    def _launch(world_size: int) -> dict:
        for smaller in WORLD_SIZES:
            if smaller < world_size:
                _results(smaller)
        started = time.monotonic()
        if world_size == 1:
            per_rank = [layout_matrix.run_world(0, 1, _base(), _tokens(), LABELS)]
        else:
            per_rank = run_workers(_run_world_of, world_size, (_base(), _tokens(), LABELS), timeout=2400)
        TIMES[world_size] = time.monotonic() - started
        costliest = sorted(per_rank[0].items(), key=lambda item: -item[1].get("cpu_seconds", 0.0))[:4]
        print(
            f"layout matrix ({part}): world size {world_size} in {TIMES[world_size]:.1f} s; costliest cells (rank 0's "
            "CPU s): "
            + ", ".join(f"{label} {column} {cell.get('cpu_seconds', 0.0):.1f}" for (label, column), cell in costliest)
        )
        for rank_results in per_rank[1:]:
            for key, result in rank_results.items():
                assert result.keys() == per_rank[0][key].keys(), key
                if "weights" in result:  # every rank ends with the same whole weights
                    for name, value in result["weights"].items():
                        assert (value == per_rank[0][key]["weights"][name]).all(), (key, name)
        for key, result in per_rank[0].items():
            if "inductor_compiles" in result:
                result["inductor_compiles_in_all"] = sum(ranks[key]["inductor_compiles"] for ranks in per_rank)
            if "held" in result:  # on how many ranks each parameter's each state is
                result["held_by"] = {
                    (name, state): sum(state in ranks[key]["held"][name] for ranks in per_rank)
                    for name in result["held"]
                    for state in set().union(*(ranks[key]["held"][name] for ranks in per_rank))
                }
        return per_rank[0]

    def _world_of(column: str) -> int:
        return COLUMNS[column.split("<-")[0]][0]

    def _reference(label: str) -> dict:
        return _results(1)[(label, "one_process")]

    def _tolerance(row: Row) -> dict:
        if not row.determined:
            return NOT_DETERMINED
        if row.dtype == "float64" and not row.rounds_state:
            return EXACT
        return {**FLOAT32, "first_loss": EXACT["first_loss"] if row.dtype == "float64" else FLOAT32["first_loss"]}

    @functools.lru_cache(maxsize=None)
    def _initial_weights(dtype: str) -> dict:
        """Every weight as the matrix's jobs initialise it (the same in every layout), before any step."""
        import torch

        from torchtitan.config.job_config import JobConfig
        from torchtitan.config.preflight import model_args_for
        from torchtitan.datasets import build_tokenizer
        from torchtitan.parallelisms import ParallelDims
        from torchtitan.training.step import build_model, init_model

        job = JobConfig.parse_args(layout_matrix.job_argv(Row("AdamW", dtype=dtype), "one_process", _base(), _tokens()))
        args = model_args_for(job, build_tokenizer(layout_matrix.TOKENIZER, "auto").n_words)
        model = init_model(
            build_model(job, args, ParallelDims(1, 1, 1, 1), None), torch.device("cpu"), layout_matrix.SEED
        )
        return {name: p.detach().to(torch.float64).numpy().copy() for name, p in model.named_parameters()}

    def _update_difference(result: dict, reference: dict, dtype: str) -> float:
        """||U - U_ref|| / ||U_ref|| over every weight, U the weights' change over the run (see the tolerances)."""
        initial = _initial_weights(dtype)
        difference = sum(float(np.sum((result["weights"][n] - reference["weights"][n]) ** 2)) for n in initial)
        update = sum(float(np.sum((reference["weights"][n] - initial[n]) ** 2)) for n in initial)
        return math.sqrt(difference / update)

    @pytest.mark.parametrize("label", list(ROWS))
    def test_every_row_trains_the_whole_loop_in_one_process(label):
        """The loop as users run it: lr warm-up, clipping that engages at every step (the pre-clip norm above max_norm),
        two micro-batches a step, weights that moved, quantized state where the row keeps it."""
        from torchtitan.optim.settings import BLOCK_SIZE

        row = ROWS[label]
        reference = _reference(label)
        assert "refused" not in reference, reference
        assert all(math.isfinite(loss) for loss in reference["losses"].values())
        lrs = reference["lrs"]
        assert lrs[1] < lrs[2] > lrs[3] and lrs[2] == pytest.approx(float(layout_matrix.LR)), lrs  # warm-up, decay
        assert min(reference["grad_norms"].values()) > MAX_NORM, reference["grad_norms"]  # clipping engaged
        initial = _initial_weights(row.dtype)
        moved = max(abs(reference["weights"][n] - initial[n]).max() for n in initial)
        assert moved > float(layout_matrix.LR) * 0.5  # it trained
        assert reference["quantized"] == (BLOCK_SIZE in layout_matrix.OPTIMIZERS[row.name].options)

    def test_the_float32_rows_compile_and_the_float64_rows_run_eagerly():
        """The float32 grid runs the compiled steps users get (dynamo on, graphs compiled in the one-process launch);
        the float64 grid compiles nothing (its steps have no compiled form)."""
        one_process = {label: result for (label, column), result in _results(1).items() if column == "one_process"}
        one_process = {label: result for label, result in one_process.items() if label in ROWS}
        if any(ROWS[label].dtype == "float32" for label in one_process):
            assert sum(r["compiled_graphs"] for label, r in one_process.items() if ROWS[label].dtype == "float32") > 0
        assert all(r["compiled_graphs"] == 0 for label, r in one_process.items() if ROWS[label].dtype == "float64")

    @pytest.mark.parametrize("label, column", CELLS)
    def test_cell_equals_one_process(label, column):
        row = ROWS[label]
        reference = _reference(label)
        assert "refused" not in reference, reference
        result = _results(_world_of(column))[(label, column)]
        assert "refused" not in result, result["refused"]  # only the cells of layout_matrix.REFUSED may be refused
        tolerance = _tolerance(row)
        for step, loss in result["losses"].items():
            assert math.isfinite(loss)
            rel = tolerance["first_loss"] if step == 1 else tolerance["loss"]
            assert loss == pytest.approx(reference["losses"][step], rel=rel, abs=0.0), f"loss at {step}"
        assert result["lrs"] == {step: reference["lrs"][step] for step in result["lrs"]}
        _assert_state_on_owners_or_everywhere(column, result)
        for step, metrics in result["health"].items():
            assert metrics, f"no health metrics at step {step}"
            assert metrics.keys() == reference["health"][step].keys()
            assert all(math.isfinite(value) for value in metrics.values())
            if not row.determined:
                continue
            for key, value in metrics.items():
                expected = reference["health"][step][key]
                assert math.isfinite(value)
                assert value == pytest.approx(expected, rel=tolerance["health"], abs=1e-12), f"{key} at step {step}"
        assert result["weights"].keys() == reference["weights"].keys()
        assert result["quantized"] == reference["quantized"]
        if not row.determined:
            return
        difference = _update_difference(result, reference, row.dtype)
        assert difference <= tolerance["update"], f"the weights' update differs from one process's by {difference:.3g}"

    def _option(options: tuple[str, ...], key: str, default: int) -> int:
        return int(options[options.index(key) + 1]) if key in options else default

    def _assert_state_on_owners_or_everywhere(column: str, result: dict) -> None:
        """Each state of each parameter is on every rank (a DTensor shard, or a step count) or, kept whole for a matrix
        by its owner, on one rank of each group that splits it: one per replica (HSDP), one in all (FSDP, TP)."""
        layout = column.split("<-")[0]
        world_size, options = COLUMNS[layout]
        replicas = _option(options, "--training.data_parallel_replicate_degree", 1)
        assert set(result["held_by"].values()) <= {world_size, replicas}, layout

    def _assert_preflight_refuses(row: Row, column: str, words: str) -> None:
        """preflight, as the launcher runs it (layout check included), refuses the cell in one line."""
        from torchtitan.config.job_config import JobConfig
        from torchtitan.config.preflight import preflight
        from torchtitan.errors import UserError

        job = JobConfig.parse_args(layout_matrix.job_argv(row, column, _base(), _tokens()))
        with pytest.raises(UserError) as refused:
            preflight(job, COLUMNS[column][0])
        assert words in str(refused.value) and "\n" not in str(refused.value)

    @pytest.mark.parametrize("row, column", REFUSED_HERE, ids=lambda x: getattr(x, "label", x))
    def test_a_cell_the_layout_rules_out_is_refused_by_preflight_and_by_the_build(row, column):
        """The refusal branch: preflight refuses the cell before any worker starts, and the build in the workers (what
        a direct torchrun of train.py would reach) refuses it alike, before any step."""
        _assert_preflight_refuses(row, column, layout_matrix.REFUSED[(row, column)])
        result = _results(_world_of(column))[(row.label, column)]
        assert "refused" in result, f"{row.label} trained at {column}"
        assert layout_matrix.REFUSED[(row, column)] in result["refused"]

    @pytest.mark.parametrize("column", [c for c in DISTRIBUTED if c != "fsdp3"] if part != "float64" else [])
    def test_ranks_with_the_same_shards_compile_each_step_graph_once_in_all(column):
        """Every rank of an even layout holds shards of the same shapes: one of them compiles each compiled step graph
        (the project's and torchao's) and the others load it from the shared inductor cache (optimizer_compile),
        rather than each compiling it at once."""
        results = _results(COLUMNS[column][0])
        checked = 0
        for label, row in ROWS.items():
            result = results.get((label, column), {})
            if row.dtype == "float32" and "inductor_compiles" in result:
                assert result["inductor_compiles_in_all"] <= result["compiled_graphs"], (
                    label,
                    result["inductor_compiles"],
                )
                checked += result["compiled_graphs"] > 0
        assert checked  # some row compiled its step here

    tests = {name: value for name, value in locals().items() if name.startswith("test_")}
    namespace.update({name: test for name, test in tests.items() if all(_has_cases(mark) for mark in _marks(test))})
    return _results


def _marks(test) -> list:
    return [mark for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize"]


def _has_cases(mark) -> bool:
    """A parametrized test with no case here (no cell of this part in that column) is left out, not skipped."""
    return len(mark.args[1]) > 0
