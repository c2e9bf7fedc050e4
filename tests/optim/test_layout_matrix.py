"""Every optimizer in every layout, as users run it: the matrix of tests/optim/layout_matrix.py.

Rows: every name in the optimizer registry, and the state options that change the code path (bfloat16 state, the
8-bit, 4-bit and fp8 forms, Adam-mini's fused back end); a new registry entry joins with no edit. Columns: one
process, FSDP 2, FSDP 3 (uneven shards), TP 2, FSDP x TP 2x2, HSDP 2x2, DDP 2; a new layout joins as a line of
``COLUMNS``. Each cell trains 3 steps in float64 through the trainer's own code, with optimizer health measured at
every step, and saves a checkpoint at step 2; three resumed cells per row load a step-2 checkpoint saved in another
column (one process -> TP 2, TP 2 -> FSDP 3, FSDP 2 -> FSDP x TP) and train step 3. Every cell must equal the one
process column: losses, every weight, every health metric. Cells a layout rules out (``REFUSED``) must be refused, as
preflight refuses them, and no other cell may be.

Tolerances, and why:

* exact rows (float32-or-wider state, float64 weights): layouts differ from one process by summation order only
  (~1e-16 per operation); Adam's first steps divide by |g| + eps, magnifying that on entries whose gradient is near
  zero, so weights get 1e-9 absolute (they move by ~1e-2), losses 1e-12 relative.
* rows whose state is stored rounded (bfloat16 moments, rounded stochastically; torchao's 8-bit, 4-bit and fp8
  blocks): the same values round the same way in every layout, but a value that differs by 1e-16 may land on the
  other side of a rounding boundary (a stochastic rounding's threshold, a quantization code's midpoint), which moves
  that entry's moment by one code and its update by up to lr x one code's share. Their weights are checked to
  ``lr * 0.05`` (a whole update is ~lr), their losses to 1e-6: a wrong layout (a shard stepped with another
  shard's state, a partial gradient) moves weights by ~lr. Their state must also really be quantized in every
  cell of the low-bit rows, or the row would prove nothing.
* SOAP: its first eigenbasis is that of a statistic of rank min(rows, tokens); with 96 tokens per step against 64
  or fewer rows here every statistic is full-rank with distinct eigenvalues, so the bases are determined and the
  row is held exact. (On a rank-deficient statistic the basis of its null space is arbitrary, and two layouts may
  pick different ones; the test model avoids that rather than loosen the check.)

The matrix's wall time on 2 cores is measured by the fixtures (printed with ``-s``).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time

import pytest

from tests.distributed import run_workers
from tests.optim import layout_matrix
from tests.optim.layout_matrix import COLUMNS, LR, RESUMES, Row, rows

ROWS = {row.label: row for row in rows()}
DISTRIBUTED = [column for column, (size, _) in COLUMNS.items() if size > 1]
CELLS = [(label, column) for label in ROWS for column in DISTRIBUTED] + [
    (label, f"{resumed}<-{saved}") for label in ROWS for saved, resumed in RESUMES
]
WORLD_SIZES = sorted({size for size, _ in COLUMNS.values()})
EXACT = dict(weights=1e-9, loss=1e-12, health=1e-9)
ROUNDED = dict(weights=float(LR) * 0.05, loss=1e-6, health=1e-3)
ROUNDED_FLOAT32 = dict(weights=float(LR) * 0.1, loss=1e-5, health=1e-3)
NOT_DETERMINED = dict(loss=1e-3)
# torchao's low-bit steps are compiled per step (15-45 s cold, each kind): the matrix runs them eagerly, the same
# functions; the compiled rows are tests/optim/test_layout_matrix_compiled.py.
EAGER = {"TORCHDYNAMO_DISABLE": "1"}

_BASES: list[tempfile.TemporaryDirectory] = []
TIMES: dict[int, float] = {}


@functools.lru_cache(maxsize=None)
def _base() -> str:
    _BASES.append(tempfile.TemporaryDirectory(prefix="layout-matrix-"))
    return _BASES[-1].name


def _run_world(rank: int, world_size: int, base: str) -> dict:
    os.environ.update(EAGER)
    return layout_matrix.run_world(rank, world_size, base)


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
        with pytest.MonkeyPatch.context() as patch:
            for key, value in EAGER.items():
                patch.setenv(key, value)
            per_rank = [layout_matrix.run_world(0, 1, _base())]
    else:
        per_rank = run_workers(_run_world, world_size, (_base(),), timeout=600)
    TIMES[world_size] = time.monotonic() - started
    print(f"layout matrix: world size {world_size} in {TIMES[world_size]:.1f} s")
    for rank_results in per_rank[1:]:
        for key, result in rank_results.items():
            assert result.keys() == per_rank[0][key].keys(), key
            if "weights" in result:  # every rank ends with the same whole weights
                for name, value in result["weights"].items():
                    assert (value == per_rank[0][key]["weights"][name]).all(), (key, name)
    for key, result in per_rank[0].items():
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
    if row.rounds_state:
        return ROUNDED_FLOAT32 if row.param_dtype == "float32" else ROUNDED
    return EXACT


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
        assert loss == pytest.approx(reference["losses"][step], rel=tolerance["loss"], abs=0.0), f"loss at {step}"
    _assert_state_on_owners_or_everywhere(row, column, result)
    for step, metrics in result["health"].items():
        assert metrics, f"no health metrics at step {step}"
        assert metrics.keys() == reference["health"][step].keys()
        assert all(math.isfinite(value) for value in metrics.values())
        if not row.determined:
            continue
        for key, value in metrics.items():
            expected = reference["health"][step][key]
            assert value == pytest.approx(expected, rel=tolerance["health"], abs=1e-12), f"{key} at step {step}"
    assert result["weights"].keys() == reference["weights"].keys()
    assert result["quantized"] == reference["quantized"]
    if not row.determined:
        return
    worst = max(abs(result["weights"][n] - reference["weights"][n]).max() for n in reference["weights"])
    moved = max(abs(reference["weights"][n] - _initial_weights()[n]).max() for n in reference["weights"])
    assert worst <= tolerance["weights"], f"weights differ from one process by {worst:.3g} (they moved {moved:.3g})"


def _option(options: tuple[str, ...], key: str, default: int) -> int:
    return int(options[options.index(key) + 1]) if key in options else default


def _assert_state_on_owners_or_everywhere(row: Row, column: str, result: dict) -> None:
    """Each state of each parameter is on every rank (a DTensor shard, or a step count) or, kept whole for a matrix
    by its owner, on one rank of each group that splits it: one per replica (HSDP), one in all (FSDP, TP)."""
    layout = column.split("<-")[0]
    world_size, options = COLUMNS[layout]
    replicas = _option(options, "--training.data_parallel_replicate_degree", 1)
    counts = set(result["held_by"].values())
    assert counts <= {world_size, replicas}, (layout, counts)
    if not row.determined and layout not in ("ddp2", "one_process"):  # SOAP keeps its matrices' state on owners
        assert replicas in counts and replicas < world_size


def _assert_preflight_refuses(row: Row, column: str, message: str) -> None:
    """A cell the optimizer refuses must be one that preflight refuses first, with the same reason."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.errors import UserError
    from torchtitan.estimation.layout_check import check_optimizer_layout
    from torchtitan.parallelisms import ParallelDims

    job = JobConfig.parse_args(layout_matrix.job_argv(row, column, _base()))
    dims = ParallelDims.from_job_config(job, COLUMNS[column][0])
    with pytest.raises(UserError) as refused:
        check_optimizer_layout(job, dims, layout_matrix.MATRIX_MODEL)
    assert message in str(refused.value)


@pytest.mark.parametrize("row, column", list(layout_matrix.REFUSED), ids=lambda x: getattr(x, "label", x))
def test_a_cell_the_layout_rules_out_is_refused_as_preflight_refuses_it(row, column):
    """The refusal branch: train.py's build refuses the cell in one line, and preflight refuses it first, alike."""
    result = _results(_world_of(column))[(row.label, column)]
    assert "refused" in result, f"{row.label} trained at {column}"
    assert layout_matrix.REFUSED[(row, column)] in result["refused"]
    _assert_preflight_refuses(row, column, result["refused"])


@functools.lru_cache(maxsize=None)
def _initial_weights() -> dict:
    import torch

    from torchtitan.config.job_config import JobConfig
    from torchtitan.parallelisms import ParallelDims
    from torchtitan.training.step import build_model, init_model

    job = JobConfig.parse_args(["--training.param_dtype", "float64"])
    model = build_model(job, layout_matrix.MATRIX_MODEL, ParallelDims(1, 1, 1, 1), None)
    model = init_model(model, torch.device("cpu"), layout_matrix.SEED)
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


@pytest.mark.parametrize("label", list(ROWS))
def test_every_row_trains_in_one_process_with_its_state_as_named(label):
    row = ROWS[label]
    reference = _reference(label)
    assert "refused" not in reference, reference
    assert all(math.isfinite(loss) for loss in reference["losses"].values())
    moved = max(abs(reference["weights"][n] - _initial_weights()[n]).max() for n in reference["weights"])
    assert moved > float(LR) * 0.5  # it trained
    from torchtitan.optim.settings import BLOCK_SIZE

    # The low-bit rows really keep quantized state on this model (else they would test plain AdamW).
    assert reference["quantized"] == (BLOCK_SIZE in layout_matrix.OPTIMIZERS[row.name].options)


def test_tp2_hands_optimizers_gradients_laid_out_unlike_their_weights():
    """The TP 2 column exercises the rule every optimizer must keep (read gradients through grad_like_param): the
    embedding's gradient comes back replicated while its weight is sharded, the norms' as partial sums."""
    mismatched = _results(2)[("AdamW", "tp2")]["mismatched"]
    assert "tok_embeddings.weight" in mismatched
    assert any(name.endswith("norm.weight") for name in mismatched)
    assert _results(2)[("AdamW", "fsdp2")]["mismatched"] == []


def test_rows_come_from_the_registry():
    from torchtitan.optim.builder import OPTIMIZERS

    assert {row.name for row in rows()} == set(OPTIMIZERS)
    assert [row.label for row in rows()][: len(OPTIMIZERS)] == list(OPTIMIZERS)
