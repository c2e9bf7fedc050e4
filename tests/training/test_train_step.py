"""The training step (``torchtitan.training.step.train_step``, the one train.py runs): gradient accumulation and
gradient clipping, in one process and on 2 ranks (FSDP2, TP).

Everything runs in float64 on the tiny Llama of tests/helpers.py, so that results differ only by the order
of floating-point sums. One global batch of 12 sequences is the reference; every run below sees exactly those 12
sequences in one optimizer step, cut differently:
  * gradient accumulation: A micro-batches of 12/A (per data-parallel rank: 12/(A*W));
  * data parallelism: rank r takes the micro-batch rows the data loader would give it (global micro-batch m is
    rows ``[m*W*B, (m+1)*W*B)``, rank r the B rows from ``m*W*B + r*B``), and the global loss is the mean of the
    per-rank losses (equal shares), as train.py logs it.

Clipping uses plain SGD, whose update is proportional to the gradient, so that scaling the gradient must scale the
update by the same factor (Adam's update would hide it).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests import helpers
from tests.distributed import run_workers
from tests.helpers import TINY, grads, job_config, materialize, meta_model, to_numpy, weights
from torchtitan.optim import OptimizersContainer, build_optimizers
from torchtitan.parallelisms import ParallelDims, parallelize_llama
from torchtitan.training.step import build_model, first_compile_notice, train_step

CPU = torch.device("cpu")
LR = 1e-2
SGD_LR = 0.5
CLIP = 0.05  # well below the gradient norm of the tiny model's first step (checked below)
GRAD_TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
# AdamW's first step is g / (|g| + eps): it magnifies gradient differences on entries whose gradient is near zero.
WEIGHT_TOLERANCE = {"rtol": 0.0, "atol": 1e-10}


def micro_batches(accumulation: int, dp_rank: int, dp_degree: int):
    """This rank's micro-batches of this file's global batch, in the data loader's order."""
    return helpers.micro_batches(accumulation, dp_rank, dp_degree, seed=5)


class SGDContainer(OptimizersContainer):
    def __init__(self, model):
        super().__init__([model], [torch.optim.SGD(model.parameters(), lr=SGD_LR)], "SGD")


def run_case(
    degrees: tuple[int, int, int],
    world_size: int,
    accumulation: int,
    optimizer: str,
    max_norm: float,
    gather_logits: bool = False,
    loss_chunks: int = 1,
) -> dict:
    """One train_step of a fresh model; loss (global mean), logged grad norm, full gradients and weights."""
    config = job_config(
        training={
            "gradient_accumulation_steps": accumulation,
            "max_norm": max_norm,
            "disable_loss_parallel": gather_logits,
        },
        optimizer={"name": "AdamW", "lr": LR},
        loss={"num_chunks": loss_chunks},
    )
    dims = ParallelDims(*degrees, world_size, enable_loss_parallel=not gather_logits)
    mesh = dims.build_mesh("cpu")
    model = materialize(parallelize_llama(meta_model(), mesh, dims, config))
    before = weights(model)
    optimizers = SGDContainer(model) if optimizer == "SGD" else build_optimizers([model], config)
    dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
    batches = micro_batches(accumulation, dp_rank, dp_degree)
    loss, grad_norm, updated = train_step(model, optimizers, batches, dims, config, torch.device("cpu"))
    assert updated
    assert next(batches, None) is None  # the step used all its micro-batches, no more
    loss = loss.detach().reshape(1).clone()
    if dims.dp_enabled:
        dist.all_reduce(loss, group=dims.dp_mesh(mesh).get_group())
    gradients, after = grads(model), weights(model)
    # An independent global norm: every gradient gathered whole, then one plain sum of squares.
    independent = math.sqrt(sum(float(g.double().square().sum()) for g in gradients.values()))
    return {
        "loss": loss.item() / dp_degree,
        "grad_norm": float(grad_norm),
        "grad_norm_is_plain": not hasattr(grad_norm, "placements"),
        "post_clip_norm": independent,
        "grads": to_numpy(gradients),
        "weights": to_numpy(after),
        "update": to_numpy({k: after[k] - before[k] for k in after}),
    }


# The cases every layout runs: (name, accumulation micro-batches, optimizer, max_norm).
CASES = [
    ("adamw", 1, "AdamW", 0.0),
    ("adamw_accum2", 2, "AdamW", 0.0),
    ("sgd", 1, "SGD", 0.0),
    ("sgd_clipped", 1, "SGD", CLIP),
    ("sgd_accum2_clipped", 2, "SGD", CLIP),
]
# layout -> (dp_replicate, dp_shard, tp), whether TP gathers the logits instead of a parallel loss, loss chunks
LAYOUTS = {
    "fsdp2": ((1, 2, 1), False, 1),
    "tp2": ((1, 1, 2), False, 1),
    "tp2_gathered_logits": ((1, 1, 2), True, 1),
    "tp2_chunked_loss": ((1, 1, 2), False, 5),
}
GPU_PRECISION = "gpu_precision"  # every layout also has gpu_precision_case of its degrees


def gpu_precision_case(degrees: tuple[int, int, int], world_size: int) -> dict:
    """One float32 train_step of a model built for a GPU job (compute_device_type "cuda"), here on CPU tensors:
    FSDP2's policy with data parallelism, else autocast (CPU autocast standing in for CUDA's). Returns the dtypes
    the step computed and kept, and its loss beside the same step's with float32 compute."""
    config = job_config(training={"max_norm": 0.0}, optimizer={"name": "AdamW", "lr": LR})
    dims = ParallelDims(*degrees, world_size)
    result = {}
    for compute in ("cuda", "cpu"):
        mesh = dims.build_mesh("cpu")
        built = build_model(config, TINY, dims, mesh, compute_device_type=compute, tensor_device_type="cpu")
        model = materialize(built)
        logits: list[torch.dtype] = []
        model.output.register_forward_hook(lambda module, args, out, seen=logits: seen.append(out.dtype))
        dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
        batches = micro_batches(1, dp_rank, dp_degree)
        loss, _, _ = train_step(model, build_optimizers([model], config), batches, dims, config, CPU)
        result[compute] = {
            "loss": float(loss),
            "logits": str(logits[0]),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()}),
            "params": sorted({str(p.dtype) for p in model.parameters()}),
        }
    return result


def _cases_on_layouts(rank: int, world_size: int) -> dict:
    results = {
        layout: {name: run_case(degrees, world_size, a, opt, norm, gather, chunks) for name, a, opt, norm in CASES}
        for layout, (degrees, gather, chunks) in LAYOUTS.items()
    }
    precision = {}  # degrees -> gpu_precision_case (the layout's loss options do not enter it)
    for layout, (degrees, _, _) in LAYOUTS.items():
        if degrees not in precision:
            precision[degrees] = gpu_precision_case(degrees, world_size)
        results[layout][GPU_PRECISION] = precision[degrees]
    return results


@pytest.fixture(scope="module")
def one_process() -> dict:
    cases = {name: run_case((1, 1, 1), 1, a, opt, norm) for name, a, opt, norm in CASES}
    cases["adamw_accum4"] = run_case((1, 1, 1), 1, 4, "AdamW", 0.0)
    cases["adamw_accum4_chunked_loss"] = run_case((1, 1, 1), 1, 4, "AdamW", 0.0, loss_chunks=5)
    return cases


@pytest.fixture(scope="module")
def one_process_gpu_precision() -> dict:
    return gpu_precision_case((1, 1, 1), 1)


@pytest.fixture(scope="module")
def two_rank_runs() -> list[dict]:
    """Every layout in one pair of processes (starting processes is the slow part)."""
    return run_workers(_cases_on_layouts, 2)


@pytest.fixture(params=sorted(LAYOUTS))
def two_ranks(request, two_rank_runs) -> tuple[str, list[dict]]:
    return request.param, [rank[request.param] for rank in two_rank_runs]


def assert_close(a: dict, b: dict, tolerance: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        np.testing.assert_allclose(value, b[key], err_msg=key, **tolerance)


def assert_same_step(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-10)
    assert_close(got["grads"], want["grads"], GRAD_TOLERANCE)
    assert_close(got["weights"], want["weights"], WEIGHT_TOLERANCE)


# ----------------------------------------------------------------------------------------------------------------
# Gradient accumulation


@pytest.mark.parametrize("accumulated", ["adamw_accum2", "adamw_accum4", "adamw_accum4_chunked_loss"])
def test_accumulation_equals_one_big_batch_in_one_process(one_process, accumulated):
    assert_same_step(one_process[accumulated], one_process["adamw"])
    # The step changed the weights: equal updates are not equal because nothing moved.
    assert max(np.abs(u).max() for u in one_process["adamw"]["update"].values()) > 0.5 * LR


def test_accumulation_and_data_parallelism_equal_one_big_batch(one_process, two_ranks):
    _, ranks = two_ranks
    for rank in ranks:
        for name in ("adamw", "adamw_accum2"):
            assert_same_step(rank[name], one_process["adamw"])


# ----------------------------------------------------------------------------------------------------------------
# Clipping and the logged grad norm


def test_clipping_scales_the_update_by_max_norm_over_the_norm(one_process):
    plain, clipped = one_process["sgd"], one_process["sgd_clipped"]
    norm = plain["grad_norm"]
    assert norm > 4 * CLIP  # the case really clips
    # The logged norm is the norm before clipping, and it is the gradients' own norm.
    assert clipped["grad_norm"] == pytest.approx(norm, rel=1e-12)
    assert plain["post_clip_norm"] == pytest.approx(norm, rel=1e-12)
    factor = CLIP / (norm + 1e-6)  # torch's clip coefficient
    assert clipped["post_clip_norm"] == pytest.approx(CLIP, rel=1e-4)
    assert_close(clipped["grads"], {k: factor * g for k, g in plain["grads"].items()}, GRAD_TOLERANCE)
    assert_close(clipped["update"], {k: factor * u for k, u in plain["update"].items()}, GRAD_TOLERANCE)
    for key, update in plain["update"].items():
        np.testing.assert_allclose(update, -SGD_LR * plain["grads"][key], rtol=1e-12, atol=1e-15, err_msg=key)


def test_clipping_after_accumulation_uses_the_whole_steps_norm(one_process):
    assert_same_step(one_process["sgd_accum2_clipped"], one_process["sgd_clipped"])


def test_logged_grad_norm_is_the_full_tensor_norm_on_two_ranks(one_process, two_ranks):
    layout, ranks = two_ranks
    for rank in ranks:
        for name in ("adamw", "sgd"):
            # Gradients gathered whole on this rank give the same norm as the one train_step logs...
            assert rank[name]["grad_norm"] == pytest.approx(rank[name]["post_clip_norm"], rel=1e-12), (layout, name)
            # ... which is the single process's norm: no shard counted twice or left out.
            assert rank[name]["grad_norm"] == pytest.approx(one_process[name]["grad_norm"], rel=1e-10), (layout, name)
            assert rank[name]["grad_norm_is_plain"]
        for name in ("sgd_clipped", "sgd_accum2_clipped"):
            assert_same_step(rank[name], one_process["sgd_clipped"])
            assert rank[name]["post_clip_norm"] == pytest.approx(CLIP, rel=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Mixed precision of a GPU job, whatever the layout


def assert_gpu_precision(case: dict, what: str) -> None:
    """Computed in bfloat16 (logits, a loss off the float32 one), float32 master weights and gradients; a CPU
    job's model computes in float32."""
    gpu, cpu = case["cuda"], case["cpu"]
    assert gpu["logits"] == "torch.bfloat16" and cpu["logits"] == "torch.float32", what
    for run in (gpu, cpu):
        assert run["params"] == run["grads"] == ["torch.float32"], what
    assert gpu["loss"] != cpu["loss"] and gpu["loss"] == pytest.approx(cpu["loss"], rel=2e-2), what


def test_a_gpu_job_computes_in_bf16_on_one_device(one_process_gpu_precision):
    assert_gpu_precision(one_process_gpu_precision, "one process")


def test_a_gpu_job_computes_in_bf16_with_tp_or_fsdp(two_ranks):
    layout, ranks = two_ranks
    for rank in ranks:
        assert_gpu_precision(rank[GPU_PRECISION], layout)
    (_, _, tp), _, _ = LAYOUTS[layout]
    if tp > 1:  # both ranks compute the loss of the same batch (with FSDP each rank's loss is of its own share)
        assert ranks[0][GPU_PRECISION]["cuda"]["loss"] == ranks[1][GPU_PRECISION]["cuda"]["loss"], layout


def test_the_first_compile_is_announced_with_what_compiles_and_how_long(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    cpu = first_compile_notice(job_config("--training.compile"), "cpu")
    assert "compiling the model's blocks (training.compile) and the optimizer's step" in cpu
    assert "first step only" in cpu and "a minute or two (a compiled optimizer step) on a 2-core CPU" in cpu
    gpu = first_compile_notice(job_config("--model.norm_type", "compiled_rmsnorm"), "cuda", torch_optimizer=True)
    assert "compiling the model's norms (compiled_rmsnorm):" in gpu and "not yet timed on a GPU" in gpu
    assert "optimizer" not in gpu  # torch's own optimizer compiles nothing
    optimizer_only = first_compile_notice(job_config("--optimizer.name", "AdamMini"), "cpu")
    assert optimizer_only.startswith("compiling the optimizer's step if it has a compiled one:")
    assert first_compile_notice(job_config(), "cpu", torch_optimizer=True) is None  # eager norms, torch's AdamW
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert first_compile_notice(job_config("--training.compile"), "cpu") is None  # nothing compiles
