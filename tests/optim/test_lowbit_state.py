"""Low-bit optimizer state is the same in every layout and comes back from a checkpoint bit for bit.

- Save and load (through the checkpoint manager) restore every quantized state's codes and block scales exactly,
  however often: a signed block whose largest magnitude is negative used to shrink on every cycle (torchao's signed
  code tables end above -1), and a checkpoint written without the scales still loads within one quantization step.
- Which states are quantized is decided on the whole parameter: 3 FSDP ranks with uneven shards, some of them under
  torchao's 4,096-value threshold, hold the same quantized states as one process, the same bytes in all, and reach
  the same values.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests.distributed import run_workers
from tests.helpers import fsdp, full, job_config, materialize, meta_model, synthetic_grad
from torchtitan.checkpoint import CheckpointManager
from torchtitan.distributed.utils import local_tensor
from torchtitan.errors import UserError
from torchtitan.models.llama import ModelArgs
from torchtitan.optim import build_optimizers
from torchtitan.optim import container as container_module
from torchtitan.optim.state.quantized_checkpoint import QuantizedEntry, entries_for_quantized, without_scales
from torchtitan.optim.state.storage import is_quantized, quantized_layout

torchao_optim = pytest.importorskip(
    "torchao.optim", reason="needs torchao for the low-bit optimizers (the lowbit extra)"
)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

# 256 columns: a whole number of 8-bit (256) and 4-bit (128) blocks per row. 20 rows of vocabulary: the embedding and
# the output projection hold 5,120 values, which 3 ranks split into 7, 7 and 6 rows (1,792 values or fewer each).
ARGS = ModelArgs(
    dim=256, n_layers=1, n_heads=4, vocab_size=20, multiple_of=256, ffn_dim_multiplier=0.375, max_seq_len=8
)
OPTIMIZERS = {
    "AdamW8bit": {},
    "AdamW4bit": {},
    "AdamWFp8": {},
    "AdamMini8bit": {"implementation": "foreach"},
    "AdamMini4bit": {"implementation": "foreach"},
}
STEPS = 3
# The states that may be quantized. (Adam-mini's v has one value per block, and a head cut by uneven shards is a
# block on both ranks: its bytes follow Adam-mini's partition, not the quantization.)
MOMENTS = ("exp_avg", "exp_avg_sq", "m")


@pytest.fixture(autouse=True)
def _eager():
    """torchao's steps (and the state creation a checkpoint does) run eagerly: compiling would only add time."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _step(net, optimizers, steps: range) -> None:
    """The same whole gradients in every layout (laid out as the parameter), whatever the weights became."""
    with torch.compiler.set_stance("force_eager"):
        for step in steps:
            for name, p in net.named_parameters():
                grad = synthetic_grad(name, tuple(p.shape), step).to(p.dtype)
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
            optimizers.step()
            optimizers.zero_grad()


def _quantized_parts(optimizers) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's codes and block scales of every quantized state, copied."""
    entries = {k: v for k, v in optimizers.state_dict().items() if isinstance(v, QuantizedEntry)}
    return {k: (e.local_source.codes.clone(), e.local_source.scale.clone()) for k, e in entries.items()}


def _trainer(name: str, dump: str, seed: int):
    job = job_config(
        job={"dump_folder": dump},
        checkpoint={"enable_checkpoint": True, "folder": "checkpoint"},
        optimizer={"name": name, **OPTIMIZERS[name]},
    )
    net = materialize(meta_model(ARGS, torch.float32), seed=seed)
    optimizers = build_optimizers([net], job)
    return net, optimizers, CheckpointManager(None, [net], optimizers, None, {}, job)


def _negative_extreme_blocks(optimizers) -> int:
    """Blocks of signed states whose largest magnitude is negative (those that used to shrink on a reload)."""
    count = 0
    for state in optimizers.optimizers[0].state.values():
        for value in state.values():
            local = local_tensor(value)
            if is_quantized(local) and getattr(local, "signed", False):
                blocks = local.dequantize(torch.float32).reshape(-1, local.block_size)
                count += int((blocks.amin(1).abs() > blocks.amax(1)).sum())
    return count


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_five_save_load_cycles_restore_the_quantized_state_bit_for_bit(name, tmp_path):
    net, optimizers, manager = _trainer(name, str(tmp_path), seed=0)
    _step(net, optimizers, range(STEPS))
    original = _quantized_parts(optimizers)
    assert len(original) >= 6  # every matrix's state is quantized
    if "Fp8" not in name:
        assert _negative_extreme_blocks(optimizers) > 0  # blocks that a value-only reload would shrink
    for cycle in range(5):
        manager.save(STEPS + cycle, force=True)
        net, optimizers, manager = _trainer(name, str(tmp_path), seed=cycle + 1)
        assert manager.load(STEPS + cycle)
        loaded = _quantized_parts(optimizers)
        assert loaded.keys() == original.keys()
        for key, (codes, scales) in original.items():
            assert torch.equal(loaded[key][0], codes), (cycle, key)
            assert torch.equal(loaded[key][1], scales), (cycle, key)


def test_a_checkpoint_without_block_scales_loads_within_one_quantization_step(tmp_path, monkeypatch, caplog):
    net, optimizers, manager = _trainer("AdamW4bit", str(tmp_path), seed=0)
    _step(net, optimizers, range(STEPS))
    saved = {k: v.local_values() for k, v in optimizers.state_dict().items() if isinstance(v, QuantizedEntry)}
    # As an earlier version saved: the values alone.
    monkeypatch.setattr(
        container_module, "entries_for_quantized", lambda state: without_scales(entries_for_quantized(state))
    )
    manager.save(STEPS, force=True)
    monkeypatch.undo()
    net, optimizers, manager = _trainer("AdamW4bit", str(tmp_path), seed=1)
    with caplog.at_level(logging.WARNING):
        assert manager.load(STEPS)
    assert any("holds no block scales for" in record.getMessage() for record in caplog.records)
    loaded = {k: v.local_values() for k, v in optimizers.state_dict().items() if isinstance(v, QuantizedEntry)}
    assert loaded.keys() == saved.keys()
    codes = torch.tensor(torchao_optim.subclass_4bit.get_qmap_signed())
    shortfall = 1 + codes.min().item()  # how far the signed table ends above -1
    for key, value in saved.items():
        blocks, again = value.reshape(-1, 128), loaded[key].reshape(-1, 128)
        assert ((again - blocks).abs().amax(1) <= (shortfall + 0.2) * blocks.abs().amax(1) + 1e-12).all(), key
    assert any(not torch.equal(loaded[k], saved[k]) for k in saved)  # without the scales it is not exact


def _layout_worker(rank: int, world_size: int) -> bytes:
    """Per optimizer: which states are quantized, this rank's bytes of the moments that may be quantized (codes and
    scales, or plain values), and the full states and weights after a few steps; on 3 ranks, also what column
    splits into whole and part blocks say."""
    results = {}
    for name in OPTIMIZERS:
        net = materialize(meta_model(ARGS, torch.float32) if world_size == 1 else _sharded(world_size), seed=0)
        optimizers = build_optimizers([net], job_config(optimizer={"name": name, **OPTIMIZERS[name]}))
        _step(net, optimizers, range(STEPS))
        optimizer = optimizers.optimizers[0]
        names = {p: n for n, p in net.named_parameters()}
        results[name] = {
            "quantized": {(names[p], k): is_quantized(v) for p, s in optimizer.state.items() for k, v in s.items()},
            "bytes": sum(_payload_bytes(v) for s in optimizer.state.values() for k, v in s.items() if k in MOMENTS),
            "state": {
                (names[p], k): _dequantized_full(v)
                for p, s in optimizer.state.items()
                for k, v in s.items()
                if k != "step"
            },
            "weights": {n: full(p).detach().clone() for n, p in net.named_parameters()},
        }
    if world_size == 3:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        whole_blocks = distribute_tensor(torch.zeros(32, 3 * 256), mesh, [Shard(1)])  # parts of 256 columns
        results["column split into whole blocks"] = quantized_layout(whole_blocks, 256)
        part_blocks = distribute_tensor(torch.zeros(32, 4 * 256), mesh, [Shard(1)])  # parts of 342, 342, 340
        try:
            quantized_layout(part_blocks, 256)
        except UserError as e:
            results["column split into part blocks"] = str(e)
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


def _sharded(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return fsdp(meta_model(ARGS, torch.float32), init_device_mesh("cpu", (world_size,)))


def _payload_bytes(value) -> int:
    """Bytes of a state's values on this rank: codes and scales of a quantized one (its code table, which every rank
    holds whole, aside)."""
    local = local_tensor(value)
    if is_quantized(local):
        return local.codes.numel() * local.codes.element_size() + local.scale.numel() * local.scale.element_size()
    return local.numel() * local.element_size()


def _dequantized_full(value) -> torch.Tensor:
    local = local_tensor(value)
    values = local.dequantize(torch.float32) if is_quantized(local) else local.detach().clone()
    if local is value:
        return values
    return DTensor.from_local(
        values, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    ).full_tensor()


@pytest.fixture(scope="module")
def layouts():
    def unpack(data: bytes):
        return torch.load(io.BytesIO(data), weights_only=False)

    return {1: unpack(_layout_worker(0, 1)), 3: [unpack(r) for r in run_workers(_layout_worker, world_size=3)]}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_three_uneven_fsdp_ranks_hold_the_state_of_one_process(layouts, name):
    one = layouts[1][name]
    assert one["quantized"][("tok_embeddings.weight", "m" if "Mini" in name else "exp_avg")]  # 5,120 values
    for rank in layouts[3]:
        assert rank[name]["quantized"] == one["quantized"]  # even where a shard holds under 4,096 values
    assert sum(rank[name]["bytes"] for rank in layouts[3]) == one["bytes"]
    for rank in layouts[3]:
        state, weights = rank[name]["state"], rank[name]["weights"]
        for key, value in one["state"].items():
            if "Mini" in name and key[1] == "v":  # per-head sums, completed across ranks in another order
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=0)
            else:  # elementwise: the very same values
                assert torch.equal(state[key], value), key
        for key, value in one["weights"].items():
            tolerance = {"rtol": 1e-5, "atol": 1e-7} if "Mini" in name else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(weights[key], value, **tolerance)


def test_a_column_split_must_cut_whole_blocks(layouts):
    assert layouts[3][0]["column split into whole blocks"] is True
    message = layouts[3][0]["column split into part blocks"]
    assert "blocks of 256" in message and "parts of up to 342" in message and "--optimizer.block_size" in message


def test_the_decision_is_the_whole_parameters():
    assert quantized_layout(torch.empty(16, 256), 256)
    assert not quantized_layout(torch.empty(8, 256), 256)  # under 4,096 values
    assert not quantized_layout(torch.empty(4096), 256)  # one dimension: FSDP would cut its blocks
    assert not quantized_layout(torch.empty(64, 192), 128)  # rows are not whole blocks
