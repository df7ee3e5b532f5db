"""Where the redis index puts things, without a server: slots of arenas, the ring of keys."""

from __future__ import annotations

import pytest

from kvfabric.indexes.redis_layout import SLOTS, Arena, Ring, arena_prefix, key_slot
from kvfabric.keys import fold_key


def _arena(arena_id: int, name: str, region: int = 0, size: int = 1 << 30) -> Arena:
    return Arena(
        id=arena_id,
        node=1,
        name=name,
        region=region,
        index=0,
        base=0,
        size=size,
        rkey=1,
        restoring=False,
        prefix=arena_prefix("ns", arena_id),
    )


_KEYS = [fold_key(i, b"layout") for i in range(4000)]


def test_key_slot_is_redis_clusters() -> None:
    crc = pytest.importorskip("redis.crc")
    for name in (b"plain", b"{tag}rest", b"{}empty-tag", b"a{b}c{d}", _KEYS[0]):
        assert key_slot(name) == crc.key_slot(name)


def test_arenas_land_evenly_over_equal_slot_ranges() -> None:
    thirds = [0, 0, 0]
    for arena_id in range(1, 31):
        slot = key_slot(arena_prefix("ns", arena_id))
        assert slot == int(((arena_id * 0.6180339887498949) % 1) * SLOTS) % SLOTS
        thirds[slot * 3 // SLOTS] += 1
    assert sorted(thirds) in ([10, 10, 10], [9, 10, 11])


def test_a_node_leaving_moves_only_its_keys() -> None:
    before = Ring([_arena(1, "a"), _arena(2, "b"), _arena(3, "c")])
    after = Ring([_arena(1, "a"), _arena(2, "b")])
    for key in _KEYS:
        owner = before.arena_of(key)
        if owner.name != "c":
            assert after.arena_of(key).name == owner.name


def test_a_node_joining_takes_keys_only_for_itself() -> None:
    before = Ring([_arena(1, "a"), _arena(2, "b")])
    after = Ring([_arena(1, "a"), _arena(2, "b"), _arena(3, "c")])
    moved = [k for k in _KEYS if after.arena_of(k).name != before.arena_of(k).name]
    assert moved
    assert all(after.arena_of(k).name == "c" for k in moved)
    print(f"a third node took {len(moved)} of {len(_KEYS)} keys")


def test_placement_follows_identity_not_arena_ids() -> None:
    """A node back with the same regions gets the same keys, whatever ids its arenas got."""
    first = Ring([_arena(1, "a"), _arena(2, "b")])
    again = Ring([_arena(7, "a"), _arena(9, "b")])
    assert all(first.arena_of(k).name == again.arena_of(k).name for k in _KEYS)


def test_grouping_many_keys_agrees_with_one_at_a_time() -> None:
    ring = Ring([_arena(i, f"n{i}") for i in range(1, 13)])
    for count in (1, 31, 32, 1000):
        keys = _KEYS[:count]
        groups = ring.group(keys)
        positions = sorted(i for _, where in groups for i in where)
        assert positions == list(range(count))
        assert all(ring.arena_of(keys[i]) is arena for arena, where in groups for i in where)
