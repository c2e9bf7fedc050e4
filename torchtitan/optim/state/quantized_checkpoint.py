"""Quantized optimizer state in DCP checkpoints, without a float32 copy of all of it on the device.

A checkpoint holds a quantized state (torchao's 8-/4-bit tensors) as plain float32 values shaped like the parameter,
so that it reshards and loads like any AdamW state (see ``torchao_adapter.portable_quantized_state``). Dequantizing
every state before DCP writes anything would raise the device's peak by 4 bytes per quantized element, more than a
4-bit optimizer saves. Here the values are made one tensor at a time instead:

- saving: the optimizers' state dict holds a :class:`QuantizedEntry` per quantized state. DCP plans it as the float32
  tensor (or DTensor shard) it stands for, and :class:`QuantizedStateSavePlanner` dequantizes it when the writer
  asks for its data, which the writer copies to the host and drops before the next one (DCP keeps a rank's host
  copies until its file is written: host memory, like an async save's staging). An async save stages each entry to
  host memory (pinned where CUDA is available) one at a time, before the background write starts;
- loading: :func:`read_in_groups` reads the quantized states in groups of at most the largest one's float32 size
  (one DCP load per group, into float32 buffers) and quantizes each group into the live state before the next.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from torchtitan.optim.state.storage import dequantized, is_quantized
from torchtitan.utils import local_tensor

_SAVED_DTYPE = torch.float32  # what a checkpoint holds for a quantized state


class QuantizedEntry:
    """A quantized state in a state dict to save or load: the float32 tensor it stands for, made on demand.

    ``source`` is the live quantized tensor (a DTensor when the parameter is one). For DCP it is the float32 tensor
    of the same shape and layout: ``__create_write_items__`` plans the same write items that tensor would get.
    """

    def __init__(self, source: Tensor, staged: Tensor | None = None) -> None:
        if not is_quantized(source):
            raise TypeError(f"QuantizedEntry needs a quantized state tensor, got {type(source).__name__}")
        self.source = source
        self._staged = staged  # the local values, copied to host memory (async saves)

    @property
    def local_source(self) -> Tensor:
        return local_tensor(self.source)

    @property
    def local_float32_bytes(self) -> int:
        """Bytes of this rank's values as float32: what reading or writing this entry briefly holds."""
        return self.local_source.numel() * _SAVED_DTYPE.itemsize

    def local_values(self) -> Tensor:
        """This rank's values as a new plain float32 tensor (or the staged host copy)."""
        if self._staged is not None:
            return self._staged
        return self.local_source.dequantize(_SAVED_DTYPE)

    def empty_values(self) -> Tensor:
        """An uninitialised float32 tensor (a DTensor with the source's layout) for DCP to load this state into."""
        local = torch.empty(self.local_source.shape, dtype=_SAVED_DTYPE, device=self.local_source.device)
        if not isinstance(self.source, DTensor):
            return local
        return DTensor.from_local(
            local,
            self.source.device_mesh,
            self.source.placements,
            run_check=False,
            shape=self.source.shape,
            stride=self.source.stride(),
        )

    def quantize_from(self, values: Tensor) -> None:
        """Quantize ``values`` (float32, laid out like the source) into the live state."""
        local = local_tensor(values)
        self.local_source.copy_(local)

    def staged(self) -> "QuantizedEntry":
        """The same entry with its local values copied to host memory now (pinned where CUDA is available)."""
        values = self.local_values()
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(values)
        return QuantizedEntry(self.source, staged=host)

    def __deepcopy__(self, memo: dict) -> "QuantizedEntry":
        # DCP's async stager deep-copies what is not a tensor. A staged entry is an immutable host snapshot, so
        # the copy is itself; an unstaged one would copy the live device state, which staging must never do.
        if self._staged is None:
            raise TypeError("a QuantizedEntry must be staged (QuantizedEntry.staged) before an async save copies it")
        return self

    # -- DCP's save protocol (as DTensor implements it) ----------------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=_SAVED_DTYPE, device="meta"))
        if isinstance(self.source, DTensor):
            chunks, kind = self.source.__create_chunk_list__(), WriteItemType.SHARD
        else:
            whole = ChunkStorageMetadata(offsets=torch.Size([0] * self.source.dim()), sizes=self.source.shape)
            chunks, kind = [whole], WriteItemType.TENSOR
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=kind,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.source.size()),
            )
            for chunk in chunks
        ]


class QuantizedStateSavePlanner(DefaultSavePlanner):
    """DCP's save planner, except that a :class:`QuantizedEntry`'s data is its float32 values, made when written."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        entry = self.state_dict.get(index.fqn)
        if isinstance(entry, QuantizedEntry):
            return entry.local_values()
        return super().lookup_object(index)


def entries_for_quantized(flat_state: dict[str, Any]) -> dict[str, Any]:
    """``flat_state`` with every quantized tensor replaced by a :class:`QuantizedEntry` for it."""
    return {key: QuantizedEntry(value) if is_quantized(value) else value for key, value in flat_state.items()}


def stage_entries(state: Any) -> Any:
    """``state`` (nested dicts) with every :class:`QuantizedEntry` staged to host memory, one at a time."""
    if isinstance(state, dict):
        return {key: stage_entries(value) for key, value in state.items()}
    return state.staged() if isinstance(state, QuantizedEntry) else state


def entry_groups(entries: dict[Any, QuantizedEntry]) -> Iterator[dict[Any, QuantizedEntry]]:
    """``entries`` in consecutive groups whose float32 size stays within the largest entry's."""
    budget = max((entry.local_float32_bytes for entry in entries.values()), default=0)
    group: dict[Any, QuantizedEntry] = {}
    used = 0
    for key, entry in entries.items():
        if group and used + entry.local_float32_bytes > budget:
            yield group
            group, used = {}, 0
        group[key] = entry
        used += entry.local_float32_bytes
    if group:
        yield group


def read_in_groups(
    state: dict[str, Any],
    read: Callable[[dict[str, Any]], None],
    agree_on_count: Callable[[int], int] = lambda count: count,
) -> None:
    """Fill a nested state dict in place through ``read``, its :class:`QuantizedEntry` values a group at a time.

    ``read(part)`` fills ``part`` (a state dict of the same nesting) in place, e.g. with one ``dcp.load``. It is
    called once with the entries taken out of ``state`` (and put back after), then once per group of entries with
    float32 buffers, which are quantized into the live state and freed before the next group is read.

    Ranks may group differently (their shards, and which of them are quantized, differ), but a collective ``read``
    must run as often on each: ``agree_on_count(groups)`` returns the count all ranks use (their largest), and a rank
    with fewer groups reads nothing in the remaining calls.
    """
    entries = _take_entries(state, ())
    try:
        read(state)  # DCP also sets non-tensor values (hyperparameters) in these very dicts
    finally:
        for path, entry in entries.items():
            _nested({path: entry}, into=state)
    groups = list(entry_groups(entries))
    groups += [{}] * (agree_on_count(len(groups)) - len(groups))
    for group in groups:
        buffers = {path: entry.empty_values() for path, entry in group.items()}
        read(_nested(buffers))
        for path, entry in group.items():
            entry.quantize_from(buffers[path])
        del buffers


def _take_entries(state: dict[str, Any], prefix: tuple[str, ...]) -> dict[tuple[str, ...], QuantizedEntry]:
    """Remove every entry from ``state`` (nested dicts included); the removed entries by path."""
    taken: dict[tuple[str, ...], QuantizedEntry] = {}
    for key, value in list(state.items()):
        if isinstance(value, QuantizedEntry):
            taken[(*prefix, key)] = state.pop(key)
        elif isinstance(value, dict):
            taken.update(_take_entries(value, (*prefix, key)))
    return taken


def _nested(values: dict[tuple[str, ...], Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """``values`` keyed by path, placed in nested dicts (``into``, or new ones)."""
    nested = {} if into is None else into
    for path, value in values.items():
        level = nested
        for key in path[:-1]:
            level = level.setdefault(key, {})
        level[path[-1]] = value
    return nested


def entry_sources(state: dict[str, Any]) -> dict[str, Any]:
    """A flat state with every :class:`QuantizedEntry` replaced by the live (quantized) tensor it stands for."""
    return {key: value.source if isinstance(value, QuantizedEntry) else value for key, value in state.items()}


def plain_values(state: dict[str, Any]) -> dict[str, Any]:
    """A flat state with every :class:`QuantizedEntry` made into its float32 tensor (small states and tests)."""
    return {
        key: dequantized(value.source) if isinstance(value, QuantizedEntry) else value for key, value in state.items()
    }


__all__ = [
    "QuantizedEntry",
    "entry_sources",
    "QuantizedStateSavePlanner",
    "entries_for_quantized",
    "entry_groups",
    "read_in_groups",
    "plain_values",
    "stage_entries",
]
