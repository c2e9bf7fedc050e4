"""Quantized optimizer state in DCP checkpoints: restored bit for bit, without a float32 copy of all of it on the
device.

A checkpoint holds a quantized state (torchao's 8-/4-bit and float8 tensors) as plain float32 values shaped like the
parameter, so that it reshards and loads like any AdamW state (see ``torchao_adapter.portable_quantized_state``), and
beside them, under ``<key>.block_scales``, its block scales (``state_storage.block_scales``: the state's shape with
the last dimension counted in blocks). The blocks are the same in every layout (``state_storage.quantized_layout``),
so the scales reshard like the values, and a load quantizes each value with its saved block's scale: codes and
scales come back bit for bit, at the same layout or another. (Quantizing the values alone would take each block's
largest magnitude as its scale, which shrinks a signed block whose largest magnitude is negative on every
save and load.) A checkpoint written without scales loads within one re-quantization.

Dequantizing every state before DCP writes anything would raise the device's peak by 4 bytes per quantized element,
more than a 4-bit optimizer saves. Here the values are made one tensor at a time instead:

- saving: the optimizers' state dict holds a :class:`QuantizedEntry` per quantized state. DCP plans it as the float32
  tensor (or DTensor shard) it stands for, and :class:`QuantizedStateSavePlanner` dequantizes it when the writer
  asks for its data, which the writer copies to the host and drops before the next one (DCP keeps a rank's host
  copies until its file is written: host memory, like an async save's staging). An async save stages each entry to
  host memory (pinned where CUDA is available) one at a time, before the background write starts. The scales are
  small plain tensors (views of the live ones), saved as they are;
- loading: :func:`read_in_groups` reads the quantized states and their scales in groups of at most the largest
  state's float32 size (one DCP load per group, into float32 buffers) and quantizes each group into the live state
  before the next.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from torchtitan.distributed.utils import local_tensor
from torchtitan.optim.state.storage import block_scales, dequantized, is_quantized, quantize_with_scales

_SAVED_DTYPE = torch.float32  # what a checkpoint holds for a quantized state
SCALES_SUFFIX = ".block_scales"  # the key of a quantized state's block scales: the state's own key and this


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
        return _empty_like(self.source)

    def scales(self) -> Tensor:
        """The live state's block scales (a view; a DTensor laid out like the source when it is one)."""
        return block_scales(self.source)

    def empty_scales(self) -> Tensor:
        """An uninitialised tensor laid out like :meth:`scales`, for DCP to load the saved scales into."""
        return _empty_like(self.scales())

    def quantize_from(self, values: Tensor, scales: Tensor | None = None) -> None:
        """Quantize ``values`` (float32, laid out like the source) into the live state: with the saved block
        ``scales`` (laid out like :meth:`scales`) exactly as they were saved, without them as torchao quantizes."""
        if scales is None:
            self.local_source.copy_(local_tensor(values))
        else:
            quantize_with_scales(self.local_source, local_tensor(values), local_tensor(scales))

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


def _empty_like(template: Tensor) -> Tensor:
    """An uninitialised float32 tensor shaped and laid out like ``template`` (a DTensor when it is one)."""
    local = local_tensor(template)
    values = torch.empty(local.shape, dtype=_SAVED_DTYPE, device=local.device)
    if not isinstance(template, DTensor):
        return values
    return DTensor.from_local(
        values,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def entries_for_quantized(flat_state: dict[str, Any]) -> dict[str, Any]:
    """``flat_state`` with every quantized tensor replaced by a :class:`QuantizedEntry` for it, and its block scales
    beside it (key + ``SCALES_SUFFIX``)."""
    out: dict[str, Any] = {}
    for key, value in flat_state.items():
        if is_quantized(value):
            out[key] = QuantizedEntry(value)
            out[key + SCALES_SUFFIX] = out[key].scales()
        else:
            out[key] = value
    return out


def without_scales(flat_state: dict[str, Any]) -> dict[str, Any]:
    """``flat_state`` without the block scales that :func:`entries_for_quantized` put beside its quantized states."""
    return {key: value for key, value in flat_state.items() if not _is_scales_key(flat_state, key)}


def scales_keys(flat_state: dict[str, Any]) -> list[str]:
    """The keys of the block scales beside ``flat_state``'s quantized states."""
    return [key for key in flat_state if _is_scales_key(flat_state, key)]


def _is_scales_key(flat_state: dict[str, Any], key: str) -> bool:
    return key.endswith(SCALES_SUFFIX) and key.removesuffix(SCALES_SUFFIX) in flat_state


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
    called once with the entries and their block scales taken out of ``state`` (and put back after), then once per
    group of entries with float32 buffers for their values and scales, which are quantized into the live state
    (bit for bit, see :meth:`QuantizedEntry.quantize_from`) and freed before the next group is read. An entry whose
    scales are not in ``state`` (a checkpoint saved without them) is quantized from its values alone.

    Ranks may group differently (their shards, and which of them are quantized, differ), but a collective ``read``
    must run as often on each: ``agree_on_count(groups)`` returns the count all ranks use (their largest), and a rank
    with fewer groups reads nothing in the remaining calls.
    """
    entries = _take_entries(state, ())
    scales = _take_scales(state, entries)
    try:
        read(state)  # DCP also sets non-tensor values (hyperparameters) in these very dicts
    finally:
        _nested({**entries, **scales}, into=state)
    groups = list(entry_groups(entries))
    groups += [{}] * (agree_on_count(len(groups)) - len(groups))
    for group in groups:
        buffers = {path: entry.empty_values() for path, entry in group.items()}
        scale_buffers = {_scales_path(path): entry.empty_scales() for path, entry in group.items()}
        scale_buffers = {path: buffer for path, buffer in scale_buffers.items() if path in scales}
        read(_nested({**buffers, **scale_buffers}))
        for path, entry in group.items():
            entry.quantize_from(buffers[path], scale_buffers.get(_scales_path(path)))
        del buffers, scale_buffers


def _take_entries(state: dict[str, Any], prefix: tuple[str, ...]) -> dict[tuple[str, ...], QuantizedEntry]:
    """Remove every entry from ``state`` (nested dicts included); the removed entries by path."""
    taken: dict[tuple[str, ...], QuantizedEntry] = {}
    for key, value in list(state.items()):
        if isinstance(value, QuantizedEntry):
            taken[(*prefix, key)] = state.pop(key)
        elif isinstance(value, dict):
            taken.update(_take_entries(value, (*prefix, key)))
    return taken


def _scales_path(path: tuple[str, ...]) -> tuple[str, ...]:
    return (*path[:-1], path[-1] + SCALES_SUFFIX)


def _take_scales(
    state: dict[str, Any], entries: dict[tuple[str, ...], QuantizedEntry]
) -> dict[tuple[str, ...], Tensor]:
    """Remove the block scales beside ``entries`` from ``state``; the removed scales by path."""
    taken = {}
    for path in entries:
        level = state
        for key in path[:-1]:
            level = level[key]
        scales_key = path[-1] + SCALES_SUFFIX
        if scales_key in level:
            taken[_scales_path(path)] = level.pop(scales_key)
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
    """A flat state with every :class:`QuantizedEntry` replaced by the live (quantized) tensor it stands for (block
    scales kept as they are)."""
    return {key: value.source if isinstance(value, QuantizedEntry) else value for key, value in state.items()}


def plain_values(state: dict[str, Any]) -> dict[str, Any]:
    """A flat state with every :class:`QuantizedEntry` made into its float32 tensor (small states and tests)."""
    return {
        key: dequantized(value.source) if isinstance(value, QuantizedEntry) else value for key, value in state.items()
    }


__all__ = [
    "QuantizedEntry",
    "SCALES_SUFFIX",
    "scales_keys",
    "without_scales",
    "entry_sources",
    "QuantizedStateSavePlanner",
    "entries_for_quantized",
    "entry_groups",
    "read_in_groups",
    "plain_values",
    "stage_entries",
]
