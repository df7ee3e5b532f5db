from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric._runtime.slots import SlotAllocator


def test_allocates_until_full_then_refuses() -> None:
    alloc = SlotAllocator(1024, align=64)
    offsets = [alloc.allocate(256) for _ in range(4)]
    assert sorted(o for o in offsets if o is not None) == [0, 256, 512, 768]
    assert alloc.allocate(64) is None
    assert alloc.free_bytes == 0


def test_freed_neighbours_merge_into_one_extent() -> None:
    alloc = SlotAllocator(1024, align=64)
    a, b, c, _ = (alloc.allocate(256) for _ in range(4))
    assert a is not None
    assert b is not None
    assert c is not None
    alloc.free(a, 256)
    alloc.free(c, 256)
    assert alloc.largest_free() == 256
    alloc.free(b, 256)
    assert alloc.largest_free() == 768
    assert alloc.allocate(768) == 0


def test_best_fit_keeps_large_extents_whole() -> None:
    alloc = SlotAllocator(4096, align=64)
    small = alloc.allocate(128)
    blocker = alloc.allocate(64)
    assert small is not None
    assert blocker is not None
    alloc.free(small, 128)
    # A 128-byte request takes the 128-byte hole, not the big tail.
    assert alloc.allocate(100) == small


def test_double_free_and_outside_slots_are_refused() -> None:
    alloc = SlotAllocator(1024, align=64)
    offset = alloc.allocate(64)
    assert offset is not None
    alloc.free(offset, 64)
    with pytest.raises(ValueError, match="already free"):
        alloc.free(offset, 64)
    with pytest.raises(ValueError, match="not inside"):
        alloc.free(2048, 64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 900)), max_size=200))
def test_slots_never_overlap_and_all_bytes_are_accounted(ops: list[tuple[bool, int]]) -> None:
    alloc = SlotAllocator(64 * 1024, align=64)
    live: dict[int, int] = {}
    for do_free, size in ops:
        if do_free and live:
            offset = next(iter(live))
            alloc.free(offset, live.pop(offset))
            continue
        offset = alloc.allocate(size)
        if offset is None:
            continue
        rounded = (size + 63) // 64 * 64
        for other, other_size in live.items():
            assert offset + rounded <= other or other + other_size <= offset
        live[offset] = rounded
        assert offset + rounded <= alloc.size
    assert alloc.free_bytes + sum(live.values()) == alloc.size
    for offset, size in list(live.items()):
        alloc.free(offset, size)
    assert alloc.largest_free() == alloc.size
