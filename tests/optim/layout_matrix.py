"""The optimizer x layout matrix's cells, run the way train.py runs a job (tests/optim/test_layout_matrix.py asserts).

A cell is one row (an optimizer as ``[optimizer]`` options: every name in the registry, and the state options that
change its code path) in one column (a layout as ``[training]`` degrees). It is built as train.py builds a run:
``ParallelDims.from_job_config``, the mesh, ``build_model`` (the trainer's TP plan, activation
checkpointing, compile, FSDP2/HSDP/DDP), ``init_model``, ``build_optimizers`` and its container,
``OptimizerHealth`` on at every step, a ``CheckpointManager``; each step is ``train_step`` (forward with
the trainer's chunked loss, backward, clipping, the optimizer step) on this rank's share of a fixed global batch.

Every launch of a world size runs all of that size's cells in one process group (processes are the slow part), one
after another; rows are derived from the registry, so a new optimizer joins with no edit here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from torchtitan.models.llama import ModelArgs
from torchtitan.optim.builder import OPTIMIZERS
from torchtitan.optim.settings import (
    BF16_STOCHASTIC_ROUND,
    BLOCK_SIZE,
    IMPLEMENTATION,
    NS_DTYPE,
    STATE_DTYPE,
    VALUE_BLOCKS,
)

# Llama shaped so that every rule has something to bite on: GQA heads that TP 2 splits, sizes FSDP 3 splits
# unevenly (67 vocabulary rows, 32 key rows), and weights of at least 4096 values whose last dimension is a whole
# number of 32-value blocks, also when TP 2 halves it (so the low-bit rows, with block_size 32, really quantize).
MATRIX_MODEL = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=67, multiple_of=64, max_seq_len=8)
SEQ_LEN = 8
GLOBAL_BATCH = 12  # divisible by every data-parallel degree below (1, 2, 3, 4)
STEPS, SAVE_AT = 3, 2  # a checkpoint at step 2; resumed cells run step 3 from it
SEED = 0
LR = "0.01"
LOW_BIT_BLOCK = "32"


# Optimizers whose trajectory is not determined by the gradients alone, and why; their cells are held to what can be
# checked (finite losses close to one process's, every health metric present, state kept on one rank of those that
# split a matrix), their exactness to tests on a well-conditioned problem.
NOT_DETERMINED = {
    "SOAP": "its first eigenbases are those of statistics of rank at most the gradient's: a 32 x 64 matrix's 64 x 64 "
    "right statistic has rank 32 at step 1, and the basis of its null space is whatever eigh makes of 1e-16 "
    "differences in summation order (exact equality on full-rank statistics: tests/optim/test_soap_distributed.py)",
}


@dataclass(frozen=True)
class Row:
    """An optimizer as the job's ``[optimizer]`` options."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return "-".join([self.name, *(f"{k}={v}" for k, v in self.options)])

    @property
    def determined(self) -> bool:
        """Whether its trajectory is determined by the gradients; see ``NOT_DETERMINED``."""
        return self.name not in NOT_DETERMINED

    def argv(self) -> list[str]:
        argv = ["--optimizer.name", self.name, "--optimizer.lr", LR]
        kind = OPTIMIZERS[self.name]
        if BLOCK_SIZE in kind.options:  # quantized blocks the small model's weights are whole multiples of
            argv += ["--optimizer.block_size", LOW_BIT_BLOCK]
        if NS_DTYPE in kind.options:  # Newton-Schulz in the test's float64 (bfloat16 by default)
            argv += ["--optimizer.ns_dtype", "float64"]
        for key, value in self.options:
            argv += [f"--optimizer.{key}", value]
        return argv

    @property
    def param_dtype(self) -> str:
        """float64, the reference precision; float32 for torchao's low-bit AdamW (the optimizers that take
        ``bf16_stochastic_round``): its step does its math in its float32 state, and DTensor's checks refuse a float64
        weight beside it, which no real run has."""
        return "float32" if BF16_STOCHASTIC_ROUND in OPTIMIZERS[self.name].options else "float64"

    @property
    def rounds_state(self) -> bool:
        """Its state is stored rounded (bfloat16, 8-/4-bit, fp8): see the test's tolerance."""
        kind = OPTIMIZERS[self.name]
        return BLOCK_SIZE in kind.options or dict(self.options).get(STATE_DTYPE) == "bfloat16"


def rows() -> list[Row]:
    """Every registered optimizer, then the state options that take another code path: bfloat16 state wherever
    ``state_dtype`` is taken, and the fused back end wherever ``implementation`` picks between Adam-mini's own."""
    result = [Row(name) for name in OPTIMIZERS]
    for name, kind in OPTIMIZERS.items():
        if STATE_DTYPE in kind.options:
            result.append(Row(name, ((STATE_DTYPE, "bfloat16"),)))
    for name, kind in OPTIMIZERS.items():
        if IMPLEMENTATION in kind.options and VALUE_BLOCKS in kind.options and STATE_DTYPE in kind.options:
            result.append(Row(name, ((IMPLEMENTATION, "fused"),)))
    return result


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
# Cells a layout rules out, with words of their refusal; each runs until it is refused (before any step). Quantized
# blocks of 64 values are the model's whole rows, which TP 2 halves in the row-wise split weights (attention output,
# feed-forward down projection): torchao's 8-bit AdamW and Adam-mini's 8-bit momentum refuse alike.
REFUSED: dict[tuple[Row, str], str] = {
    (Row(name, ((BLOCK_SIZE, "64"),)), "tp2"): "in blocks of 64 along its last dimension, which the layout splits "
    "into parts of up to 32"
    for name in ("AdamW8bit", "AdamMini8bit")
}


def job_argv(row: Row, column: str, folder: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "--training.param_dtype",
        row.param_dtype,
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.steps",
        str(STEPS),
        "--training.max_norm",
        "1.0",
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


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, MATRIX_MODEL.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def cell_folder(base: str, row: Row, column: str) -> str:
    return os.path.join(base, row.label, column)


def run_cell(row: Row, column: str, base: str, resume_from: Optional[str] = None, extra: tuple[str, ...] = ()) -> dict:
    """Train one cell ``STEPS`` steps (saving at ``SAVE_AT``), or, with ``resume_from`` (a column), load that
    column's step-``SAVE_AT`` checkpoint and train the rest. Returns what every rank saw, or the one-line refusal."""
    from torchtitan.checkpoint import CheckpointManager
    from torchtitan.config.job_config import JobConfig
    from torchtitan.errors import UserError
    from torchtitan.optim import build_optimizers
    from torchtitan.optim.state.storage import is_quantized
    from torchtitan.parallelisms import ParallelDims
    from torchtitan.telemetry.health import OptimizerHealth
    from torchtitan.training.step import TrainState, build_model, init_model, train_step

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    folder = cell_folder(base, row, resume_from if resume_from is not None else column)
    job = JobConfig.parse_args(job_argv(row, column, folder, extra))
    dims = ParallelDims.from_job_config(job, world_size)
    mesh = dims.build_mesh("cpu") if dims.any_parallelism else None
    device = torch.device("cpu")
    model = init_model(build_model(job, MATRIX_MODEL, dims, mesh), device, SEED)
    try:
        optimizers = build_optimizers([model], job)
        optimizers.initialise_state()  # as train.py: where a layout rules the state out, it is refused here
    except UserError as e:
        return {"refused": str(e)}
    health = OptimizerHealth.build([model], job, device)
    train_state = TrainState()
    checkpoint = CheckpointManager(
        data_loader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={"train_state": train_state},
        job_config=job,
    )
    if resume_from is not None:
        assert checkpoint.load(step=SAVE_AT), f"no checkpoint of {row.label} at step {SAVE_AT} in {folder}"
        assert train_state.step == SAVE_AT
    dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
    dp_group = dims.dp_mesh(mesh).get_group() if dims.dp_enabled else None
    share = GLOBAL_BATCH // dp_degree
    losses, healths, mismatched = {}, {}, []
    while train_state.step < STEPS:
        train_state.step += 1
        step = train_state.step
        inputs, labels = global_batch(step)
        rows_here = slice(dp_rank * share, (dp_rank + 1) * share)
        batches = iter([(inputs[rows_here], labels[rows_here])])
        loss, _, updated = train_step(model, optimizers, batches, dims, job, device, None, step, health)
        assert updated
        if step == 1:
            mismatched = sorted(name for name, p in model.named_parameters() if _laid_out_otherwise(p))
        total = loss.detach().reshape(1).clone()
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        losses[step] = total.item() / dp_degree
        healths[step] = health.metrics(float(LR))
        if resume_from is None and any(column == saved for saved, _ in RESUMES):
            checkpoint.save(step, force=step == SAVE_AT)
    checkpoint.close()
    states = [value for optimizer in optimizers for state in optimizer.state.values() for value in state.values()]
    quantized = any(is_quantized(value) for value in states)
    return {
        "losses": losses,
        "health": healths,
        "weights": {name: _whole(p).numpy().copy() for name, p in model.named_parameters()},
        "quantized": quantized,
        "mismatched": mismatched,
        # Which state each parameter has on this rank: state kept whole on a matrix's owner is on one rank of those
        # that split it.
        "held": {name: sorted(optimizer_state(optimizers, p)) for name, p in model.named_parameters()},
    }


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


def run_world(rank: int, world_size: int, base: str, labels: Optional[list[str]] = None) -> dict:
    """Every cell of this world size (and the resumed cells that run in it), row by row; on every rank."""
    results = {}
    for row in rows():
        if labels is not None and row.label not in labels:
            continue
        for column, (size, _) in COLUMNS.items():
            if size == world_size:
                results[(row.label, column)] = run_cell(row, column, base)
        for saved, resumed in RESUMES:
            if COLUMNS[resumed][0] != world_size:
                continue
            if not os.path.isdir(os.path.join(cell_folder(base, row, saved), "checkpoint")):
                results[(row.label, f"{resumed}<-{saved}")] = {"refused": f"nothing saved in {saved}"}
                continue
            results[(row.label, f"{resumed}<-{saved}")] = run_cell(row, resumed, base, resume_from=saved)
    for row, column in REFUSED:
        if COLUMNS[column][0] == world_size and (labels is None or row.label in labels):
            results[(row.label, column)] = run_cell(row, column, base)
    return results
