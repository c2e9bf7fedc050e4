"""The optimizer x layout matrix's cells, each a job built and trained by train.py's own code (the tests assert).

A cell is one row (an optimizer as ``[optimizer]`` options) in one column (a layout as ``[training]`` degrees), a job
config like any user's: ``debugmodel_tiny`` (two blocks), pre-tokenized sample data read by the trainer's data loader,
gradient accumulation 2, clipping that engages, the divergence guard on, lr warm-up then decay, optimizer health at
every step, a checkpoint manager. It is checked by ``preflight`` and built by ``torchtitan.training.job.build_job``,
and each step is ``Job.step``: the very build and step train.py runs, not a copy.

Two grids. The float64 grid runs the rows whose float32 run takes no other path (plain Adam/AdamW, Adam-mini's
foreach back end, Muon and NorMuon with their Newton-Schulz in float64, SOAP), where layouts must agree to float64
rounding. The float32 grid runs, as users run them, the rows whose float32 run takes a path of its own: a compiled
step (Adam-mini's fused back end and its quantized momentum, AdEMAMix, the bfloat16-state steps, torchao's
8-bit/4-bit/fp8 AdamW, in blocks of 32: see LOW_BIT_BLOCK) or bfloat16 Newton-Schulz (Muon, NorMuon).

Every launch of a world size runs all of that size's cells in one process group (processes are the slow part), one
after another; rows are derived from the registry, so a new optimizer joins with no edit here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.optim.settings import ADEMAMIX_ALPHA, BLOCK_SIZE, NS_DTYPE, STATE_DTYPE, VALUE_BLOCKS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "assets", "tokenizer", "tiktoken_test.model")
FLAVOR = "debugmodel_tiny"
SEQ_LEN = 8
GLOBAL_BATCH = 12  # sequences per micro-batch over all ranks: divisible by every data-parallel degree (1, 2, 3, 4)
ACCUMULATION = 2
STEPS, SAVE_AT, WARMUP = 3, 2, 2  # lr: half the peak at step 1, the peak at step 2, decaying at step 3
SEED = 0
LR = "0.01"
# Below the first steps' gradient norms (measured 0.64-0.70 on this model and data), so clipping always engages; the
# test asserts it did at every step.
MAX_NORM = 0.5
# Quantized blocks of 32 values: the tiny model's rows (64 and 192 values, 32 and 96 where TP 2 halves them) hold
# whole blocks, so the low-bit rows really quantize in every layout. torchao's defaults (256, 128) need rows of 512
# values to quantize at TP 2 (on these shapes nothing would be quantized: the row would test plain AdamW).
LOW_BIT_BLOCK = "32"

# Optimizers whose trajectory the gradients do not determine, with the reason: their cells are held to losses close
# to one process's, health present and finite, state on the owners.
NOT_DETERMINED = {
    "SOAP": "its first eigenbases are those of statistics of rank at most the gradient's: a 32 x 64 matrix's 64 x 64 "
    "right statistic has rank 32 at step 1, and the basis of its null space is whatever eigh makes of 1e-16 "
    "differences in summation order (exact equality on full-rank statistics: tests/optim/test_soap_distributed.py)",
}


@dataclass(frozen=True)
class Row:
    """An optimizer as the job's ``[optimizer]`` options, in a parameter dtype."""

    name: str
    options: tuple[tuple[str, str], ...] = ()
    dtype: str = "float64"

    @property
    def label(self) -> str:
        return "-".join([self.name, *(f"{k}={v}" for k, v in self.options), self.dtype])

    def argv(self) -> list[str]:
        argv = ["--optimizer.name", self.name, "--optimizer.lr", LR]
        if BLOCK_SIZE in OPTIMIZERS[self.name].options and BLOCK_SIZE not in dict(self.options):
            argv += ["--optimizer.block_size", LOW_BIT_BLOCK]
        if NS_DTYPE in OPTIMIZERS[self.name].options and self.dtype == "float64":
            argv += ["--optimizer.ns_dtype", "float64"]  # the float64 grid's exactness (bfloat16 by default)
        for key, value in self.options:
            argv += [f"--optimizer.{key}", value]
        return argv

    @property
    def determined(self) -> bool:
        """Whether its trajectory is determined by the gradients; see ``NOT_DETERMINED``."""
        return self.name not in NOT_DETERMINED

    @property
    def rounds_state(self) -> bool:
        """Its state is stored rounded (bfloat16, 8-/4-bit, fp8 blocks)."""
        return BLOCK_SIZE in OPTIMIZERS[self.name].options or dict(self.options).get(STATE_DTYPE) == "bfloat16"


def _float32_path(name: str) -> bool:
    """Whether the optimizer's float32 run takes a path its float64 run does not (see the module's docstring)."""
    kind = OPTIMIZERS[name]
    return (
        BLOCK_SIZE in kind.options  # torchao's compiled low-bit steps, Adam-mini's quantized momentum graphs
        or ADEMAMIX_ALPHA in kind.options  # AdEMAMix's compiled step
        or NS_DTYPE in kind.options  # bfloat16 Newton-Schulz by default
        or _is_adam_mini(kind)  # fused in float32 by default
    )


def torchao_step(row: Row) -> bool:
    """Whether the row's step is torchao's (its low-bit AdamW variants)."""
    kind = OPTIMIZERS[row.name]
    return BLOCK_SIZE in kind.options and not _is_adam_mini(kind)


def _is_adam_mini(kind) -> bool:
    return VALUE_BLOCKS in kind.options


def rows() -> list[Row]:
    """The float64 grid's rows, then the float32 grid's: every registered optimizer and its bfloat16 state, each in
    one grid, and Muon's family in both (float64 Newton-Schulz proves its distributed rounds exactly, bfloat16 is
    its default).

    float32 (dynamo on): each optimizer whose float32 run takes a path of its own, and the bfloat16 state of the
    first optimizer whose float32 run does not (AdamW's compiled bfloat16 step). float64 (steps eager, see
    ``run_cell``): the others, and the bfloat16 state of the float32 grid's optimizers and of Adam: their compiled
    steps are those the float32 grid compiles (Adam-mini's graphs, as for its quantized momentum; AdEMAMix's; Muon's
    AdamW part and Adam's are AdamW's bfloat16 step, Adam's with its decay added to the gradient), run here in their
    eager form, in every layout."""
    bfloat16 = ((STATE_DTYPE, "bfloat16"),)
    takes_state_dtype = [name for name, kind in OPTIMIZERS.items() if STATE_DTYPE in kind.options]
    exact = [Row(name) for name in OPTIMIZERS if not _float32_path(name)]
    exact += [Row(name) for name, kind in OPTIMIZERS.items() if NS_DTYPE in kind.options]  # Newton-Schulz in float64
    # Adam-mini in float64: its foreach back end (its default there; fused is its float32 default).
    exact += [Row(name) for name, kind in OPTIMIZERS.items() if _is_adam_mini(kind) and BLOCK_SIZE not in kind.options]
    exact += [Row(name, bfloat16) for name in takes_state_dtype if _float32_path(name)]
    compiled = [Row(name, (), "float32") for name in OPTIMIZERS if _float32_path(name)]
    # The plain optimizers' bfloat16 state is one compiled step (LowPrecisionAdam), its weight decay decoupled
    # (AdamW, the first registered) or added to the gradient (Adam): compiled in the first, eager in the others.
    plain = [name for name in takes_state_dtype if not _float32_path(name)]
    compiled += [Row(name, bfloat16, "float32") for name in plain[:1]]
    exact += [Row(name, bfloat16) for name in plain[1:]]
    return exact + compiled


# Columns: layout name -> (world size, [training] options). A new layout joins as a line here.
COLUMNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "one_process": (1, ()),
    "fsdp2": (2, ("--training.data_parallel_shard_degree", "2")),
    "fsdp3": (3, ("--training.data_parallel_shard_degree", "3")),
    "tp2": (2, ("--training.data_parallel_shard_degree", "1", "--training.tensor_parallel_degree", "2")),
    "fsdp2_x_tp2": (4, ("--training.data_parallel_shard_degree", "2", "--training.tensor_parallel_degree", "2")),
    "hsdp2x2": (
        4,
        ("--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "2"),
    ),
    "ddp2": (2, ("--training.data_parallel_type", "ddp")),
}
# Resumed cells: (saved in, resumed in); each resumes every row's step-2 checkpoint for step 3.
RESUMES = (("one_process", "tp2"), ("tp2", "fsdp3"), ("fsdp2", "fsdp2_x_tp2"))


def data_parallel_degree(column: str) -> int:
    world_size, options = COLUMNS[column]
    key = "--training.tensor_parallel_degree"
    return world_size // (int(options[options.index(key) + 1]) if key in options else 1)


def job_argv(row: Row, column: str, folder: str, tokens: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--model.flavor",
        FLAVOR,
        "--model.tokenizer_path",
        TOKENIZER,
        "--training.dataset",
        "tokens",
        "--training.dataset_path",
        tokens,
        "--training.data_workers",
        "0",
        "--training.param_dtype",
        row.dtype,
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.batch_size",
        str(GLOBAL_BATCH // data_parallel_degree(column)),
        "--training.gradient_accumulation_steps",
        str(ACCUMULATION),
        "--training.steps",
        str(STEPS),
        "--training.warmup_steps",
        str(WARMUP),
        "--training.max_norm",
        str(MAX_NORM),
        "--training.seed",
        str(SEED),
        "--loss.num_chunks",
        "3",
        "--metrics.health_freq",
        "1",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.folder",
        "checkpoint",
        "--checkpoint.interval",
        "1000",
        "--job.dump_folder",
        folder,
        *COLUMNS[column][1],
        *row.argv(),
        *extra,
    ]


# Cells a layout rules out, with words of their refusal: preflight refuses them (in the launching process, as
# run_llama_train.sh runs it) and the build refuses them alike in the workers, before any step. Quantized blocks of
# 64 values are the tiny model's whole rows, which TP 2 halves in the row-wise split weights (attention output):
# torchao's 8-bit AdamW and Adam-mini's 8-bit momentum refuse alike. (At their default block sizes every row trains
# in every layout here.)
REFUSED: dict[tuple[Row, str], str] = {
    (Row(name, ((BLOCK_SIZE, "64"),), "float32"), "tp2"): "in blocks of 64 along its last dimension, which the "
    "layout splits into parts of up to 32"
    for name in ("AdamW8bit", "AdamMini8bit")
}


def sample_tokens(base: str) -> str:
    """The sample data, pre-tokenized into ``base``/tokens (the tokens loader reads the same global batch at any
    number of data-parallel ranks)."""
    from torchtitan.logging import quiet
    from torchtitan.tools.pretokenize import pretokenize

    folder = os.path.join(base, "tokens")
    if not os.path.isdir(folder):
        with quiet():
            pretokenize("sample", TOKENIZER, folder)
    return folder


def cell_folder(base: str, row: Row, column: str) -> str:
    return os.path.join(base, row.label, column)


def run_cell(
    row: Row, column: str, base: str, tokens: str, resume_from: Optional[str] = None, extra: tuple[str, ...] = ()
) -> dict:
    """Train one cell ``STEPS`` steps (saving at ``SAVE_AT``), or, with ``resume_from`` (a column), load that
    column's step-``SAVE_AT`` checkpoint and train the rest; ``extra``: more of the job's options. Returns what
    every rank saw, or the one-line refusal."""
    started = time.process_time()
    if row.dtype == "float64":  # the float64 grid's steps run eagerly (see rows)
        with torch.compiler.set_stance("force_eager"):
            result = _run_cell(row, column, base, tokens, resume_from, extra)
    else:
        result = _run_cell(row, column, base, tokens, resume_from, extra)
    result["cpu_seconds"] = time.process_time() - started  # this rank's CPU for the cell, compiles included
    return result


def _run_cell(
    row: Row, column: str, base: str, tokens: str, resume_from: Optional[str], extra: tuple[str, ...]
) -> dict:
    from torch._dynamo.utils import counters

    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.preflight import preflight
    from torchtitan.errors import UserError
    from torchtitan.optim.state.storage import is_quantized
    from torchtitan.training.job import build_job

    graphs_before = counters["stats"]["unique_graphs"]  # the state's creation compiles the optimizer's step
    compiles_before = _inductor_compiles()
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    folder = cell_folder(base, row, resume_from if resume_from is not None else column)
    job_config = JobConfig.parse_args(job_argv(row, column, folder, tokens, extra))
    # As train.py's ranks after a launcher's preflight: the layout check ran in the launching process.
    job = build_job(job_config, preflight(job_config, world_size, check_layout=False), torch.device("cpu"), world_size)
    try:
        job.optimizers.initialise_state()  # as train.py: where a layout rules the state out, it is refused here
    except UserError as e:
        return {"refused": str(e)}
    if resume_from is not None:
        assert job.checkpoint.load(step=SAVE_AT), f"no checkpoint of {row.label} at step {SAVE_AT} in {folder}"
        assert job.train_state.step == SAVE_AT
    losses, healths, norms, lrs, mismatched = {}, {}, {}, {}, []
    while job.train_state.step < STEPS:
        outcome = job.step()
        step = job.train_state.step
        assert outcome.updated, f"the guard skipped step {step}"
        if step == 1:
            mismatched = sorted(name for name, p in job.model.named_parameters() if _laid_out_otherwise(p))
        total = outcome.loss.detach().reshape(1).clone()
        if job.dp_group is not None:
            dist.all_reduce(total, group=job.dp_group)
        losses[step] = total.item() / job.dp_degree
        norms[step] = float(outcome.grad_norm)
        lrs[step] = outcome.lr
        healths[step] = job.health.metrics(outcome.lr)
        if resume_from is None and any(column == saved for saved, _ in RESUMES):
            job.checkpoint.save(step, force=step == SAVE_AT)
    job.checkpoint.close()
    states = [value for opt in job.optimizers for state in opt.state.values() for value in state.values()]
    return {
        "losses": losses,
        "grad_norms": norms,
        "lrs": lrs,
        "health": healths,
        "weights": {name: _whole(p).numpy().copy() for name, p in job.model.named_parameters()},
        "quantized": any(is_quantized(value) for value in states),
        "mismatched": mismatched,
        "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,  # graphs dynamo compiled in this cell
        # Graphs inductor compiled (not found in its cache): ranks with the same shards compile each once in all.
        "inductor_compiles": _inductor_compiles() - compiles_before,
        # Which state each parameter has on this rank: state kept whole on a matrix's owner is on one rank of those
        # that split it.
        "held": {name: sorted(optimizer_state(job.optimizers, p)) for name, p in job.model.named_parameters()},
    }


def _inductor_compiles() -> int:
    """Graphs inductor compiled in this process: not found in its cache, or not cacheable."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]


def optimizer_state(optimizers, p: torch.Tensor) -> dict:
    for optimizer in optimizers:
        if p in optimizer.state:
            return optimizer.state[p]
    return {}


def _laid_out_otherwise(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient came back with placements other than ``p``'s (TP alone: the embedding's
    replicated, the norms' partial), as the optimizer found it (optimizers that align it may replace it)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p.grad, DTensor) and p.grad.placements != p.placements


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().to(torch.float64)


def run_world(rank: int, world_size: int, base: str, tokens: str, labels: Optional[list[str]] = None) -> dict:
    """Every cell of this world size (and the resumed cells that run in it), row by row; on every rank. The
    cells preflight refused in the launching process run too: the build must refuse them alike."""
    results = {}
    for row in rows():
        if labels is not None and row.label not in labels:
            continue
        for column in COLUMNS:
            if COLUMNS[column][0] == world_size:
                results[(row.label, column)] = run_cell(row, column, base, tokens)
        for saved, resumed in RESUMES:
            if COLUMNS[resumed][0] != world_size:
                continue
            if not os.path.isdir(os.path.join(cell_folder(base, row, saved), "checkpoint")):
                results[(row.label, f"{resumed}<-{saved}")] = {"refused": f"nothing saved in {saved}"}
                continue
            results[(row.label, f"{resumed}<-{saved}")] = run_cell(row, resumed, base, tokens, resume_from=saved)
    for row, column in REFUSED:
        if COLUMNS[column][0] == world_size and (labels is None or row.label in labels):
            results[(row.label, column)] = run_cell(row, column, base, tokens)
    return results
