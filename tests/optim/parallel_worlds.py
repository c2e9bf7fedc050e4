"""Spawned gloo worlds (float64) shared by the distributed tests of Adam-mini, the Muon family and AdEMAMix.

A family's test module spawns each world size it needs (2, 4 or 6 ranks) once, running all of that family's layouts
in it (``tests/optim/conftest.py``: the module's ``FAMILY``), so that the families' files run on pytest-xdist workers of
their own, none waiting for another's world. A layout's failure is returned as its traceback, so that only that
layout's test fails. The tests themselves live with their family: ``test_adam_mini_distributed.py``,
``test_muon_distributed.py`` (Muon and NorMuon), ``test_ademamix_distributed.py``."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tests.distributed import run_workers
from tests.helpers import (
    HYPER,
    TINY,
    adam_mini_for,
    ademamix_for,
    fsdp,
    grad_from_values,
    muon_for,
    normuon_for,
    run_single_process,
    tiny_model,
    weights,
)
from torchtitan.models.llama import ModelArgs
from torchtitan.optim import AdamMini
from torchtitan.optim.adam_mini.optimizer import FUSED
from torchtitan.optim.adam_mini.partition import PER_ELEMENT, PER_ROW, PER_TENSOR
from torchtitan.optim.state.storage import BFLOAT16, INT8

STEPS = 5
SAVE_AT, RESUME_STEPS = 3, 3
MUON_STEPS = 3  # several steps, each bit for bit; kept short, Newton-Schulz in float64 being the slow part
# For 8-bit momentum, in blocks of 128: every matrix has at least 4096 entries and rows of whole blocks, and TP 2
# cuts the 256 columns of the row-parallel weights into parts of one block each, so every matrix's momentum is
# quantized in the same blocks in every layout.
INT8_OPTIONS = {"momentum_storage": INT8, "block_size": 128}
# Every optional partition rule at once (Adam-mini's first release, norms decayed too): per-element embedding and
# output, one block per value, attention output and MLP matrix (partial over every split of them).
OTHER_PARTITION = {
    "value_blocks": PER_TENSOR,
    "embedding_blocks": PER_ELEMENT,
    "output_blocks": PER_ELEMENT,
    "attn_out_blocks": PER_TENSOR,
    "mlp_blocks": PER_TENSOR,
    "norm_weight_decay": True,
}
# The layouts of every other partition rule and of bf16 momentum.
PARTITION_LAYOUTS = {2: ("fsdp", "tp"), 4: ("fsdp_tp", "hsdp")}
WIDE = ModelArgs(
    dim=256,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    multiple_of=256,
    ffn_dim_multiplier=0.375,
    max_seq_len=16,
)


# ------------------------------------------------------------------------------------------------------------
# Worker side (module level, so spawned ranks can import it)
# ------------------------------------------------------------------------------------------------------------


def tensor_parallel(model: torch.nn.Module, tp_mesh, embedding_plan=None) -> None:
    # Column-wise Q/K/V/W1/W3 and output (Shard(0)), row-wise O/W2 (Shard(1)), vocabulary-parallel embedding
    # (Shard(0)) unless told otherwise; norms stay plain tensors beside the DTensors.
    parallelize_module(
        model, tp_mesh, {"tok_embeddings": embedding_plan or RowwiseParallel(), "output": ColwiseParallel()}
    )
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, plan)


def _parallel_model(layout: str, world_size: int, args: ModelArgs = TINY) -> torch.nn.Module:
    model = tiny_model(args)
    if layout == "single":
        pass
    elif layout == "fsdp":
        fsdp(model, init_device_mesh("cpu", (world_size,)))
    elif layout == "tp":
        tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    elif layout == "fsdp_tp":
        # dp = world_size / 2: FSDP's strided shards of TP shards, uneven for the vocabulary (67 rows) and, with 3,
        # for heads. The embedding is split by columns (Shard(1)): its per-row sums are partial over TP.
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"], embedding_plan=ColwiseParallel())
        fsdp(model, mesh["dp"])
    elif layout == "hsdp":
        fsdp(model, init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    else:
        raise ValueError(layout)
    return model


def set_grads(model: torch.nn.Module, step: int) -> None:
    # Computed from each shard's own values: DTensor's slicing of a full tensor (distribute_tensor) does not always
    # match where FSDP2 put the rows of uneven strided shards.
    for name, p in model.named_parameters():
        p.grad = grad_from_values(name, p, step)


def train_muon(layout: str, world_size: int, steps: int, make: Callable = muon_for) -> dict[str, torch.Tensor]:
    model = _parallel_model(layout, world_size)
    optimizer = make(model)
    for step in range(steps):
        set_grads(model, step)
        optimizer.step()
    return weights(model)


# Fewer rows than ranks: FSDP2 gives the last rank an empty shard of every parameter (per_row, per_tensor and
# per_element blocks).
EMPTY_SHARD_ROLES = {"proj.weight": "mlp", "proj.bias": "bias", "norm.weight": "norm", "norm.bias": "bias"}


def train_with_empty_shards(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """The fused step on a one-row module; FSDP2-sharded over ``world_size`` ranks when more than one."""
    torch.manual_seed(0)
    module = torch.nn.Sequential()
    module.add_module("proj", torch.nn.Linear(8, 1))
    module.add_module("norm", torch.nn.LayerNorm(1))
    module.double()
    if world_size > 1:
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = AdamMini(
        module.named_parameters(), **HYPER, dim=8, n_heads=1, param_roles=EMPTY_SHARD_ROLES, implementation=FUSED
    )
    for step in range(steps):
        set_grads(module, step)
        optimizer.step()
    return weights(module)


def train(
    layout: str, world_size: int, steps: int, value_blocks: str = PER_ROW, args: ModelArgs = TINY, **options
) -> dict[str, torch.Tensor]:
    model = _parallel_model(layout, world_size, args)
    optimizer = adam_mini_for(model, value_blocks=value_blocks, **options)
    for step in range(steps):
        set_grads(model, step)
        optimizer.step()
    return weights(model)


def train_one_pass(layout: str, world_size: int, steps: int, graphs_only: bool = False, **options) -> dict[str, Any]:
    """``train`` with the fused back end, and the tensors each call of its one-pass operator stepped (none with
    ``graphs_only``: the compiled graphs alone)."""
    from torchtitan.optim.adam_mini import one_pass

    calls: list[int] = []
    operator = one_pass.adam_mini_step_

    def counted(params, *rest):
        calls.append(len(params))
        return operator(params, *rest)

    one_pass.adam_mini_step_ = counted
    try:
        with one_pass.compiled_graphs_only() if graphs_only else contextlib.nullcontext():
            trained = train(layout, world_size, steps, implementation=FUSED, **options)
    finally:
        one_pass.adam_mini_step_ = operator
    return {"weights": trained, "calls": calls}


class CollectiveSizes(CommDebugMode):
    """CommDebugMode that also records how many elements each collective sends."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator) and not any(t is DTensor for t in types):
            if func._overloadpacket in self.comm_registry:
                sent = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
                self.sizes.append((str(func._overloadpacket).rsplit(".", 1)[-1], sent))
            elif func._overloadpacket is torch.ops.c10d.alltoall_base_:  # (output, input, group, splits...)
                self.sizes.append(("alltoall_base_", args[1].numel()))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _collectives_of_one_step(layout: str, world_size: int, make: Callable = adam_mini_for, **options) -> dict[str, Any]:
    model = _parallel_model(layout, world_size)
    optimizer = make(model, **options)
    set_grads(model, 0)
    optimizer.step()  # builds the state
    set_grads(model, 1)
    with CollectiveSizes() as comm:
        optimizer.step()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return {"counts": counts, "sizes": comm.sizes, "smallest_param": min(p.numel() for p in model.parameters())}


def _save_checkpoint(world_size: int, path: str, make: Callable = adam_mini_for) -> dict[str, torch.Tensor]:
    model = _parallel_model("fsdp", world_size)
    optimizer = make(model)
    for step in range(SAVE_AT):
        set_grads(model, step)
        optimizer.step()
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path
    )
    return weights(model)


def resume(model: torch.nn.Module, path: str, make: Callable = adam_mini_for) -> dict[str, torch.Tensor]:
    """Load the checkpoint at ``path`` into a fresh optimizer on ``model`` and continue RESUME_STEPS steps."""
    optimizer = make(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    for step in range(SAVE_AT, SAVE_AT + RESUME_STEPS):
        set_grads(model, step)
        optimizer.step()
    return weights(model)


def attempt(fn: Callable, *args) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception:  # noqa: BLE001 - returned to the parent, which fails only this layout's test
        return False, traceback.format_exc()


def muon_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, "muon")


def _muon_runs(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """The Muon family (Muon and NorMuon) where the layout matrix does not reach: each step's collectives (the owner
    rounds) under FSDP and FSDP x TP, a Muon checkpoint saved on 2 ranks, NorMuon with the paper's step size."""
    runs: dict[str, tuple[bool, Any]] = {}
    layout = {2: "fsdp", 4: "fsdp_tp"}.get(world_size)
    if layout is not None:
        runs[f"muon_comm_{layout}"] = attempt(_collectives_of_one_step, layout, world_size, muon_for)
        runs[f"normuon_comm_{layout}"] = attempt(_collectives_of_one_step, layout, world_size, normuon_for)
    if world_size == 2:
        runs["muon_save"] = attempt(_save_checkpoint, world_size, muon_path(checkpoint_dir), muon_for)
    for layout in {2: ("fsdp", "tp"), 4: ("fsdp_tp",)}.get(world_size, ()):
        runs[f"normuon_rms_{layout}"] = attempt(train_muon, layout, world_size, MUON_STEPS, normuon_rms_for)
    return runs


def _ademamix_runs(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """AdEMAMix (element-wise: each shard steps on its own) under FSDP2 and TP on 2 ranks, and its collectives under
    FSDP."""
    if world_size != 2:
        return {}
    runs = {
        f"ademamix_{layout}": attempt(train_muon, layout, world_size, STEPS, ademamix_for) for layout in ("fsdp", "tp")
    }
    runs["ademamix_comm_fsdp"] = attempt(_collectives_of_one_step, "fsdp", world_size, ademamix_for)
    return runs


def normuon_rms_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """NorMuon with the paper's step size (the global shape's sqrt(rows cols), whatever the shard)."""
    return normuon_for(model, "--optimizer.normuon_step_size", "rms")


def _adam_mini_runs(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """What the layout matrix (tests/optim/test_layout_matrix.py) does not run: the optional partition rules, the
    collectives of a step, the one-pass operator's calls, bf16 and 8-bit momentum held exact, empty shards, FSDP x TP
    on 3 x 2 and a resume on one rank."""
    runs: dict[str, tuple[bool, Any]] = {}
    if world_size == 2:
        runs["save"] = attempt(_save_checkpoint, world_size, checkpoint_dir)
        runs["comm_fsdp"] = attempt(_collectives_of_one_step, "fsdp", world_size)
        runs["comm_tp"] = attempt(_collectives_of_one_step, "tp", world_size)
        runs["comm_fsdp_fused"] = attempt(lambda: _collectives_of_one_step("fsdp", world_size, implementation=FUSED))
        runs["empty_shards"] = attempt(train_with_empty_shards, world_size, STEPS)
    if world_size == 4:
        runs["comm_fsdp_tp"] = attempt(_collectives_of_one_step, "fsdp_tp", world_size)
        for layout in ("hsdp", "fsdp_tp"):
            runs[f"{layout}_{INT8}"] = attempt(
                functools.partial(train, layout, world_size, STEPS, args=WIDE, **INT8_OPTIONS)
            )
        runs["fsdp_tp_fused_graphs"] = attempt(train_one_pass, "fsdp_tp", world_size, STEPS, True)
    if world_size == 6:
        runs["fsdp_tp"] = attempt(train, "fsdp_tp", world_size, STEPS)
    for layout in PARTITION_LAYOUTS.get(world_size, ()):
        runs[f"{layout}_other_partition"] = attempt(
            functools.partial(train, layout, world_size, STEPS, **OTHER_PARTITION)
        )
        runs[f"{layout}_{BFLOAT16}"] = attempt(
            functools.partial(train, layout, world_size, STEPS, momentum_storage=BFLOAT16)
        )
    for layout, options in ONE_PASS_RUNS.get(world_size, ()):
        runs[f"{layout}_one_pass{'_other_partition' if options else ''}"] = attempt(
            functools.partial(train_one_pass, layout, world_size, STEPS, **options)
        )
    return runs


# The fused back end's one-pass operator: one call a step for every tensor, in the layouts above, with every other
# partition rule (the default rules' fused step in every layout is the layout matrix's). Under FSDP x TP on 4 ranks
# the compiled graphs alone run once more, kept in step.
ONE_PASS_RUNS = {
    2: (("fsdp", OTHER_PARTITION), ("tp", OTHER_PARTITION)),
    4: (("hsdp", OTHER_PARTITION), ("fsdp_tp", OTHER_PARTITION)),
    6: (("fsdp_tp", {}),),
}


FAMILIES = {"adam_mini": _adam_mini_runs, "muon": _muon_runs, "ademamix": _ademamix_runs}


def _world_runs(rank: int, world_size: int, family: str, checkpoint_dir: str) -> bytes:
    runs = FAMILIES[family](rank, world_size, checkpoint_dir)
    # Rank 0's results stand for all: every rank gathered the same full tensors.
    if rank != 0:
        runs = {name: (ok, None if ok else value) for name, (ok, value) in runs.items()}
    # As bytes: tensors sent through the queue would share memory with a process that has exited.
    buffer = io.BytesIO()
    torch.save(runs, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------------------


def spawn(world_size: int, family: str, checkpoint_dir: str | None) -> list[dict[str, Any]]:
    """One world of ``world_size`` ranks running ``family``'s layouts (a key of ``FAMILIES``)."""
    packed = run_workers(_world_runs, world_size, (family, checkpoint_dir))
    return [torch.load(io.BytesIO(data), weights_only=False) for data in packed]


def result(world: list[dict[str, Any]], name: str) -> Any:
    for rank, runs in enumerate(world):
        ok, value = runs[name]
        if not ok:
            pytest.fail(f"{name} failed on rank {rank}:\n{value}")
    return world[0][name][1]


def block_sums_per_step() -> int:
    """Entries of the per-head and per-tensor sums of squares of the tiny model (what an FSDP step sums)."""
    heads = TINY.n_layers * (TINY.n_heads + TINY.kv_heads)
    norms = 2 * TINY.n_layers + 1
    return heads + norms


def hidden_matrices() -> list[torch.Tensor]:
    from torchtitan.optim.muon.optimizer import split_hidden_matrices

    model = tiny_model()
    return [p for _, p in split_hidden_matrices(model.named_parameters(), model.named_param_roles())[0]]


def one_process_runs(family: str) -> dict[str, Any]:
    """The one-process references ``family``'s parallel runs are compared with."""
    if family == "adam_mini":
        return {
            PER_ROW: run_single_process(STEPS, PER_ROW, grads_from_values=True),
            "uninterrupted": run_single_process(SAVE_AT + RESUME_STEPS, grads_from_values=True),
            BFLOAT16: run_single_process(STEPS, grads_from_values=True, momentum_storage=BFLOAT16),
            "wide": train("single", 1, STEPS, args=WIDE),
            f"wide_{INT8}": train("single", 1, STEPS, args=WIDE, **INT8_OPTIONS),
            "other_partition": train("single", 1, STEPS, **OTHER_PARTITION),
        }
    if family == "muon":
        return {
            "muon_uninterrupted": train_muon("single", 1, SAVE_AT + RESUME_STEPS),
            "normuon": train_muon("single", 1, MUON_STEPS, normuon_for),
            "normuon_rms": train_muon("single", 1, MUON_STEPS, normuon_rms_for),
        }
    return {"ademamix": train_muon("single", 1, STEPS, ademamix_for)}
