"""The caching-allocator model against sequences whose reserved memory is known from torch's rules by construction."""

from __future__ import annotations

import pytest

from torchtitan.errors import UserError
from torchtitan.estimation.allocator import (
    MIB,
    AllocatorConfig,
    CachingAllocator,
    Event,
    OutOfMemory,
    parse_alloc_conf,
    replay,
    round_size,
    training_sequence,
)

DEFAULT = AllocatorConfig()
EXPANDABLE = parse_alloc_conf("expandable_segments:True")


def test_small_requests_share_one_2_mib_segment_in_512_byte_blocks():
    a = CachingAllocator(DEFAULT)
    for _ in range(3):
        a.malloc(100)
    assert (a.reserved, a.allocated) == (2 * MIB, 3 * 512)


def test_requests_under_10_mib_are_packed_into_20_mib_segments():
    a = CachingAllocator(DEFAULT)
    for _ in range(4):
        a.malloc(5 * MIB)
    assert a.reserved == 20 * MIB
    a.malloc(5 * MIB)
    assert a.reserved == 40 * MIB


def test_a_large_request_reserves_its_size_rounded_to_2_mib_and_keeps_a_remainder_of_1_mib():
    a = CachingAllocator(DEFAULT)
    a.malloc(11 * MIB)
    # 12 MiB reserved; the 1 MiB left is not split off (a large block splits only above 1 MiB), so it is allocated.
    assert (a.reserved, a.allocated) == (12 * MIB, 12 * MIB)


def test_freed_neighbours_merge_into_one_block_that_serves_a_request_of_their_sum():
    a = CachingAllocator(DEFAULT)
    blocks = [a.malloc(5 * MIB) for _ in range(4)]
    for block in blocks:
        a.free(block)
    a.malloc(20 * MIB)
    assert a.reserved == 20 * MIB


def test_a_split_segment_leaves_a_remainder_a_larger_request_cannot_use():
    events = [Event(1, 100 * MIB, 0, "a"), Event(1, 0, 0, "a"), Event(2, 60 * MIB, 0, "b"), Event(3, 60 * MIB, 0, "c")]
    assert replay(events, DEFAULT).peak_reserved == 160 * MIB
    # Expandable segments grow the one segment by 20 MiB pages past the 40 MiB left free at its end.
    assert replay(events, EXPANDABLE).peak_reserved == 120 * MIB
    result = replay(events, DEFAULT)
    assert (result.peak_allocated, result.peak_allocated_phase, result.peak_reserved_phase) == (120 * MIB, "c", "c")


def test_each_stream_has_its_own_blocks():
    events = [Event(1, 100 * MIB, 1, "all-gather"), Event(1, 0, 0, "all-gather"), Event(2, 100 * MIB, 0, "forward")]
    assert replay(events, DEFAULT).peak_reserved == 200 * MIB
    assert replay([*events[:2], Event(2, 100 * MIB, 1, "forward")], DEFAULT).peak_reserved == 100 * MIB


def test_max_split_size_keeps_oversize_blocks_from_smaller_requests():
    freed = [Event(1, 100 * MIB, 0, "a"), Event(1, 0, 0, "a")]
    split_limit = parse_alloc_conf("max_split_size_mb:64")
    assert replay([*freed, Event(2, 30 * MIB, 0, "b")], DEFAULT).peak_reserved == 100 * MIB
    assert replay([*freed, Event(2, 30 * MIB, 0, "b")], split_limit).peak_reserved == 130 * MIB
    # A request above the limit takes an oversize block only within 20 MiB of its size, unsplit.
    assert replay([*freed, Event(2, 70 * MIB, 0, "b")], split_limit).peak_reserved == 170 * MIB
    within = replay([*freed, Event(2, 85 * MIB, 0, "b")], split_limit)
    assert (within.peak_reserved, within.peak_allocated) == (100 * MIB, 100 * MIB)


def test_near_the_device_limit_cached_segments_are_freed_before_a_new_one():
    events = [Event(1, 100 * MIB, 0, "a"), Event(1, 0, 0, "a"), Event(2, 120 * MIB, 0, "b")]
    assert replay(events, DEFAULT).peak_reserved == 220 * MIB
    tight = replay(events, DEFAULT, capacity=150 * MIB)
    assert (tight.peak_reserved, tight.retries, tight.out_of_memory) == (120 * MIB, 1, "")
    assert "b:" in replay([*events, Event(3, 40 * MIB, 0, "b")], DEFAULT, capacity=150 * MIB).out_of_memory


def test_expandable_segments_unmap_free_pages_near_the_device_limit():
    events = [Event(1, 100 * MIB, 0, "a"), Event(1, 0, 0, "a"), Event(2, 30 * MIB, 1, "b")]
    assert replay(events, EXPANDABLE).peak_reserved == 140 * MIB
    assert replay(events, EXPANDABLE, capacity=120 * MIB).peak_reserved == 100 * MIB


def test_garbage_collection_frees_old_segments_only_under_a_memory_fraction():
    events = [Event(1, 200 * MIB, 0, "a"), Event(1, 0, 0, "a"), Event(2, 300 * MIB, 0, "b")]
    collecting = parse_alloc_conf("garbage_collection_threshold:0.1,per_process_memory_fraction:1.0")
    assert replay(events, collecting, capacity=1000 * MIB).peak_reserved == 300 * MIB
    without_fraction = parse_alloc_conf("garbage_collection_threshold:0.1")
    assert replay(events, without_fraction, capacity=1000 * MIB).peak_reserved == 500 * MIB


def test_rounding_to_power_of_two_divisions():
    assert round_size(1100, DEFAULT) == 1536
    assert round_size(1100 * MIB, parse_alloc_conf("roundup_power2_divisions:4")) == 1280 * MIB
    assert round_size(1024 * MIB, parse_alloc_conf("roundup_power2_divisions:4")) == 1024 * MIB


@pytest.mark.parametrize(
    "text, message",
    [
        ("expandable_segment:True", "unknown key 'expandable_segment'"),
        ("expandable_segments:yes", "True or False"),
        ("max_split_size_mb:10", "above 20"),
        ("garbage_collection_threshold:1.5", "between 0 and 1"),
        ("backend:cudaMallocAsync", "backend:native"),
        ("expandable_segments", "key:value"),
    ],
)
def test_settings_the_model_cannot_follow_are_refused(text, message):
    with pytest.raises(UserError, match=message):
        parse_alloc_conf(text)


def test_settings_without_device_memory_effect_are_accepted():
    config = parse_alloc_conf("expandable_segments:True,release_lock_on_cudamalloc:True")
    assert config.expandable_segments and config.label == "expandable_segments:True,release_lock_on_cudamalloc:True"


def test_out_of_memory_is_raised_by_the_allocator_itself():
    with pytest.raises(OutOfMemory):
        CachingAllocator(DEFAULT, capacity=10 * MIB).malloc(20 * MIB)


# ----------------------------------------------------------------------------------------------------------------
# A run's sequence from one traced step


def test_a_run_frees_what_a_step_leaves_as_the_next_begins_and_creates_lazy_state_in_the_first_step():
    params = [Event(1, 100, 0, "setup")]
    state = [Event(2, 200, 0, "setup")]
    step = [
        Event(10, 50, 0, "forward"),  # an activation, freed in backward
        Event(11, 100, 0, "backward"),  # the gradient, alive after the step
        Event(10, 0, 0, "backward"),
        Event(12, 30, 0, "optimizer step"),  # a temporary
        Event(12, 0, 0, "optimizer step"),
        Event(99, 0, 0, "forward"),  # a storage made before the traced step: ignored
    ]
    sequence = training_sequence(params, state, step, steps=2)
    phases = [(e.phase, e.nbytes) for e in sequence]
    assert phases == [
        ("parameters", 100),
        ("forward (step 1)", 50),
        ("backward (step 1)", 100),
        ("backward (step 1)", 0),
        ("optimizer step (step 1, creating state)", 200),
        ("optimizer step (step 1)", 30),
        ("optimizer step (step 1)", 0),
        ("step start (step 2)", 0),  # step 1's gradient
        ("forward (step 2)", 50),
        ("backward (step 2)", 100),
        ("backward (step 2)", 0),
        ("optimizer step (step 2)", 30),
        ("optimizer step (step 2)", 0),
    ]
    # Every free names a live allocation: the replay's allocated bytes return to parameters + state + gradient.
    allocator_view = replay(sequence, DEFAULT)
    assert allocator_view.peak_allocated == 512 * 4  # parameters, state, gradient and one of activation/temporary
    resumed = training_sequence(params, state, step, steps=1, lazy_state=False)
    assert resumed[1].phase == "optimizer state"
