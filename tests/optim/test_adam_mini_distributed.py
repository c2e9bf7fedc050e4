"""Adam-mini across processes (gloo, float64): FSDP2 on 2, 3 and 4 ranks (uneven shards, KV heads not divisible by
the rank count), tensor parallel, FSDP x TP and HSDP on 2 x 2 all equal the one-process run (with every optional
partition rule too, with bf16 momentum too, and with 8-bit momentum under HSDP and FSDP x TP, up to its blocks'
rounding); an FSDP step sends only per-block sums (one all-reduce, no all-gather); a DCP checkpoint saved on 2
ranks resumes exactly on 1 and 3.

Muon and NorMuon ride the same launches: FSDP2 on 2 and 3 ranks, TP, FSDP x TP (2 x 2, 3 x 2) and HSDP equal one
process (float64 Newton–Schulz); a step's collectives are the owner rounds of ``muon_distributed`` (counted, with the
entries sent), plus NorMuon's all-reduces of row sums and norms; Muon's checkpoint saved on 2 ranks resumes exactly on
1 and 3. So does AdEMAMix: on 2 and 3 ranks (FSDP2), TP, FSDP x TP and HSDP it equals one process, and its step
communicates nothing.

Each world size is spawned once (module fixtures) and runs several layouts; a layout's failure is returned as its
traceback so that only that layout's test fails."""

from __future__ import annotations

import functools
import io
import math
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
    max_difference,
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
# The fused back end and bfloat16 momentum, each checked like the default (foreach, float64 momentum).
VARIANTS = {"fused": ("implementation", FUSED), "bfloat16": ("momentum_storage", BFLOAT16)}
SAVE_AT, RESUME_STEPS = 3, 3
MUON_STEPS = 3  # several steps, each bit for bit; Muon's runs share the launches, so they are kept short
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
PARTITION_LAYOUTS = {2: ("fsdp", "tp"), 3: ("fsdp",), 4: ("fsdp_tp", "hsdp")}
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
pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------------------------------------------------
# Worker side (module level, so spawned ranks can import it)
# ------------------------------------------------------------------------------------------------------------


def _tensor_parallel(model: torch.nn.Module, tp_mesh, embedding_plan=None) -> None:
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
        _tensor_parallel(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    elif layout == "fsdp_tp":
        # dp = world_size / 2: FSDP's strided shards of TP shards, uneven for the vocabulary (67 rows) and, with 3,
        # for heads. The embedding is split by columns (Shard(1)): its per-row sums are partial over TP.
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        _tensor_parallel(model, mesh["tp"], embedding_plan=ColwiseParallel())
        fsdp(model, mesh["dp"])
    elif layout == "hsdp":
        fsdp(model, init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    else:
        raise ValueError(layout)
    return model


def _set_grads(model: torch.nn.Module, step: int) -> None:
    # Computed from each shard's own values: DTensor's slicing of a full tensor (distribute_tensor) does not always
    # match where FSDP2 put the rows of uneven strided shards.
    for name, p in model.named_parameters():
        p.grad = grad_from_values(name, p, step)


def _batch(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a fixed global batch of 6 sequences (all of it in one process)."""
    tokens = torch.randint(0, TINY.vocab_size, (6, 9), generator=torch.Generator().manual_seed(5))
    share = tokens.shape[0] // world_size
    tokens = tokens[rank * share : (rank + 1) * share]
    return tokens[:, :-1], tokens[:, 1:]


def _train_on_loss(model: torch.nn.Module, rank: int, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Real forward and backward (FSDP2 reduce-scatters the gradients), then AdamMini steps."""
    optimizer = adam_mini_for(model)
    inputs, labels = _batch(rank, world_size)
    for _ in range(steps):
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def _train_muon(layout: str, world_size: int, steps: int, make: Callable = muon_for) -> dict[str, torch.Tensor]:
    model = _parallel_model(layout, world_size)
    optimizer = make(model)
    for step in range(steps):
        _set_grads(model, step)
        optimizer.step()
    return weights(model)


# Fewer rows than 3 ranks: FSDP2 gives the last rank an empty shard of every parameter (per_row, per_tensor and
# per_element blocks).
EMPTY_SHARD_ROLES = {"proj.weight": "mlp", "proj.bias": "bias", "norm.weight": "norm", "norm.bias": "bias"}


def _train_with_empty_shards(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """The fused step on a two-row module; FSDP2-sharded over ``world_size`` ranks when more than one."""
    torch.manual_seed(0)
    module = torch.nn.Sequential()
    module.add_module("proj", torch.nn.Linear(8, 2))
    module.add_module("norm", torch.nn.LayerNorm(2))
    module.double()
    if world_size > 1:
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = AdamMini(
        module.named_parameters(), **HYPER, dim=8, n_heads=1, param_roles=EMPTY_SHARD_ROLES, implementation=FUSED
    )
    for step in range(steps):
        _set_grads(module, step)
        optimizer.step()
    return weights(module)


def _train(
    layout: str, world_size: int, steps: int, value_blocks: str = PER_ROW, args: ModelArgs = TINY, **options
) -> dict[str, torch.Tensor]:
    model = _parallel_model(layout, world_size, args)
    optimizer = adam_mini_for(model, value_blocks=value_blocks, **options)
    for step in range(steps):
        _set_grads(model, step)
        optimizer.step()
    return weights(model)


class _CollectiveSizes(CommDebugMode):
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
    _set_grads(model, 0)
    optimizer.step()  # builds the state
    _set_grads(model, 1)
    with _CollectiveSizes() as comm:
        optimizer.step()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}
    return {"counts": counts, "sizes": comm.sizes, "smallest_param": min(p.numel() for p in model.parameters())}


def _save_checkpoint(world_size: int, path: str, make: Callable = adam_mini_for) -> dict[str, torch.Tensor]:
    model = _parallel_model("fsdp", world_size)
    optimizer = make(model)
    for step in range(SAVE_AT):
        _set_grads(model, step)
        optimizer.step()
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path
    )
    return weights(model)


def _resume(model: torch.nn.Module, path: str, make: Callable = adam_mini_for) -> dict[str, torch.Tensor]:
    """Load the checkpoint at ``path`` into a fresh optimizer on ``model`` and continue RESUME_STEPS steps."""
    optimizer = make(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    for step in range(SAVE_AT, SAVE_AT + RESUME_STEPS):
        _set_grads(model, step)
        optimizer.step()
    return weights(model)


def _attempt(fn: Callable, *args) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception:  # noqa: BLE001 - returned to the parent, which fails only this layout's test
        return False, traceback.format_exc()


def _muon_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, "muon")


def _muon_runs(rank: int, world_size: int, checkpoint_dir: str, resume_dir: str | None) -> dict[str, Any]:
    runs: dict[str, tuple[bool, Any]] = {}
    if world_size in (2, 3):
        runs["muon_fsdp"] = _attempt(_train_muon, "fsdp", world_size, MUON_STEPS)
    if world_size == 2:
        runs["muon_tp"] = _attempt(_train_muon, "tp", world_size, MUON_STEPS)
        runs["muon_comm_fsdp"] = _attempt(_collectives_of_one_step, "fsdp", world_size, muon_for)
        runs["muon_save"] = _attempt(_save_checkpoint, world_size, _muon_path(checkpoint_dir), muon_for)
    if world_size == 3:
        runs["muon_resume"] = _attempt(
            lambda: _resume(_parallel_model("fsdp", world_size), _muon_path(resume_dir), muon_for)
        )
    if world_size in (4, 6):  # 6: 3 x 2, the TP shards of key/value weights cut unevenly by FSDP
        runs["muon_fsdp_tp"] = _attempt(_train_muon, "fsdp_tp", world_size, MUON_STEPS)
    if world_size == 4:
        runs["muon_hsdp"] = _attempt(_train_muon, "hsdp", world_size, MUON_STEPS)
        runs["muon_comm_fsdp_tp"] = _attempt(_collectives_of_one_step, "fsdp_tp", world_size, muon_for)
    runs.update(_normuon_runs(world_size))
    runs.update(_ademamix_runs(world_size))
    return runs


def _ademamix_runs(world_size: int) -> dict[str, Any]:
    """AdEMAMix (element-wise: each shard steps on its own) in Muon's layouts, and its collectives under FSDP."""
    layouts = {2: ("fsdp", "tp"), 3: ("fsdp",), 4: ("fsdp_tp", "hsdp")}.get(world_size, ())
    runs = {f"ademamix_{layout}": _attempt(_train_muon, layout, world_size, STEPS, ademamix_for) for layout in layouts}
    if world_size == 2:
        runs["ademamix_comm_fsdp"] = _attempt(_collectives_of_one_step, "fsdp", world_size, ademamix_for)
    return runs


def _normuon_runs(world_size: int) -> dict[str, Any]:
    """NorMuon in the layouts Muon runs in, and its collectives under FSDP and FSDP x TP."""
    layouts = {2: ("fsdp", "tp"), 3: ("fsdp",), 4: ("fsdp_tp", "hsdp"), 6: ("fsdp_tp",)}.get(world_size, ())
    runs = {
        f"normuon_{layout}": _attempt(_train_muon, layout, world_size, MUON_STEPS, normuon_for) for layout in layouts
    }
    if world_size in (2, 4):
        layout = "fsdp" if world_size == 2 else "fsdp_tp"
        runs[f"normuon_comm_{layout}"] = _attempt(_collectives_of_one_step, layout, world_size, normuon_for)
    for layout in {2: ("fsdp", "tp"), 4: ("fsdp_tp",)}.get(world_size, ()):
        runs[f"normuon_rms_{layout}"] = _attempt(_train_muon, layout, world_size, MUON_STEPS, _normuon_rms_for)
    return runs


def _normuon_rms_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """NorMuon with the paper's step size (the global shape's sqrt(rows cols), whatever the shard)."""
    return normuon_for(model, "--optimizer.normuon_step_size", "rms")


def _world_runs(rank: int, world_size: int, checkpoint_dir: str, resume_dir: str | None) -> dict[str, Any]:
    runs: dict[str, tuple[bool, Any]] = {"fsdp": _attempt(_train, "fsdp", world_size, STEPS)}
    if world_size == 2:
        runs["tp"] = _attempt(_train, "tp", world_size, STEPS)
        runs["fsdp_loss"] = _attempt(lambda: _train_on_loss(_parallel_model("fsdp", world_size), rank, world_size, 3))
        runs["save"] = _attempt(_save_checkpoint, world_size, checkpoint_dir)
        runs["comm_fsdp"] = _attempt(_collectives_of_one_step, "fsdp", world_size)
        runs["comm_tp"] = _attempt(_collectives_of_one_step, "tp", world_size)
        for option, value in VARIANTS.values():
            runs[f"fsdp_{value}"] = _attempt(functools.partial(_train, "fsdp", world_size, STEPS, **{option: value}))
            runs[f"tp_{value}"] = _attempt(functools.partial(_train, "tp", world_size, STEPS, **{option: value}))
        runs["comm_fsdp_fused"] = _attempt(lambda: _collectives_of_one_step("fsdp", world_size, implementation=FUSED))
    if world_size == 3:
        runs["fsdp_per_tensor_values"] = _attempt(_train, "fsdp", world_size, STEPS, PER_TENSOR)
        runs["comm_fsdp"] = _attempt(_collectives_of_one_step, "fsdp", world_size)
        runs["resume"] = _attempt(lambda: _resume(_parallel_model("fsdp", world_size), resume_dir))
        runs["empty_shards"] = _attempt(_train_with_empty_shards, world_size, STEPS)
        for option, value in VARIANTS.values():
            runs[f"fsdp_{value}"] = _attempt(functools.partial(_train, "fsdp", world_size, STEPS, **{option: value}))
    if world_size == 4:
        runs["fsdp_tp"] = _attempt(_train, "fsdp_tp", world_size, STEPS)
        runs["hsdp"] = _attempt(_train, "hsdp", world_size, STEPS)
        runs["comm_fsdp_tp"] = _attempt(_collectives_of_one_step, "fsdp_tp", world_size)
        runs["fsdp_tp_fused"] = _attempt(lambda: _train("fsdp_tp", world_size, STEPS, implementation=FUSED))
        for layout in ("hsdp", "fsdp_tp"):
            runs[f"{layout}_{BFLOAT16}"] = _attempt(
                functools.partial(_train, layout, world_size, STEPS, momentum_storage=BFLOAT16)
            )
            runs[f"{layout}_{INT8}"] = _attempt(
                functools.partial(_train, layout, world_size, STEPS, args=WIDE, **INT8_OPTIONS)
            )
    for layout in PARTITION_LAYOUTS.get(world_size, ()):
        runs[f"{layout}_other_partition"] = _attempt(
            functools.partial(_train, layout, world_size, STEPS, **OTHER_PARTITION)
        )
    runs.update(_muon_runs(rank, world_size, checkpoint_dir, resume_dir))
    if world_size == 6:
        runs.pop("fsdp")
        runs["fsdp_tp"] = _attempt(_train, "fsdp_tp", world_size, STEPS)
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


def _spawn(world_size: int, checkpoint_dir: str | None, resume_dir: str | None) -> list[dict[str, Any]]:
    packed = run_workers(_world_runs, world_size, (checkpoint_dir, resume_dir))
    return [torch.load(io.BytesIO(data), weights_only=False) for data in packed]


def _result(world: list[dict[str, Any]], name: str) -> Any:
    for rank, runs in enumerate(world):
        ok, value = runs[name]
        if not ok:
            pytest.fail(f"{name} failed on rank {rank}:\n{value}")
    return world[0][name][1]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("adam_mini_dcp"))


@pytest.fixture(scope="module")
def world2(checkpoint_dir):
    return _spawn(2, checkpoint_dir, None)


@pytest.fixture(scope="module")
def world3(world2, checkpoint_dir):  # needs the checkpoint world2 saved
    return _spawn(3, None, checkpoint_dir)


@pytest.fixture(scope="module")
def world4():
    return _spawn(4, None, None)


@pytest.fixture(scope="module")
def world6():
    return _spawn(6, None, None)


@pytest.fixture(scope="module")
def single_process():
    return {
        PER_ROW: run_single_process(STEPS, PER_ROW, grads_from_values=True),
        PER_TENSOR: run_single_process(STEPS, PER_TENSOR, grads_from_values=True),
        "uninterrupted": run_single_process(SAVE_AT + RESUME_STEPS, grads_from_values=True),
        **{
            value: run_single_process(STEPS, grads_from_values=True, **{option: value})
            for option, value in VARIANTS.values()
        },
        "wide": _train("single", 1, STEPS, args=WIDE),
        f"wide_{INT8}": _train("single", 1, STEPS, args=WIDE, **INT8_OPTIONS),
        "muon": _train_muon("single", 1, MUON_STEPS),
        "muon_uninterrupted": _train_muon("single", 1, SAVE_AT + RESUME_STEPS),
        "normuon": _train_muon("single", 1, MUON_STEPS, normuon_for),
        "normuon_rms": _train_muon("single", 1, MUON_STEPS, _normuon_rms_for),
        "ademamix": _train_muon("single", 1, STEPS, ademamix_for),
        "other_partition": _train("single", 1, STEPS, **OTHER_PARTITION),
    }


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world3", "fsdp"),
        ("world4", "fsdp"),  # 2 KV heads over 3 and 4 ranks
        ("world2", "tp"),
        ("world4", "fsdp_tp"),
        ("world4", "hsdp"),
        ("world6", "fsdp_tp"),  # 3 x 2: heads of the TP shards cut unevenly by FSDP
    ],
)
def test_parallel_run_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), layout)
    assert max_difference(params, single_process[PER_ROW]) < 1e-10


def test_fsdp_with_whole_tensor_value_blocks_equals_single_process(world3, single_process):
    assert max_difference(_result(world3, "fsdp_per_tensor_values"), single_process[PER_TENSOR]) < 1e-10


@pytest.mark.parametrize(
    "world_name, layout",
    [("world2", "fsdp"), ("world3", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp"), ("world4", "hsdp")],
)
def test_every_other_partition_rule_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), f"{layout}_other_partition")
    assert max_difference(params, single_process["other_partition"]) < 1e-10
    assert max_difference(single_process["other_partition"], single_process[PER_ROW]) > 1e-4  # the rules mattered


def _block_sums_per_step() -> int:
    """Entries of the per-head and per-tensor sums of squares of the tiny model (what an FSDP step sums)."""
    heads = TINY.n_layers * (TINY.n_heads + TINY.kv_heads)
    norms = 2 * TINY.n_layers + 1
    return heads + norms


def test_fsdp_training_on_a_real_loss_equals_single_process(world2):
    expected = _train_on_loss(tiny_model(), 0, 1, 3)
    assert max_difference(_result(world2, "fsdp_loss"), expected) < 1e-10


@pytest.mark.parametrize("world_name", ["world2", "world3"])
def test_fsdp_step_sends_only_block_sums(request, world_name):
    comm = _result(request.getfixturevalue(world_name), "comm_fsdp")
    print(f"{world_name} FSDP step collectives: {comm['counts']}, elements sent: {comm['sizes']}")
    assert comm["counts"] == {"all_reduce": 1}
    assert comm["sizes"] == [("all_reduce", _block_sums_per_step())]
    assert max(size for _, size in comm["sizes"]) < comm["smallest_param"]


def test_tp_and_fsdp_tp_steps_send_no_parameter_sized_tensor(world2, world4):
    for name, comm in (("TP 2", _result(world2, "comm_tp")), ("FSDP x TP 2x2", _result(world4, "comm_fsdp_tp"))):
        print(f"{name} step collectives: {comm['counts']}, elements sent: {comm['sizes']}")
        assert "all_gather_into_tensor" not in comm["counts"]
        # Per-row and per-block statistics only: never more than one entry per row of every matrix.
        all_rows = sum(p.shape[0] for p in tiny_model().parameters() if p.dim() == 2)
        assert sum(size for _, size in comm["sizes"]) <= all_rows + _block_sums_per_step()


def test_checkpoint_from_2_ranks_resumes_exactly_on_1_rank(world2, checkpoint_dir, single_process):
    _result(world2, "save")
    resumed = _resume(tiny_model(seed=7), checkpoint_dir)
    assert max_difference(resumed, single_process["uninterrupted"]) < 1e-10


def test_checkpoint_from_2_ranks_resumes_exactly_on_3_ranks(world3, single_process):
    assert max_difference(_result(world3, "resume"), single_process["uninterrupted"]) < 1e-10


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world3", "fsdp"),
        ("world2", "tp"),
    ],
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_and_bfloat16_momentum_parallel_runs_equal_single_process(
    request, single_process, world_name, layout, variant
):
    params = _result(request.getfixturevalue(world_name), f"{layout}_{variant}")
    assert max_difference(params, single_process[variant]) < 1e-10


def test_fused_step_with_empty_local_shards_equals_single_process(world3):
    # The last of 3 ranks holds no row of any parameter, yet takes part in the block sums' all-reduce.
    assert max_difference(_result(world3, "empty_shards"), _train_with_empty_shards(1, STEPS)) < 1e-10


def test_fused_fsdp_tp_equals_single_process(world4, single_process):
    assert max_difference(_result(world4, "fsdp_tp_fused"), single_process["fused"]) < 1e-10


def test_fused_fsdp_step_still_sends_one_all_reduce_of_block_sums(world2):
    comm = _result(world2, "comm_fsdp_fused")
    assert comm["counts"] == {"all_reduce": 1}
    assert comm["sizes"] == [("all_reduce", _block_sums_per_step())]


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_bfloat16_momentum_hsdp_and_fsdp_tp_equal_single_process(world4, single_process, layout):
    assert max_difference(_result(world4, f"{layout}_{BFLOAT16}"), single_process[BFLOAT16]) < 1e-10


# Weights that the FSDP x TP layout splits by columns (row-wise wo and w2, the embedding): their 8-bit blocks are
# other runs of entries than in one process.
COLUMN_SPLIT = ("tok_embeddings.weight", "attention.wo.weight", "feed_forward.w2.weight")


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_8bit_momentum_hsdp_and_fsdp_tp_equal_single_process(world4, single_process, layout):
    """The quantization blocks are the one-process blocks in every layout (FSDP's rows; TP's column parts, whole
    blocks): the same run to float64 rounding."""
    params = _result(world4, f"{layout}_{INT8}")
    single, unquantized = single_process[f"wide_{INT8}"], single_process["wide"]
    assert max_difference(single, unquantized) > 1e-4  # quantization changes the one-process run
    assert any(name.endswith(COLUMN_SPLIT) for name in params)
    for name, value in params.items():
        assert (value - single[name]).abs().max().item() < 1e-10, name


# ------------------------------------------------------------------------------------------------------------
# Muon
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world3", "fsdp"),
        ("world2", "tp"),
        ("world4", "fsdp_tp"),
        ("world4", "hsdp"),
        ("world6", "fsdp_tp"),
    ],
)
def test_muon_parallel_run_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), f"muon_{layout}")
    assert max_difference(params, single_process["muon"]) < 1e-9
    assert max_difference(single_process["muon"], weights(tiny_model())) > 1e-3  # it trained


def _hidden_matrices() -> list[torch.Tensor]:
    from torchtitan.optim.muon.optimizer import split_hidden_matrices

    model = tiny_model()
    return [p for _, p in split_hidden_matrices(model.named_parameters(), model.named_param_roles())[0]]


@pytest.mark.parametrize("world_name, layout, ranks", [("world2", "fsdp", 2), ("world4", "fsdp_tp", 4)])
def test_muon_step_sends_each_matrix_to_one_owner_and_back(request, world_name, layout, ranks):
    """Owner rounds: 2 all-to-alls per round of ``ranks`` matrices. Rank 0 sends its piece of every matrix and, for
    each matrix it owns (every ``ranks``-th), every rank's piece of the result: the whole matrix."""
    comm = _result(request.getfixturevalue(world_name), f"muon_comm_{layout}")
    matrices = _hidden_matrices()
    total = sum(p.numel() for p in matrices)
    owned = sum(p.numel() for p in matrices[::ranks])
    gather_everything = total * (ranks - 1) // ranks
    print(
        f"Muon {layout} {ranks} ranks: {comm['counts']}; rank 0 sends {comm['sizes']} of {total} matrix entries; "
        f"gathering every matrix would receive {gather_everything} per rank in {len(matrices)} all-gathers"
    )
    assert comm["counts"] == {"alltoall_base_": 2 * math.ceil(len(matrices) / ranks)}
    assert sum(size for _, size in comm["sizes"]) == total // ranks + owned  # even shards of the tiny matrices


def test_muon_checkpoint_from_2_ranks_resumes_exactly_on_1_and_3_ranks(world2, world3, checkpoint_dir, single_process):
    _result(world2, "muon_save")
    resumed = _resume(tiny_model(seed=7), _muon_path(checkpoint_dir), muon_for)
    assert max_difference(resumed, single_process["muon_uninterrupted"]) < 1e-9
    assert max_difference(_result(world3, "muon_resume"), single_process["muon_uninterrupted"]) < 1e-9


# ------------------------------------------------------------------------------------------------------------
# NorMuon
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_name, layout",
    [
        ("world2", "fsdp"),
        ("world3", "fsdp"),  # uneven shards
        ("world2", "tp"),  # row-wise TP: the rows' sums of squares are partial
        ("world4", "fsdp_tp"),
        ("world4", "hsdp"),
        ("world6", "fsdp_tp"),
    ],
)
def test_normuon_parallel_run_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), f"normuon_{layout}")
    assert max_difference(params, single_process["normuon"]) < 1e-9
    assert max_difference(single_process["normuon"], single_process["muon"]) > 1e-4  # the rows were normalised


@pytest.mark.parametrize("world_name, layout", [("world2", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp")])
def test_normuon_rms_step_size_parallel_run_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), f"normuon_rms_{layout}")
    assert max_difference(params, single_process["normuon_rms"]) < 1e-9
    assert max_difference(single_process["normuon_rms"], single_process["normuon"]) > 1e-5  # another step size


@pytest.mark.parametrize("world_name, layout, ranks", [("world2", "fsdp", 2), ("world4", "fsdp_tp", 4)])
def test_normuon_step_is_muons_rounds_plus_all_reduces_of_row_sums_and_norms(request, world_name, layout, ranks):
    """Muon's owner rounds, then the two norms of every matrix, all-reduced over the mesh dimensions that split its
    rows (one all-reduce per dimension and group of matrices) and, where TP splits the columns (attention output,
    w2), one all-reduce of those matrices' row sums first."""
    comm = _result(request.getfixturevalue(world_name), f"normuon_comm_{layout}")
    matrices = _hidden_matrices()
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


# ------------------------------------------------------------------------------------------------------------
# AdEMAMix
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_name, layout",
    [("world2", "fsdp"), ("world3", "fsdp"), ("world2", "tp"), ("world4", "fsdp_tp"), ("world4", "hsdp")],
)
def test_ademamix_parallel_run_equals_single_process(request, single_process, world_name, layout):
    params = _result(request.getfixturevalue(world_name), f"ademamix_{layout}")
    assert max_difference(params, single_process["ademamix"]) < 1e-12
    assert max_difference(single_process["ademamix"], weights(tiny_model())) > 1e-3  # it trained


def test_ademamix_step_communicates_nothing(world2):
    assert _result(world2, "ademamix_comm_fsdp")["counts"] == {}
