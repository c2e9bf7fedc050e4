"""A model of PyTorch's CUDA caching allocator, to turn a step's allocations and frees into reserved memory.

``torch.cuda.max_memory_reserved`` (and nvidia-smi, and an out-of-memory error) count the segments the caching
allocator holds from the device, not the tensors alive in them. This module replays a sequence of allocations and
frees through the rules of torch's native allocator (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.13):

- a request is rounded up to a multiple of 512 bytes (or, with ``roundup_power2_divisions``, to a division of its
  power-of-two interval);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large pool,
  which reserves 20 MiB for a request under 10 MiB and the request rounded up to 2 MiB otherwise;
- a free block is found best fit, by (stream, size, address): a stream's blocks serve that stream only;
- a found block is split when what remains is at least 512 bytes (small pool, or expandable segments), or more
  than 1 MiB for a request below ``max_split_size_mb`` (large pool); a block of ``max_split_size_mb`` or more
  serves no smaller request and a larger one only within ``max_non_split_rounding_mb`` (20 MiB by default);
- a freed block merges with free neighbours of its segment; segments are kept, never returned, unless a request
  would exceed the device's memory: then the allocator frees cached blocks (whole segments, or the free pages of
  an expandable segment) and tries again;
- with ``expandable_segments:True`` each stream and pool has one segment that grows by mapping pages (2 MiB for
  the small pool, 20 MiB for the large), at the lowest address where the request fits;
- ``garbage_collection_threshold`` frees the oldest unused unsplit segments before a new one, only when a
  per-process memory fraction is set (``per_process_memory_fraction`` or
  ``torch.cuda.set_per_process_memory_fraction``); without one torch ignores it.

Not modelled: cross-stream uses recorded with ``record_stream`` (a block freed while another stream uses it is
held until that stream's work ends), CUDA graphs' private pools, and the ``cudaMallocAsync`` back end.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from torchtitan.errors import UserError

MIB = 2**20
MIN_BLOCK = 512  # every request rounds up to a multiple of this
SMALL_SIZE = 1 * MIB  # the largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # the small pool's segment (and an expandable small segment's page)
MIN_LARGE_ALLOC = 10 * MIB  # requests below this share a LARGE_BUFFER segment
LARGE_BUFFER = 20 * MIB  # ... of this size (also an expandable large segment's page)
ROUND_LARGE = 2 * MIB  # larger requests reserve a segment of their size rounded up to this
NO_LIMIT = 2**63  # max_split_size when unset
# An expandable segment reserves address space only; each is given this much so that addresses never collide.
_ADDRESS_SPACE = 2**48

# PYTORCH_CUDA_ALLOC_CONF keys that change nothing this model counts (pinned host memory, locking, CUDA graphs).
_KEYS_WITHOUT_DEVICE_MEMORY = (
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
)


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings that change reserved memory, as ``PYTORCH_CUDA_ALLOC_CONF`` gives them."""

    expandable_segments: bool = False
    max_split_size: int = NO_LIMIT
    max_non_split_rounding: int = LARGE_BUFFER
    roundup_power2_divisions: int = 0
    garbage_collection_threshold: float = 0.0
    memory_fraction: float = 0.0  # 0: none set, the whole device
    text: str = ""  # as given, for the report

    @property
    def label(self) -> str:
        return self.text or "(torch's defaults)"


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """``key:value,key:value`` as torch reads ``PYTORCH_CUDA_ALLOC_CONF``; UserError for a key torch does not know
    or a value this model cannot follow."""
    config = AllocatorConfig(text=text.strip())
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        key, colon, value = (part.strip() for part in entry.partition(":"))
        if not colon or not value:
            raise UserError(f"PYTORCH_CUDA_ALLOC_CONF entry '{entry}' needs key:value, e.g. expandable_segments:True")
        config = _with_setting(config, key, value, entry)
    return config


def _with_setting(config: AllocatorConfig, key: str, value: str, entry: str) -> AllocatorConfig:
    where = f"PYTORCH_CUDA_ALLOC_CONF '{entry}'"
    if key in _KEYS_WITHOUT_DEVICE_MEMORY:
        return config
    if key == "backend":
        if value != "native":
            raise UserError(f"{where}: memory is estimated for the native caching allocator; use backend:native")
        return config
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise UserError(f"{where}: expandable_segments takes True or False")
        return replace(config, expandable_segments=value == "True")
    if key == "roundup_power2_divisions":
        if not value.isdigit() or (int(value) & (int(value) - 1)):
            raise UserError(f"{where}: the estimate follows one power-of-two number of divisions (e.g. 4)")
        return replace(config, roundup_power2_divisions=int(value))
    if key not in (
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "per_process_memory_fraction",
    ):
        raise UserError(
            f"{where}: unknown key '{key}'; torch's keys include expandable_segments, max_split_size_mb, "
            "garbage_collection_threshold, roundup_power2_divisions"
        )
    number = _number(where, value)
    if key == "max_split_size_mb":
        if number * MIB <= LARGE_BUFFER:
            raise UserError(f"{where}: torch requires max_split_size_mb above {LARGE_BUFFER // MIB}")
        return replace(config, max_split_size=int(number * MIB))
    if key == "max_non_split_rounding_mb":
        return replace(config, max_non_split_rounding=int(number * MIB))
    if key == "garbage_collection_threshold":
        if not 0.0 < number < 1.0:
            raise UserError(f"{where}: garbage_collection_threshold must be between 0 and 1")
        return replace(config, garbage_collection_threshold=number)
    if not 0.0 < number <= 1.0:
        raise UserError(f"{where}: per_process_memory_fraction must be in (0, 1]")
    return replace(config, memory_fraction=number)


def _number(where: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{where}: '{value}' is not a number") from None


def round_size(size: int, config: AllocatorConfig) -> int:
    """The bytes a request of ``size`` takes (torch's ``round_size``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.roundup_power2_divisions
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor // divisions
        return -(-size // step) * step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment a new request of (rounded) ``size`` reserves without expandable segments."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


# ----------------------------------------------------------------------------------------------------------------
# Blocks and pools


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    stream: int
    pool: "_Pool"
    expandable: bool = False
    page: int = 0  # an expandable segment's mapping granularity
    mapped: bool = True
    allocated: bool = False
    prev: Optional["_Block"] = None
    next: Optional["_Block"] = None
    gc_base: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def _split(block: _Block, size: int, mapped: bool = True) -> _Block:
    """Cut ``block`` at ``size`` bytes: it keeps the first part, and the rest (returned, for its pool) follows it."""
    rest = _Block(
        block.addr + size,
        block.size - size,
        block.stream,
        block.pool,
        block.expandable,
        block.page,
        mapped=mapped,
        prev=block,
        next=block.next,
    )
    if block.next is not None:
        block.next.prev = rest
    block.next = rest
    block.size = size
    return rest


@dataclass(eq=False)
class _Pool:
    small: bool
    free: list = field(default_factory=list)  # sorted keys (stream, size, addr) of free mapped blocks
    unmapped: list = field(default_factory=list)  # sorted keys (stream, addr) of unmapped blocks
    blocks: dict = field(default_factory=dict)  # addr -> free or unmapped block
    get_free_calls: int = 0

    def insert(self, block: _Block) -> None:
        block.gc_base = self.get_free_calls
        bisect.insort(self.free, block.key)
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self.free[bisect.bisect_left(self.free, block.key)]
        del self.blocks[block.addr]

    def insert_unmapped(self, block: _Block) -> None:
        bisect.insort(self.unmapped, (block.stream, block.addr))
        self.blocks[block.addr] = block

    def remove_unmapped(self, block: _Block) -> None:
        del self.unmapped[bisect.bisect_left(self.unmapped, (block.stream, block.addr))]
        del self.blocks[block.addr]


class OutOfMemory(Exception):
    """A request the device cannot hold even after the allocator frees its cached blocks."""


class CachingAllocator:
    """Reserved and allocated bytes of torch's native CUDA caching allocator, followed request by request.

    ``capacity`` is the device's memory in bytes (None: unlimited, so nothing is ever freed back); a memory fraction
    in ``config`` limits it further, as ``set_per_process_memory_fraction`` does.
    """

    def __init__(self, config: AllocatorConfig, capacity: Optional[int] = None) -> None:
        self.config = config
        self.capacity = capacity
        self.limit = NO_LIMIT if capacity is None else capacity
        self.fraction_set = config.memory_fraction > 0 and capacity is not None
        if self.fraction_set:
            self.limit = int(config.memory_fraction * capacity)
        self.small, self.large = _Pool(small=True), _Pool(small=False)
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.segments = 0  # cudaMalloc calls or page mappings
        self.retries = 0  # times cached blocks were freed to make room
        self._next_addr = itertools.count(step=_ADDRESS_SPACE)

    # -- the public operations --------------------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> _Block:
        size = round_size(size, self.config)
        pool = self.small if size <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.fraction_set and self.config.garbage_collection_threshold > 0:
                self._garbage_collect()
            block = (
                self._alloc_block(pool, size, stream)
                or (self._release_available(pool, size, stream) and self._alloc_block(pool, size, stream))
                or (self._release_cached() and self._alloc_block(pool, size, stream, retry=True))
            )
        if block is None:
            raise OutOfMemory(f"a request of {size} bytes with {self.reserved} reserved, {self.allocated} allocated")
        if self._should_split(block, size):
            pool.insert(_split(block, size))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        pool = block.pool
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        self._release_cached()

    # -- finding a block --------------------------------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> Optional[_Block]:
        if self.fraction_set and self.config.garbage_collection_threshold > 0:
            pool.get_free_calls += 1
        index = bisect.bisect_left(pool.free, (stream, size, -1))
        if index == len(pool.free) or pool.free[index][0] != stream:
            return None
        block = pool.blocks[pool.free[index][2]]
        if block.expandable:
            # Best fit counts what an expandable block could grow into (its unmapped neighbour).
            def reach(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            later = index + 1
            while block.expandable and later < len(pool.free) and pool.free[later][0] == stream:
                candidate = pool.blocks[pool.free[later][2]]
                if reach(candidate) >= reach(block):
                    break
                block, later = candidate, later + 1
        max_split = self.config.max_split_size
        if size < max_split and block.size >= max_split:
            return None
        if size >= max_split and block.size >= size + self.config.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.max_split_size and remaining > SMALL_SIZE

    def _merge(self, block: _Block, other: Optional[_Block], pool: _Pool) -> None:
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        if other.mapped:
            pool.remove(other)
        else:
            pool.remove_unmapped(other)
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
        block.size += other.size

    # -- new memory -------------------------------------------------------------------------------------------

    def _alloc_block(self, pool: _Pool, size: int, stream: int, retry: bool = False) -> Optional[_Block]:
        if retry:
            self.retries += 1
        if self.config.expandable_segments:
            return self._alloc_expandable(pool, size, stream)
        nbytes = segment_size(size)
        if self.reserved + nbytes > self.limit:
            return None
        self._reserve(nbytes)
        return _Block(next(self._next_addr), nbytes, stream, pool)

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _alloc_expandable(self, pool: _Pool, size: int, stream: int) -> Optional[_Block]:
        candidate = self._find_expandable(pool, size, stream)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map(following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # mapping merged it with the free block before it
        pool.remove(candidate)
        return candidate

    def _find_expandable(self, pool: _Pool, size: int, stream: int) -> _Block:
        def usable(b: Optional[_Block]) -> bool:
            return b is not None and not b.allocated

        def has_room(b: Optional[_Block]) -> bool:
            room = 0
            while room < size and usable(b):
                room += b.size
                b = b.next
            return room >= size

        start = bisect.bisect_left(pool.unmapped, (stream, -1))
        for key in pool.unmapped[start:]:
            if key[0] != stream:
                break
            candidate = pool.blocks[key[1]]
            if usable(candidate.prev):
                candidate = candidate.prev
            if has_room(candidate):
                return candidate
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        segment = _Block(next(self._next_addr), _ADDRESS_SPACE, stream, pool, True, page, mapped=False)
        pool.insert_unmapped(segment)
        return segment

    def _map(self, block: _Block, size: int) -> bool:
        """Map pages at the start of unmapped ``block`` covering ``size`` bytes, merged with free neighbours."""
        nbytes = -(-size // block.page) * block.page
        if self.reserved + nbytes > self.limit:
            return False
        pool = block.pool
        pool.remove_unmapped(block)
        block.mapped = True
        if nbytes < block.size:
            pool.insert_unmapped(_split(block, nbytes, mapped=False))
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(nbytes)
        return True

    # -- giving memory back -----------------------------------------------------------------------------------

    def _release(self, block: _Block) -> None:
        block.pool.remove(block)
        self.reserved -= block.size

    def _release_available(self, pool: _Pool, size: int, stream: int) -> bool:
        """Free oversize cached blocks (max_split_size or more), as few as cover the request."""
        max_split = self.config.max_split_size
        if max_split == NO_LIMIT:
            return False
        wanted = max(size, max_split)
        index = bisect.bisect_left(pool.free, (stream, wanted, -1))
        if index < len(pool.free) and pool.free[index][0] == stream:
            block = pool.blocks[pool.free[index][2]]
            if block.expandable:
                return False
            self._release(block)
            return True
        released = 0
        for key in reversed(pool.free[:index]):
            block = pool.blocks[key[2]]
            if released >= wanted or block.size < max_split or block.stream != stream or block.expandable:
                break
            released += block.size
            self._release(block)
        return released >= wanted

    def _release_cached(self) -> bool:
        """Free every unsplit cached segment, and unmap every free page of expandable segments."""
        for pool in (self.large, self.small):
            for block in [pool.blocks[key[2]] for key in pool.free]:
                if pool.blocks.get(block.addr) is not block or not block.mapped:
                    continue  # merged into a neighbour that was unmapped before it
                if block.expandable:
                    self._unmap(block)
                elif not block.is_split():
                    self._release(block)
        return True

    def _unmap(self, block: _Block) -> None:
        page, pool = block.page, block.pool
        first = -(-block.addr // page) * page
        last = (block.addr + block.size) // page * page
        if last <= first:
            return
        pool.remove(block)
        if first > block.addr:
            before = _Block(block.addr, first - block.addr, block.stream, pool, True, page, prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if last < block.addr + block.size:
            after = _Block(last, block.addr + block.size - last, block.stream, pool, True, page, prev=block, next=None)
            after.next = block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = first, last - first, False
        self.reserved -= block.size
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert_unmapped(block)

    def _garbage_collect(self) -> None:
        """Free unsplit cached large blocks older than average until reserved is below the threshold."""
        threshold = int(self.config.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large
        candidates = [pool.blocks[k[2]] for k in pool.free]
        candidates = [b for b in candidates if not b.is_split() and not b.expandable]
        reclaimed = 0
        while candidates and reclaimed < target:
            average = sum(pool.get_free_calls - b.gc_base for b in candidates) / len(candidates)
            old = [b for b in candidates if pool.get_free_calls - b.gc_base >= average]
            if not old:
                return
            for block in old:
                reclaimed += block.size
                self._release(block)
            candidates = [b for b in candidates if b not in old]


# ----------------------------------------------------------------------------------------------------------------
# Replaying a traced step


@dataclass(frozen=True)
class Event:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` == 0) of storage ``serial``, on ``stream``, in ``phase``."""

    serial: int
    nbytes: int
    stream: int
    phase: str

    @property
    def is_alloc(self) -> bool:
        return self.nbytes > 0


@dataclass
class Replay:
    """What the allocator holds over a replayed sequence: peaks of reserved and allocated bytes and their phases."""

    config: AllocatorConfig
    peak_reserved: int = 0
    peak_reserved_phase: str = ""
    peak_allocated: int = 0
    peak_allocated_phase: str = ""
    reserved_at_end: int = 0
    segments: int = 0
    retries: int = 0
    out_of_memory: str = ""  # where a capacity was given and the sequence did not fit


def replay(events: Iterable[Event], config: AllocatorConfig, capacity: Optional[int] = None) -> Replay:
    """Run ``events`` through a fresh :class:`CachingAllocator`. Frees of storages never allocated are ignored
    (they were made before the sequence began)."""
    allocator = CachingAllocator(config, capacity)
    result = Replay(config)
    live: dict[int, _Block] = {}
    for event in events:
        if not event.is_alloc:
            block = live.pop(event.serial, None)
            if block is not None:
                allocator.free(block)
            continue
        try:
            live[event.serial] = allocator.malloc(event.nbytes, event.stream)
        except OutOfMemory as e:
            result.out_of_memory = f"{event.phase}: {e}"
            break
        if allocator.reserved > result.peak_reserved:
            result.peak_reserved, result.peak_reserved_phase = allocator.reserved, event.phase
        if allocator.allocated > result.peak_allocated:
            result.peak_allocated, result.peak_allocated_phase = allocator.allocated, event.phase
    result.reserved_at_end = allocator.reserved
    result.segments, result.retries = allocator.segments, allocator.retries
    return result


OPTIMIZER_STEP = "optimizer step"  # the tracker's phase for the optimizer's step


def training_sequence(
    params: list[Event],
    state: list[Event],
    step: list[Event],
    steps: int = 2,
    lazy_state: bool = True,
    after: list[Event] = (),
) -> list[Event]:
    """A run's allocations and frees from one traced steady step: the parameters, then ``steps`` copies of
    ``step``, then ``after`` (a checkpoint save).

    What a step leaves alive (its gradients, its loss) is freed as the next step begins (``zero_grad``). With
    ``lazy_state`` the optimizer state is allocated where a fresh optimizer creates it, at the start of the first
    step's optimizer phase, in memory the forward and backward have used; otherwise before the first step (a
    resumed run, whose state is loaded first). Phases are named with their step: ``backward (step 2)``.
    """
    serials = itertools.count(1)
    sequence: list[Event] = []

    def emit(events: Iterable[Event], phase: Optional[str], renamed: dict[int, int]) -> None:
        for e in events:
            if e.is_alloc:
                renamed[e.serial] = serial = next(serials)
            else:
                serial = renamed.pop(e.serial, None)
                if serial is None:
                    continue  # a storage made before the traced step
            sequence.append(Event(serial, e.nbytes, e.stream, phase or e.phase))

    emit(params, "parameters", {})
    state_names: dict[int, int] = {}
    if not lazy_state:
        emit(state, "optimizer state", state_names)
    first_step_index = next((i for i, e in enumerate(step) if e.phase == OPTIMIZER_STEP), len(step))
    left: dict[int, int] = {}
    for index in range(1, steps + 1):
        start = f"step start (step {index})"
        for serial in left.values():
            sequence.append(Event(serial, 0, 0, start))
        renamed: dict[int, int] = {}
        for position, event in enumerate(step):
            if index == 1 and lazy_state and position == first_step_index:
                emit(state, f"{OPTIMIZER_STEP} (step 1, creating state)", state_names)
            emit((event,), f"{event.phase} (step {index})", renamed)
        if index == 1 and lazy_state and first_step_index == len(step):
            emit(state, f"{OPTIMIZER_STEP} (step 1, creating state)", state_names)
        left = renamed
    emit(after, None, {})
    return sequence
