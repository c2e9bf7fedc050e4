"""Count the bytes of live tensor storage while a training step runs, with the peak and what made it.

Works the same on real and on fake tensors (``FakeTensorMode``), so that a step simulated without memory can be
checked against the same step run for real. Every storage is counted once, from the moment an operator returns a
tensor that uses it until Python frees it; storages that FSDP2 grows and shrinks with ``UntypedStorage.resize_``
(its gathered, unsharded parameters) are followed through their resizes.

With ``record_events``, it also keeps the sequence of allocations and frees (each storage's exact bytes and the
stream it was made on), which :mod:`torchtitan.estimation.allocator` replays through a model of the CUDA caching
allocator for the memory it reserves. Streams are told apart by the CPU's current stream: FSDP2 enters its
all-gather and reduce-scatter streams on the CPU device as it does on CUDA.

What it does not see: memory that kernels allocate internally and never hand back as a tensor (workspaces), and
communication buffers owned by the process-group backend.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from torchtitan.estimation.allocator import Event

# Categories of storage. "gathered_params" are storages FSDP2 resizes (unsharded parameters); "transient" is every
# other storage created while tracking: activations, gradients, temporaries, new optimizer state.
PARAMS, OPTIMIZER_STATE, GATHERED_PARAMS, TRANSIENT = "params", "optimizer_state", "gathered_params", "transient"

# DTensor works out its outputs' global shapes by running each operator once on fake tensors of the *global* size,
# inside this file. Those tensors are bookkeeping, not memory any rank holds.
_SHARDING_PROPAGATION_FILE = "_sharding_prop.py"
_MAX_FRAMES_TO_SCAN = 64

# The collective "wait" returns its input in eager mode, but its fake implementation returns a new tensor; answering
# it with the input keeps one storage per collective result, as on a real device.
_WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)


def _in_sharding_propagation() -> bool:
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES_TO_SCAN):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_SHARDING_PROPAGATION_FILE):
            return True
        frame = frame.f_back
    return False


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages a tensor holds: its own, or those of the plain tensors inside a wrapper subclass (DTensor,
    quantized optimizer state)."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        # Some inner attributes are not tensors (a DTensor also lists its device mesh).
        inner = [getattr(tensor, name) for name in inner_names]
        return [st for t in inner if isinstance(t, torch.Tensor) for st in storages_of(t)]
    return [tensor.untyped_storage()]


class LiveMemoryTracker(TorchDispatchMode):
    """Live storage bytes by category, their peak, and the phase and breakdown at the peak.

    ``round_to`` rounds each storage up to the allocator's block size (512 bytes on CUDA) so that many small tensors
    are not under-counted. ``record_events`` keeps every allocation and free in ``events`` (those of storages counted
    by :meth:`track_existing` in ``existing_events``, by category), with their unrounded bytes; storages are numbered
    from ``first_serial``. ``phase_peaks`` keeps each phase's most live bytes and their breakdown by category.
    """

    def __init__(self, round_to: int = 1, record_events: bool = False, first_serial: int = 1) -> None:
        super().__init__()
        self.round_to = round_to
        self.live: Counter[str] = Counter()
        self.peak = 0
        self.peak_phase = "setup"
        self.peak_breakdown: dict[str, int] = {}
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self.phase = "setup"
        self._tracked: dict[int, tuple[int, str, int]] = {}  # id(storage) -> (bytes, category, serial)
        self._original_resize = None
        self.record_events = record_events
        self.events: list[Event] = []
        self.existing_events: dict[str, list[Event]] = {}
        self._serials = itertools.count(first_serial)
        self._streams: dict[int, int] = {}
        self._stream_objects: list[object] = []  # kept alive so that their ids stay theirs

    # -- what is counted -------------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def _rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.round_to) * self.round_to

    def _stream(self) -> int:
        """The current stream as a small number (0: the first seen, the default stream in a step)."""
        stream = torch.cpu.current_stream()
        number = self._streams.get(id(stream))
        if number is None:
            number = self._streams[id(stream)] = len(self._streams)
            self._stream_objects.append(stream)
        return number

    def _allocation(self, nbytes: int, events: Optional[list[Event]] = None) -> int:
        """A new serial for an allocation of ``nbytes``, recorded in ``events`` (the step's by default)."""
        serial = next(self._serials)
        if self.record_events and nbytes > 0:
            (self.events if events is None else events).append(Event(serial, nbytes, self._stream(), self.phase))
        return serial

    def _free(self, serial: int, nbytes: int) -> None:
        if self.record_events and nbytes > 0:
            self.events.append(Event(serial, 0, 0, self.phase))

    def _count(self, storage: torch.UntypedStorage, category: str, events: Optional[list[Event]] = None) -> None:
        key = id(storage)
        if key in self._tracked:
            return
        raw = storage.nbytes()
        nbytes = self._rounded(raw)
        self._tracked[key] = (nbytes, category, self._allocation(raw, events))
        self.live[category] += nbytes
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        nbytes, category, serial = self._tracked.pop(key)
        self.live[category] -= nbytes
        self._free(serial, nbytes)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._tracked:
            self._count(storage, GATHERED_PARAMS)
            return
        old_bytes, old_category, serial = self._tracked[key]
        self._free(serial, old_bytes)
        raw = storage.nbytes()
        new_bytes = self._rounded(raw)
        self.live[old_category] -= old_bytes
        self.live[GATHERED_PARAMS] += new_bytes
        self._tracked[key] = (new_bytes, GATHERED_PARAMS, self._allocation(raw))
        self._note_peak()

    def track_existing(self, tensors: Iterable[Optional[torch.Tensor]], category: str) -> None:
        """Count tensors that were made before tracking started (parameters, optimizer state) in ``category``."""
        events = self.existing_events.setdefault(category, [])
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                for storage in storages_of(tensor):
                    self._count(storage, category, events)
        self._note_peak()

    def _note_peak(self) -> None:
        total = self.total
        if total > self.phase_peaks.get(self.phase, (-1,))[0]:
            self.phase_peaks[self.phase] = (total, {k: v for k, v in self.live.items() if v})
        if total > self.peak:
            self.peak = total
            self.peak_phase = self.phase
            self.peak_breakdown = self.phase_peaks[self.phase][1]

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    # -- dispatch --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor turn the call into operators on local shards; those come back through here.
            return NotImplemented
        if _WAIT_TENSOR is not None and func is _WAIT_TENSOR.default and isinstance(args[0], torch.Tensor):
            func(*args, **(kwargs or {}))
            return args[0]
        out = func(*args, **(kwargs or {}))
        if not _in_sharding_propagation():
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                    for storage in storages_of(leaf):
                        self._count(storage, TRANSIENT)
            self._note_peak()
        return out

    def __enter__(self):
        # FSDP2 allocates and frees its unsharded parameters by resizing storages, which no operator reports.
        self._original_resize = original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        # What is freed once tracking ends (the next step's zero_grad, an optimizer dropped) is not this sequence's.
        self.record_events = False
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)
