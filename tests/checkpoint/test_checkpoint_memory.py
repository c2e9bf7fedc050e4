"""A checkpoint save or load raises live tensor memory by about one state tensor's float32 copy, whatever the
optimizer: low-bit optimizers never hold a float32 copy of all their quantized state.

Measured with the memory estimator's tracker around ``CheckpointManager.save`` and ``load`` (one process, a tiny
model whose matrices all have quantized state). On a GPU, DCP's writer copies each tensor to host memory and keeps
those host copies until the rank's file is written: that is DCP's staging, not device memory. On a CPU the device is
the host, so the tracker moves the tensors the writer keeps into a category of their own, and the device figure is
what remains.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from tests.helpers import job_config, materialize, meta_model
from torchtitan.checkpoint import CheckpointManager, SafeFileSystemReader
from torchtitan.estimation.simulate import checkpoint_save_peak
from torchtitan.estimation.tracker import OPTIMIZER_STATE, PARAMS, TRANSIENT, LiveMemoryTracker
from torchtitan.models.llama import ModelArgs
from torchtitan.optim import build_optimizers
from torchtitan.optim.container import tensor_bytes
from torchtitan.optim.state.quantized_checkpoint import QuantizedEntry, entry_groups, read_in_groups
from torchtitan.training.guard import DivergenceError

# An async save's background thread writes without a process group, as a single-process run should.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
pytest.importorskip("torchao.optim", reason="needs torchao for the low-bit optimizers (the lowbit extra)")

# Every matrix 256 columns wide and at least 4096 entries, so that every matrix's state is quantized; two layers, so
# that all quantized state together is many times its largest tensor.
ARGS = ModelArgs(
    dim=256, n_layers=2, n_heads=4, vocab_size=128, multiple_of=256, ffn_dim_multiplier=0.375, max_seq_len=8
)
OPTIMIZERS = {
    "AdamW": {},
    "AdamMini": {"implementation": "foreach"},
    "AdamMini8bit": {"implementation": "foreach"},
    "AdamW4bit": {},
    "AdamWFp8": {},
}
HOST_STAGING = "host_staging"  # tensors DCP's writer keeps until the file is written
PLAIN_DATA_BYTES = 64 * 1024  # job facts, hyperparameters, the writer's small buffers


class DeviceMemory(LiveMemoryTracker):
    """The tracker, with the tensors handed to DCP's writer counted as host staging; ``device_peak`` without them."""

    def __init__(self) -> None:
        super().__init__()
        self.device_peak = 0

    def staged(self, tensor: torch.Tensor) -> None:
        """A tensor the writer keeps: one made for the save (on a GPU, its host copy); weights stay where they are."""
        key = id(tensor.untyped_storage())
        if key in self._tracked and self._tracked[key][1] == TRANSIENT:
            nbytes, category, serial = self._tracked[key]
            self.live[category] -= nbytes
            self.live[HOST_STAGING] += nbytes
            self._tracked[key] = (nbytes, HOST_STAGING, serial)

    def _note_peak(self) -> None:
        super()._note_peak()
        self.device_peak = max(self.device_peak, self.total - self.live[HOST_STAGING])


def _job(name: str, dump: str, async_mode: str):
    return job_config(
        job={"dump_folder": dump},
        checkpoint={"enable_checkpoint": True, "folder": "checkpoint", "async_mode": async_mode},
        optimizer={"name": name, **OPTIMIZERS[name]},
    )


def _trainer(name: str, dump: str, async_mode: str = "disabled"):
    job = _job(name, dump, async_mode)
    net = materialize(meta_model(ARGS, torch.float32))
    optimizers = build_optimizers([net], job)
    # The state as a fresh optimizer has it; torchao's step runs eagerly here (its compile would only add time).
    with torch.compiler.set_stance("force_eager"):
        optimizers.state_dict()
    return net, optimizers, CheckpointManager(None, [net], optimizers, None, {}, job)


def _measure(net, optimizers, action, monkeypatch) -> int:
    """The rise of device memory (live tensors, host staging excluded) while ``action`` runs."""
    tracker = DeviceMemory()
    write_item = dcp_filesystem._write_item

    def staging_write_item(transforms, stream, data, *args, **kwargs):
        if isinstance(data, torch.Tensor):
            tracker.staged(data)
        return write_item(transforms, stream, data, *args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", staging_write_item)
    with tracker:
        tracker.track_existing(net.parameters(), PARAMS)
        state = [v for optimizer in optimizers for s in optimizer.state.values() for v in s.values()]
        tracker.track_existing(state, OPTIMIZER_STATE)
        before = tracker.total
        tracker.device_peak = before
        action()
    return tracker.device_peak - before


def _quantized(optimizers) -> dict[str, QuantizedEntry]:
    return {k: v for k, v in optimizers.state_dict().items() if isinstance(v, QuantizedEntry)}


def _randomize(entries: dict[str, QuantizedEntry], seed: int) -> dict[str, torch.Tensor]:
    """Quantize random values into every entry's live state; the float32 values it then holds."""
    generator = torch.Generator().manual_seed(seed)
    for entry in entries.values():
        entry.quantize_from(torch.randn(entry.source.shape, generator=generator))
    return {k: entry.local_values() for k, entry in entries.items()}


def _assert_requantized(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():  # quantized again: within a quarter of the block scale (8- and 4-bit)
        assert (loaded[key] - value).abs().max() <= 0.25 * value.abs().max(), key


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_save_and_load_raise_memory_by_about_one_tensor(name, tmp_path, monkeypatch):
    net, optimizers, manager = _trainer(name, str(tmp_path))
    entries = _quantized(optimizers)
    saved = _randomize(entries, seed=0)
    largest_state = max(value.numel() * 4 for value in optimizers.state_dict().values() if hasattr(value, "numel"))

    resident = sum(tensor_bytes(t) for t in [*net.parameters(), *net.buffers()]) + optimizers.state_bytes()
    estimated_rise = checkpoint_save_peak(net, optimizers, round_to=1) - resident
    save_rise = _measure(net, optimizers, lambda: manager.save(1, force=True), monkeypatch)
    # estimation.py's figure for the save is what the save does (its plain-data bytes aside).
    assert abs(save_rise - estimated_rise) <= PLAIN_DATA_BYTES, (save_rise, estimated_rise)
    fresh_net, fresh_optimizers, fresh_manager = _trainer(name, str(tmp_path))
    load_rise = _measure(fresh_net, fresh_optimizers, lambda: fresh_manager.load(1), monkeypatch)

    if name in ("AdamW", "AdamMini"):
        assert not entries
        assert save_rise <= PLAIN_DATA_BYTES
        # DCP reads one tensor into host memory, unpickles it, and copies it into place before the next.
        assert load_rise <= 2 * largest_state + PLAIN_DATA_BYTES
        return
    float32_all = sum(entry.local_float32_bytes for entry in entries.values())
    float32_largest = max(entry.local_float32_bytes for entry in entries.values())
    assert float32_all > 8 * float32_largest  # a float32 copy of all quantized state would break the bounds below
    # Dequantizing one tensor holds its float32 values, the float32 code values they are scaled from, and (4-bit)
    # the codes unpacked to a byte each: 2.25 times its float32 size. Loading holds one group's float32 buffers and
    # the tensor DCP reads into them.
    assert save_rise <= 2.25 * float32_largest + PLAIN_DATA_BYTES, (save_rise, float32_largest)
    assert load_rise <= 2 * float32_largest + PLAIN_DATA_BYTES, (load_rise, float32_largest)
    _assert_requantized({k: entry.local_values() for k, entry in _quantized(fresh_optimizers).items()}, saved)


def test_async_save_holds_the_quantized_state_of_its_step(tmp_path):
    """The background write sees the state as it was when save returned, not as training changed it since."""
    _, optimizers, manager = _trainer("AdamMini8bit", str(tmp_path), async_mode="async")
    entries = _quantized(optimizers)
    saved = _randomize(entries, seed=0)
    manager.save(1, force=True)
    _randomize(entries, seed=1)  # the next steps, while the save may still be writing
    manager.close()
    _, fresh_optimizers, fresh_manager = _trainer("AdamMini8bit", str(tmp_path))
    assert fresh_manager.load(1)
    _assert_requantized({k: entry.local_values() for k, entry in _quantized(fresh_optimizers).items()}, saved)


@pytest.mark.parametrize("name", ["AdamMini8bit", "AdamWFp8"])
def test_a_non_finite_quantized_state_is_not_saved(name, tmp_path):
    """The divergence check sees a quantized state's parts: a NaN block scale (8-bit) or code (FP8) refuses the save."""
    _, optimizers, manager = _trainer(name, str(tmp_path))
    source = next(iter(_quantized(optimizers).values())).local_source
    float_parts = [getattr(source, part) for part in source.__tensor_flatten__()[0]]
    part = next(p for p in float_parts if p.is_floating_point() and p.numel() > 1)  # the scales, or FP8's codes
    part.view(-1)[0] = float("nan")
    with pytest.raises(DivergenceError):
        manager.save(1, force=True)
    assert not os.listdir(manager.folder)


def test_ranks_with_fewer_groups_read_nothing_in_the_extra_calls(tmp_path):
    """Each rank groups its own shards; every rank reads as often as the one with most groups (DCP is collective)."""
    _, optimizers, manager = _trainer("AdamMini8bit", str(tmp_path))
    saved = _randomize(_quantized(optimizers), seed=0)
    manager.save(1, force=True)
    _, fresh, _ = _trainer("AdamMini8bit", str(tmp_path))
    state, parts = {"optimizer": fresh.state_dict()}, []

    def read(part):
        parts.append(part)
        dcp.load(part, storage_reader=SafeFileSystemReader(os.path.join(manager.folder, "step-1")))

    groups = len(list(entry_groups(_quantized(fresh))))
    read_in_groups(state, read, agree_on_count=lambda count: count + 2)
    assert len(parts) == 1 + groups + 2 and parts[-2:] == [{}, {}]
    fresh.load_state_dict(state["optimizer"])
    _assert_requantized({k: entry.local_values() for k, entry in _quantized(fresh).items()}, saved)
