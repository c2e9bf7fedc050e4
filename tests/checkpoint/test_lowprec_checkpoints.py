"""Adam-mini with low-precision momentum (bf16, 8-bit, 4-bit): DCP checkpoints saved on 2 FSDP ranks load on 1 and
on 3, through the trainer's optimizer container and its safe reader.

Saved and loaded as the trainer does (quantized states written and read one group at a time). A checkpoint holds
plain tensors only (bf16 ``m`` as bf16, quantized ``m`` dequantized to float32 with its block scales beside it,
nothing of torchao's), the loaded state equals the saved one exactly (quantized ``m`` too, on another world size),
and training continues from it as the uninterrupted run does.

One launch saves every variant on 2 ranks and continues there; one launch loads them on 3; the test process loads
them unsharded.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from tests.distributed import run_workers
from tests.helpers import full, initial_state_bytes, job_config, max_over_ranks, meta_model
from torchtitan.checkpoint import SafeFileSystemReader, SafeLoadPlanner
from torchtitan.models.llama import ModelArgs
from torchtitan.optim import build_optimizers
from torchtitan.optim.state.quantized_checkpoint import QuantizedStateSavePlanner, plain_values, read_in_groups
from torchtitan.optim.state.storage import is_quantized

torchao_optim = pytest.importorskip("torchao.optim", reason="needs torchao for quantized momentum (the lowbit extra)")

SEQ_LEN, GLOBAL_BATCH = 8, 6  # 6 sequences split evenly over 1, 2 and 3 ranks
# Every matrix 256 columns wide (128 or 256 rows): each shard on 2 and 3 ranks is at least 4096 entries and whole
# rows of 256, a whole number of 8-bit (256) and 4-bit (128) blocks, so every matrix's momentum is quantized.
ARGS = ModelArgs(
    dim=256, n_layers=1, n_heads=4, vocab_size=128, multiple_of=256, ffn_dim_multiplier=0.375, max_seq_len=SEQ_LEN
)
SAVE_AT, MORE_STEPS, LR = 3, 2, 0.01
# label -> (optimizer options, parameter dtype). bf16 momentum trains float64 weights, so that the sums that FSDP
# orders differently on 2 and 3 ranks cannot flip a bf16 rounding; quantized momentum is torchao's, over float32.
VARIANTS = {
    "AdamMini bf16": ({"name": "AdamMini", "state_dtype": "bfloat16"}, torch.float64),
    "AdamMini8bit": ({"name": "AdamMini8bit"}, torch.float32),
    "AdamMini4bit": ({"name": "AdamMini4bit"}, torch.float32),
}
SIGNED_CODES = {"AdamMini8bit": torchao_optim.subclass_8bit, "AdamMini4bit": torchao_optim.subclass_4bit}
pytestmark = pytest.mark.timeout(600)


def _job(label: str):
    options, _ = VARIANTS[label]
    # foreach: the compiled step would only add compile time here; the state is the same.
    return job_config(optimizer={**options, "implementation": "foreach", "lr": LR})


def _model(label: str, world_size: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = meta_model(ARGS, VARIANTS[label][1])
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in net.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    net.to_empty(device="cpu")
    net.init_weights(seed)
    return net.train()


def _train(net, optimizers, steps: range, rank: int, world_size: int) -> None:
    """Each step: this rank's share of one global batch (the same data for any world size)."""
    share = GLOBAL_BATCH // world_size
    for step in steps:
        tokens = torch.randint(
            0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step)
        )[rank * share : (rank + 1) * share]
        logits = net(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizers.step()
        optimizers.zero_grad()


def _weights(net) -> dict[str, torch.Tensor]:
    return {name: full(p).detach().clone() for name, p in net.named_parameters()}


def _full_state(optimizers) -> dict[str, torch.Tensor]:
    state = plain_values(optimizers.state_dict())
    return {k: full(v).detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _read(state: dict, path: str) -> None:
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(path),
        planner=SafeLoadPlanner(),
        no_dist=not torch.distributed.is_initialized(),
    )


def _load(net, optimizers, path: str, model_only: bool = False) -> None:
    """As the trainer reads a checkpoint: DCP through the safe reader and planner, then into model and optimizer,
    quantized states a group at a time."""
    state = {"model": net.state_dict()}
    if not model_only:
        state["optimizer"] = optimizers.state_dict()
    read_in_groups(state, lambda part: _read(part, path), agree_on_count=max_over_ranks)
    net.load_state_dict(state["model"])
    if not model_only:
        optimizers.load_state_dict(state["optimizer"])


def _pack(result) -> bytes:
    # As bytes: tensors sent through the queue would share memory with a process that has exited.
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _save_on_two_ranks(rank: int, world_size: int, folder: str) -> bytes:
    results = {}
    for label in VARIANTS:
        net = _model(label, world_size, seed=0)
        optimizers = build_optimizers([net], _job(label))
        _train(net, optimizers, range(SAVE_AT), rank, world_size)
        dcp.save(
            {"model": net.state_dict(), "optimizer": optimizers.state_dict()},
            checkpoint_id=os.path.join(folder, label),
            planner=QuantizedStateSavePlanner(),
        )
        saved = _full_state(optimizers)
        _train(net, optimizers, range(SAVE_AT, SAVE_AT + MORE_STEPS), rank, world_size)
        results[label] = {"saved": saved, "uninterrupted": _weights(net), "state_bytes": optimizers.state_bytes()}
    return _pack(results)


def _load_and_continue(rank: int, world_size: int, folder: str) -> bytes:
    results = {}
    for label in VARIANTS:
        path = os.path.join(folder, label)
        net = _model(label, world_size, seed=7)
        optimizers = build_optimizers([net], _job(label))
        _load(net, optimizers, path)
        loaded = _full_state(optimizers)
        live_quantized = [
            is_quantized(state["m"]) for p, state in optimizers.optimizers[0].state.items() if p.dim() == 2
        ]
        _train(net, optimizers, range(SAVE_AT, SAVE_AT + MORE_STEPS), rank, world_size)
        resumed = _weights(net)
        # The same resume without the optimizer state: how far off a lost state puts the run.
        forgetful_net = _model(label, world_size, seed=7)
        forgetful = build_optimizers([forgetful_net], _job(label))
        _load(forgetful_net, forgetful, path, model_only=True)
        _train(forgetful_net, forgetful, range(SAVE_AT, SAVE_AT + MORE_STEPS), rank, world_size)
        results[label] = {
            "loaded": loaded,
            "resumed": resumed,
            "without_state": _weights(forgetful_net),
            "live_quantized": live_quantized,
        }
    return _pack(results)


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lowprec_checkpoints"))
    ranks = [_unpack(r) for r in run_workers(_save_on_two_ranks, world_size=2, args=(folder,))]
    return folder, ranks


@pytest.fixture(scope="module")
def loaded(saved):
    """Per world size (1: this process, 3: a launch), the loaded state and the continued run of each variant."""
    folder, _ = saved
    one = _unpack(_load_and_continue(0, 1, folder))
    three = [_unpack(r) for r in run_workers(_load_and_continue, world_size=3, args=(folder,))]
    return {1: [one], 3: three}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _requantization_step(label: str) -> float:
    """How far re-quantizing a dequantized value may move it, as a fraction of its block's scale.

    A value lands on the nearest code of its block: at most half the widest gap of the signed code table away, or
    (a block whose largest magnitude is negative) the table's shortfall below -1. Blocks follow the local shard, so
    on another world size a block's scale is its new largest magnitude, never more than the tensor's.
    """
    codes = torch.tensor(SIGNED_CODES[label].get_qmap_signed()).sort().values
    return max((codes[1:] - codes[:-1]).max().item() / 2, 1 + codes[0].item())


@pytest.mark.parametrize("label", list(VARIANTS))
def test_checkpoint_holds_only_plain_tensors(saved, label):
    folder, ranks = saved
    path = os.path.join(folder, label)
    entries = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    momentum = {k: v for k, v in entries.items() if k.startswith("optimizer.state.") and k.endswith(".m")}
    assert len(momentum) == len(list(meta_model(ARGS).parameters()))
    want = torch.bfloat16 if label == "AdamMini bf16" else torch.float32
    for key, entry in momentum.items():
        assert isinstance(entry, TensorStorageMetadata) and entry.properties.dtype == want, key
        assert tuple(entry.size) == tuple(ranks[0][label]["saved"][key.removeprefix("optimizer.")].shape), key
    assert all(isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)) for entry in entries.values())
    for name in os.listdir(path):  # neither the metadata nor any shard names a torchao class
        with open(os.path.join(path, name), "rb") as f:
            assert b"torchao" not in f.read(), name


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("label", list(VARIANTS))
def test_loaded_state_equals_the_saved_state(saved, loaded, label, world_size):
    saved_state = saved[1][0][label]["saved"]
    for rank in loaded[world_size]:
        state = rank[label]["loaded"]
        assert state.keys() == saved_state.keys()
        if label == "AdamMini bf16":
            assert all(torch.equal(state[k], saved_state[k]) for k in state)
            assert all(state[k].dtype == torch.bfloat16 for k in state if k.endswith(".m"))
            continue
        assert all(rank[label]["live_quantized"])  # every matrix quantized again on load, not kept as float32
        # Quantized m too: its blocks are the same on 2, 3 and 1 ranks, and their saved scales come back with it.
        assert any(key.endswith(".m.block_scales") for key in saved_state)
        for key, value in saved_state.items():
            assert torch.equal(state[key], value), key


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("label", list(VARIANTS))
def test_training_continues_as_the_uninterrupted_run(saved, loaded, label, world_size):
    uninterrupted = saved[1][0][label]["uninterrupted"]
    for rank in loaded[world_size]:
        resumed, forgetful = rank[label]["resumed"], rank[label]["without_state"]
        lost = _max_difference(uninterrupted, forgetful)
        assert lost > 1e-3  # the optimizer state matters to this check
        if label == "AdamMini bf16":
            # float64 weights: only the order of FSDP's sums differs from the 2-rank run.
            assert _max_difference(uninterrupted, resumed) < 1e-10
            continue
        assert _max_difference(uninterrupted, resumed) < 0.1 * lost
        # The state loads exactly; float32 gradients summed in another order by FSDP may still move an m across a
        # code boundary, by at most a code gap of its block's scale, and each update after it by about as much of
        # one step (lr): the mean drift stays below that.
        drift = [(uninterrupted[k] - resumed[k]).abs().mean().item() for k in resumed]
        assert sum(drift) / len(drift) < _requantization_step(label) * LR


def test_each_rank_holds_about_half_the_quantized_state(saved):
    _, ranks = saved
    adamw = build_optimizers([_model("AdamMini8bit", 1, seed=0)], job_config(optimizer={"name": "AdamW"}))
    single = initial_state_bytes(adamw)
    for rank in ranks:
        assert rank["AdamMini8bit"]["state_bytes"] < 0.2 * single  # 8-bit m, float32 v per block, half the rows
        assert rank["AdamMini4bit"]["state_bytes"] < rank["AdamMini8bit"]["state_bytes"]
