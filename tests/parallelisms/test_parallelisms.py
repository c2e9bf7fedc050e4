"""Parallelized Llama (FSDP2, HSDP, TP, FSDP x TP) trains exactly like the same model in one process, and bad
parallel settings are refused with a UserError.

Each world size is launched once (processes are the slow part on a small machine) and runs several layouts in turn;
one test per layout then compares that layout's results with the single-process reference.

Tolerance: everything runs in float64, so layouts differ from one process only by summation order across shards
(~1e-16 relative per operation); we allow 1e-10 relative and 1e-12 absolute for gradients. The weights after one
AdamW step get 1e-10 absolute: the first Adam step is g / (|g| + eps), which magnifies gradient differences by up
to lr / eps on entries whose gradient is near zero.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_workers
from tests.helpers import (
    LLAMA32_TINY,
    TINY,
    CollectiveCounts,
    adamw_step,
    batch,
    full,
    hf_job,
    job_config,
    materialize,
    meta_model,
    reference_step,
    tiny_manager,
    tiny_model,
    to_numpy,
    weights,
    with_ignored_labels,
)
from torchtitan.checkpoint import hf
from torchtitan.checkpoint.manager import model_state_of
from torchtitan.errors import UserError
from torchtitan.parallelisms import (
    ParallelDims,
    loss_parallel_context,
    parallelize_llama,
    validate_model_for_parallelism,
)

GRAD_TOLERANCE = dict(rtol=1e-10, atol=1e-12)
WEIGHT_TOLERANCE = dict(rtol=0.0, atol=1e-10)

CHUNKS = {"num_chunks": 5}
TIED = {"enable_weight_tying": True}

# layout name -> (world size, (dp_replicate, dp_shard, tp), job config sections). Uneven FSDP 3, which alone would
# need a launch of its own, is the layout matrix's column (tests/optim/test_layout_matrix.py: every optimizer's steps
# through the trainer's build path, against one process).
LAYOUTS = {
    "fsdp2": (2, (1, -1, 1), {}),
    "tp2": (2, (1, 1, 2), {}),
    "tp2_gathered_logits": (2, (1, 1, 2), {"training": {"disable_loss_parallel": True}}),
    "tp2_selective_op_ac": (
        2,
        (1, 1, 2),
        {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}},
    ),
    "fsdp2_full_ac": (2, (1, 2, 1), {"activation_checkpoint": {"mode": "full"}}),
    "replicate2": (2, (2, 1, 1), {}),  # HSDP with shard degree 1: plain replication
    "fsdp2_x_tp2": (4, (1, 2, 2), {}),
    "hsdp2x2": (4, (2, 2, 1), {}),
    "hsdp2x2_x_tp1": (4, (2, -1, 1), {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"}}),
    # The chunked loss (5 uneven chunks of each rank's tokens) against the same one-process, whole-logits reference.
    "fsdp2_chunked_loss_full_ac": (2, (1, 2, 1), {"loss": CHUNKS, "activation_checkpoint": {"mode": "full"}}),
    "tp2_chunked_loss": (2, (1, 1, 2), {"loss": CHUNKS}),
    "tp2_gathered_logits_chunked_loss": (2, (1, 1, 2), {"loss": CHUNKS, "training": {"disable_loss_parallel": True}}),
    "fsdp2_x_tp2_chunked_loss_op_ac": (
        4,
        (1, 2, 2),
        {"loss": CHUNKS, "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}},
    ),
    "hsdp2x2_chunked_loss": (4, (2, 2, 1), {"loss": CHUNKS}),
    # One parameter for the embedding and the output projection, against the tied model in one process.
    "fsdp2_tied": (2, (1, -1, 1), {"model": TIED}),
    "tp2_tied_chunked_loss": (2, (1, 1, 2), {"model": TIED, "loss": CHUNKS}),
    "fsdp2_x_tp2_tied": (4, (1, 2, 2), {"model": TIED}),
    # Labels partly ignored (-100): the loss is the mean over the others, as F.cross_entropy's.
    "fsdp2_ignored_labels_chunked_loss": (2, (1, 2, 1), {"loss": CHUNKS}),
    "tp2_ignored_labels": (2, (1, 1, 2), {}),
    "tp2_ignored_labels_chunked_loss": (2, (1, 1, 2), {"loss": CHUNKS}),
    "tp2_gathered_logits_ignored_labels_chunked_loss": (
        2,
        (1, 1, 2),
        {"loss": CHUNKS, "training": {"disable_loss_parallel": True}},
    ),
}
IGNORED_LABELS = "ignored_labels"  # in a layout's name: its labels are with_ignored_labels(labels)


def _run_layout(world_size: int, degrees, sections, ignored_labels: bool = False) -> dict:
    config = job_config(**sections)
    dims = ParallelDims(*degrees, world_size, enable_loss_parallel=not config.training.disable_loss_parallel)
    mesh = dims.build_mesh("cpu")
    model = materialize(parallelize_llama(meta_model(_layout_args(sections)), mesh, dims, config))
    tied = model.output.weight is model.tok_embeddings.weight
    dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
    inputs, labels = batch()
    if ignored_labels:
        labels = with_ignored_labels(labels)
    share = len(inputs) // dp_degree
    rows = slice(dp_rank * share, (dp_rank + 1) * share)
    context = functools.partial(loss_parallel_context, dims, config)
    result = adamw_step(model, inputs[rows], labels[rows], context, config.loss.num_chunks)
    # The global loss is the mean over data-parallel ranks (equal shares); FSDP averages gradients the same way.
    loss = torch.tensor([result["loss"]], dtype=torch.float64)
    if dims.dp_enabled:
        dist.all_reduce(loss, group=dims.dp_mesh(mesh).get_group())
    return {
        "loss": loss.item() / dp_degree,
        "tied": tied,
        "dp": (dp_rank, dp_degree),
        "grads": to_numpy(result["grads"]),
        "weights": to_numpy(result["weights"]),
    }


def _layout_args(sections: dict):
    """The tiny model of a layout: tied when its [model] section says so."""
    return replace(TINY, enable_weight_tying=sections.get("model", {}).get("enable_weight_tying", False))


def _run_layouts(rank: int, world_size: int, names: list[str], hf_dump: str | None = None) -> dict:
    results = {
        name: _run_layout(world_size, LAYOUTS[name][1], LAYOUTS[name][2], IGNORED_LABELS in name) for name in names
    }
    if world_size == HSDP_ACCUMULATION_WORLD:
        results[HSDP_ACCUMULATION] = _hsdp_accumulation(world_size)
    if hf_dump is not None:
        results.update(_hf_load_and_export(world_size, hf_dump))
    return results


# HSDP 2 x 2 with gradient accumulation, in the 4-rank launch: collectives counted per training step.
HSDP_ACCUMULATION = "hsdp2x2_accumulation"
HSDP_ACCUMULATION_WORLD = 4
MICRO_BATCHES = 3  # BATCH 12 over 4 data-parallel ranks: 3 micro-batches of 1 sequence


def _hsdp_step(world_size: int, accumulation: int) -> dict:
    """One train_step of a fresh HSDP 2 x 2 model; its collective counts and gradients."""
    from torchtitan.optim import build_optimizers
    from torchtitan.training.step import train_step

    config = job_config(training={"gradient_accumulation_steps": accumulation, "max_norm": 0.0})
    dims = ParallelDims(2, 2, 1, world_size)
    mesh = dims.build_mesh("cpu")
    model = materialize(parallelize_llama(meta_model(), mesh, dims, config))
    optimizers = build_optimizers([model], config)
    dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
    inputs, labels = batch()
    rows = len(inputs) // (accumulation * dp_degree)
    starts = [(m * dp_degree + dp_rank) * rows for m in range(accumulation)]
    batches = iter([(inputs[s : s + rows], labels[s : s + rows]) for s in starts])
    with CollectiveCounts() as comms:
        train_step(model, optimizers, batches, dims, config, torch.device("cpu"))
    return {"counts": comms.counts(), "grads": to_numpy({n: p.grad.full_tensor() for n, p in model.named_parameters()})}


def _hsdp_accumulation(world_size: int) -> dict:
    return {str(a): _hsdp_step(world_size, a) for a in (1, MICRO_BATCHES)}


# Hugging Face weights in and out under FSDP, TP (with the fused RMSNorm on DTensors) and FSDP x TP (strided row
# shards), in the launches above, for the tiny Llama 3 and the tiny Llama 3.2 (tied, scaled RoPE): layout name ->
# (world size, (dp_replicate, dp_shard, tp), model.norm_type, model shape).
HF_SHAPES = {"llama3": TINY, "llama32": LLAMA32_TINY}
HF_LAYOUTS = {
    "hf_fsdp2": (2, (1, -1, 1), "rmsnorm", "llama3"),
    "hf_tp2": (2, (1, 1, 2), "fused_rmsnorm", "llama3"),
    "hf_fsdp2_x_tp2": (4, (1, 2, 2), "rmsnorm", "llama3"),
    "hf_fsdp2_llama32": (2, (1, -1, 1), "rmsnorm", "llama32"),
    "hf_tp2_llama32": (2, (1, 1, 2), "rmsnorm", "llama32"),
    "hf_fsdp2_x_tp2_llama32": (4, (1, 2, 2), "rmsnorm", "llama32"),
}
HF_SEED = 5


def _hf_load_and_export(world_size: int, dump: str) -> dict:
    results = {}
    for name, (size, degrees, norm_type, shape) in HF_LAYOUTS.items():
        if size != world_size:
            continue
        job = hf_job(dump, initial_load_path=os.path.join(dump, shape), initial_load_in_hf=True, folder=name)
        job.checkpoint.last_save_in_hf = True
        job.model.norm_type = norm_type
        dims = ParallelDims(*degrees, world_size)
        mesh = dims.build_mesh("cpu")
        args = replace(HF_SHAPES[shape], norm_type=norm_type)
        model = materialize(parallelize_llama(meta_model(args), mesh, dims, job))
        manager = tiny_manager(model, job)
        manager.load()
        with torch.no_grad():
            logits = full(model(batch()[0]))
        manager.save(1, force=True)
        manager.close()
        results[name] = {
            "weights": to_numpy(weights(model)),
            "logits": logits.numpy().copy(),
            "tied": model.output.weight is model.tok_embeddings.weight,
        }
    return results


_HF_DUMPS: list[tempfile.TemporaryDirectory] = []  # kept until the test process ends, then removed


@functools.lru_cache(maxsize=None)
def _hf_dump() -> str:
    """The folder of the Hugging Face layouts, made in the test process only (workers import this module too)."""
    _HF_DUMPS.append(tempfile.TemporaryDirectory(prefix="hf-layouts-"))
    return _HF_DUMPS[-1].name


@functools.lru_cache(maxsize=None)
def _results_for_world_size(world_size: int) -> list[dict]:
    names = [name for name, (size, _, _) in LAYOUTS.items() if size == world_size]
    if all(size != world_size for size, *_ in HF_LAYOUTS.values()):
        return run_workers(_run_layouts, world_size, (names,))
    return run_workers(_run_layouts, world_size, (names, _hf_source()))


@functools.lru_cache(maxsize=None)
def _hf_source() -> str:
    """The Hugging Face folders the HF layouts load (one per shape): a seeded tiny model, written by our exporter in
    float32."""
    for shape, args in HF_SHAPES.items():
        os.makedirs(os.path.join(_hf_dump(), shape), exist_ok=True)
        source = tiny_model(args, seed=HF_SEED)
        hf.write_hf_weights(model_state_of(source), os.path.join(_hf_dump(), shape), args, torch.float32, 0)
    return _hf_dump()


@functools.lru_cache(maxsize=None)
def _reference(tied: bool = False, ignored_labels: bool = False) -> dict:
    args = replace(TINY, enable_weight_tying=tied)
    if not ignored_labels:
        return reference_step(args)
    inputs, labels = batch()
    return adamw_step(materialize(meta_model(args)), inputs, with_ignored_labels(labels))


def _assert_close_dicts(actual: dict, expected: dict, tolerance: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        torch.testing.assert_close(torch.from_numpy(value), expected[name], **tolerance, msg=f"{what} of {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_process(layout):
    world_size, _, sections = LAYOUTS[layout]
    tied = _layout_args(sections).enable_weight_tying
    reference = _reference(tied, IGNORED_LABELS in layout)
    for rank, results in enumerate(_results_for_world_size(world_size)):
        result = results[layout]
        assert result["tied"] == tied
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-12, abs=0.0)
        _assert_close_dicts(result["grads"], reference["grads"], GRAD_TOLERANCE, f"rank {rank} gradient")
        _assert_close_dicts(result["weights"], reference["weights"], WEIGHT_TOLERANCE, f"rank {rank} weight")


@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_hugging_face_weights_load_and_export_under_every_layout(layout):
    """Each rank reads its shards (query/key rows reordered); the export gathers them: both as one process does,
    and the first loss is transformers' loss of the same folder."""
    import transformers
    from safetensors.torch import load_file

    world_size, _, _, shape = HF_LAYOUTS[layout]
    args = HF_SHAPES[shape]
    results = _results_for_world_size(world_size)
    folder = os.path.join(_hf_dump(), shape)
    single = materialize(meta_model(args))
    manager = tiny_manager(single, hf_job(_hf_dump(), initial_load_path=folder, initial_load_in_hf=True))
    assert manager.load()
    # float32 files: the tiny float64 model rounded to float32, exactly.
    expected = {k: v.float().double() for k, v in weights(tiny_model(args, seed=HF_SEED)).items()}
    assert max((weights(single)[k] - v).abs().max().item() for k, v in expected.items()) == 0.0
    inputs, labels = batch()
    with torch.no_grad():
        expected_logits = single(inputs).numpy()
        reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        tokens = torch.cat([inputs, labels[:, -1:]], dim=1)
        transformers_loss = reference(input_ids=tokens, labels=tokens).loss.item()
    source = load_file(os.path.join(folder, "model.safetensors"))
    assert ("lm_head.weight" in source) != args.enable_weight_tying
    for rank, by_layout in enumerate(results):
        result = by_layout[layout]
        assert result["tied"] == args.enable_weight_tying
        for key, value in expected.items():
            torch.testing.assert_close(
                torch.from_numpy(result["weights"][key]), value, rtol=0, atol=0, msg=f"rank {rank} {key}"
            )
        logits = torch.from_numpy(result["logits"])
        torch.testing.assert_close(logits, torch.from_numpy(expected_logits), rtol=1e-12, atol=1e-12)
        # transformers casts its logits to float32 for the loss; ours stays float64.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
        assert loss == pytest.approx(transformers_loss, rel=1e-6)
    exported = load_file(os.path.join(_hf_dump(), layout, "step-1-hf", "model.safetensors"))
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert torch.equal(exported[key], value), key


def test_data_parallel_ranks_follow_the_mesh():
    """dp rank = (replicate index, shard index) in row-major order; TP neighbours share a dp rank."""
    by_rank = _results_for_world_size(4)
    assert [r["fsdp2_x_tp2"]["dp"] for r in by_rank] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["hsdp2x2"]["dp"] for r in by_rank] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_hsdp_accumulation_all_reduces_across_replicas_once_per_step():
    """Every micro-batch reduce-scatters within its replica; the all-reduce across replicas comes once, with the
    last one: a step of 3 micro-batches all-reduces as often as a step of 1 (the loss, grad norm and divergence
    guard add theirs alike), and its gradients equal the one-micro-batch step's."""
    for rank in _results_for_world_size(HSDP_ACCUMULATION_WORLD):
        one, accumulated = rank[HSDP_ACCUMULATION]["1"], rank[HSDP_ACCUMULATION][str(MICRO_BATCHES)]
        print(f"collectives per step: 1 micro-batch {one['counts']}, {MICRO_BATCHES}: {accumulated['counts']}")
        reduce_scatters = [k for k in one["counts"] if "reduce_scatter" in k]
        assert reduce_scatters, one["counts"]
        for name in reduce_scatters:
            assert accumulated["counts"][name] == MICRO_BATCHES * one["counts"][name]
        all_reduces = [k for k in one["counts"] if k.startswith("all_reduce") or k.startswith("allreduce")]
        assert all_reduces, one["counts"]
        for name in all_reduces:
            assert accumulated["counts"].get(name, 0) == one["counts"][name]
        _assert_close_dicts(
            accumulated["grads"],
            {k: torch.from_numpy(v) for k, v in one["grads"].items()},
            GRAD_TOLERANCE,
            "accumulated gradient",
        )


# ----------------------------------------------------------------------------------------------------------------
# Degrees and validation (one process)


def test_shard_degree_fills_the_world():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 4, 2)
    assert dims.dp_enabled and dims.dp_replicate_enabled and dims.dp_shard_enabled and dims.tp_enabled
    assert dims.loss_parallel_enabled
    assert not ParallelDims(1, -1, 2, 2, enable_loss_parallel=False).loss_parallel_enabled
    assert not ParallelDims(1, -1, 1, 2).loss_parallel_enabled  # no TP: nothing to parallelize the loss over


def test_degrees_and_loss_parallel_come_from_the_job_config():
    config = job_config(training={"data_parallel_replicate_degree": 2, "tensor_parallel_degree": 3})
    dims = ParallelDims.from_job_config(config, 12)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.world_size) == (2, 2, 3, 12)
    assert dims.loss_parallel_enabled
    config.training.data_parallel_shard_degree = 4
    config.training.disable_loss_parallel = True
    dims = ParallelDims.from_job_config(config, 24)
    assert dims.degrees == {"dp_replicate": 2, "dp_shard": 4, "tp": 3} and not dims.loss_parallel_enabled
    with pytest.raises(UserError, match="world size 12"):
        ParallelDims.from_job_config(config, 12)


@pytest.mark.parametrize(
    "degrees, world_size",
    [((2, 2, 1), 8), ((1, 3, 1), 4), ((1, -1, 3), 4), ((3, -1, 1), 4), ((1, -1, 1), 0)],
)
def test_degrees_not_matching_the_world_size_are_refused(degrees, world_size):
    with pytest.raises(UserError, match="world.size"):
        ParallelDims(*degrees, world_size=world_size)


def test_one_process_needs_no_mesh_and_parallelize_is_a_no_op():
    dims = ParallelDims(1, -1, 1, 1)
    assert not dims.dp_enabled and not dims.tp_enabled
    assert dims.build_mesh("cpu") is None
    assert dims.dp_rank_and_degree(None) == (0, 1)
    model = meta_model()
    names = [name for name, _ in model.named_parameters()]
    assert parallelize_llama(model, None, dims, job_config()) is model
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.parametrize("n_heads, n_kv_heads, tp, named", [(6, None, 4, "n_heads 6"), (4, 1, 2, "n_kv_heads 1")])
def test_tensor_parallel_degree_must_divide_the_head_counts(n_heads, n_kv_heads, tp, named):
    args = replace(TINY, dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads)
    with pytest.raises(UserError, match=named):
        validate_model_for_parallelism(args, ParallelDims(1, 1, tp, world_size=tp))
    validate_model_for_parallelism(TINY, ParallelDims(1, 1, 2, world_size=2))  # 4 and 2 heads split in two: fine


@pytest.mark.parametrize("gpu", [None, (8, 0)])
def test_float8_without_a_recent_cuda_gpu_is_refused(monkeypatch, gpu):
    """No CUDA GPU, or one older than compute capability 8.9 (here an A100), cannot run float8 matmuls."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu)
    config = job_config(float8={"enable_float8_linear": True})
    with pytest.raises(UserError, match="compute capability >= 8.9"):
        parallelize_llama(meta_model(), None, ParallelDims(1, -1, 1, 1), config)
