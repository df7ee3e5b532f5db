"""The in-memory index: the shipped index conformance suite, then what only it promises.

The memory-specific tests drive a fake clock: retention-weighted LRU, headroom, leases.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from manual_clock import Clock

from kvfabric._runtime.record import record_size
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.indexes.memory_eviction import Eviction
from kvfabric.indexes.memory_space import RegionSpace
from kvfabric.keys import fold_key
from kvfabric.spi.index import (
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
)
from kvfabric.testing import IndexConformance, MakeIndex


class TestMemoryIndex(IndexConformance):
    @pytest.fixture
    def make_index(self) -> Iterator[MakeIndex]:
        made: list[IndexPlugin] = []

        def make(config: IndexConfig) -> IndexPlugin:
            index = MemoryIndex.create(config)
            made.append(index)
            return index

        yield make
        for index in made:
            index.close()


def _key(n: int) -> bytes:
    return fold_key(n, b"test")


def _index(
    *, capacity: int = 1 << 20, grace: float = 0.0, lease: float = 30.0, headroom: float = 0.0
) -> tuple[MemoryIndex, Clock]:
    clock = Clock()
    index = MemoryIndex(lease=lease, grace=grace, headroom=headroom, clock=clock)
    index.register_node(
        NodeInfo(name="n1", regions=(RegionInfo(id=0, size=capacity, rkey=42),), endpoints=())
    )
    return index, clock


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    """From now on count the calls of method ``name`` of ``owner`` (still made): ``[n]``."""
    calls = [0]
    method = getattr(owner, name)

    def counted(self: object, *args: object, **kwargs: object) -> object:
        calls[0] += 1
        return method(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _put(index: MemoryIndex, *keys: bytes, length: int = 1000) -> list[AllocationKind]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    granted = [
        GrantRef.of(a.descriptor)
        for a in result.allocations
        if a.kind is AllocationKind.GRANTED and a.descriptor is not None
    ]
    assert all(index.publish(granted))
    return [a.kind for a in result.allocations]


def test_lease_expiry_frees_the_grant_and_rejects_a_late_publish() -> None:
    index, clock = _index(lease=5.0)
    grant = index.allocate([AllocationRequest(key=_key(1), length=100)]).allocations[0]
    assert grant.descriptor is not None
    clock.now += 6.0
    assert index.publish([GrantRef.of(grant.descriptor)]) == [False]
    index.tick()
    # The key can be granted anew, with a new version.
    regrant = index.allocate([AllocationRequest(key=_key(1), length=100)]).allocations[0]
    assert regrant.kind is AllocationKind.GRANTED
    assert regrant.descriptor is not None
    assert regrant.descriptor.version > grant.descriptor.version
    assert index.stats()["lease_expiries"] == 1


def test_retired_slot_comes_back_after_the_grace_period_with_a_new_version() -> None:
    size = record_size(1000)
    index, clock = _index(capacity=2 * size, grace=2.0)
    _put(index, _key(1))
    old = index.resolve([_key(1)])[0]
    assert old is not None
    assert index.unpublish([_key(1)]) == 1
    assert index.stats()["retired_bytes"] == size
    clock.now += 2.5
    index.tick()
    assert index.stats()["retired_bytes"] == 0
    _put(index, _key(2), _key(3))  # both slots free again: no eviction, no early reuse
    stats = index.stats()
    assert (stats["evictions"], stats["early_reuse"], stats["entries"]) == (0, 0, 2)
    new = [d for d in index.resolve([_key(2), _key(3)]) if d is not None]
    assert {d.offset for d in new} == {0, size}
    assert all(d.version > old.version for d in new)


def test_eviction_prefers_old_entries_weighted_by_retention() -> None:
    size = record_size(1000)
    index, clock = _index(capacity=3 * size)
    _put(index, _key(1))
    # Key 1 is the oldest, but eight writers stored it: keep it over the younger key 2.
    for _ in range(7):
        assert _put(index, _key(1)) == [AllocationKind.EXISTS]
    clock.now += 1
    _put(index, _key(2))
    clock.now += 1
    _put(index, _key(3))
    clock.now += 1
    assert _put(index, _key(4)) == [AllocationKind.GRANTED]
    assert index.exists([_key(1), _key(2), _key(3), _key(4)]) == [True, False, True, True]
    assert index.stats()["evictions"] == 1


@pytest.mark.parametrize("how", ["lookup", "touch"])
def test_keys_used_since_the_last_eviction_are_kept_over_older_unused_ones(how: str) -> None:
    size = record_size(1000)
    index, clock = _index(capacity=3 * size)

    def use(n: int) -> None:
        """Use key ``n`` as the index hears of it: a lookup by RPC, or a client's report of
        one-sided lookups (a key never stored in the same report is ignored)."""
        if how == "lookup":
            assert len(index.lookup_copies([_key(n)]).descriptors) == 1
        else:
            index.touch([_key(n), _key(99)])

    for n in (1, 2, 3):
        _put(index, _key(n))
        clock.now += 1
    # Key 1 is the oldest; its uses make key 2 the least recently used.
    for _ in range(3):
        use(1)
        clock.now += 1
    assert _put(index, _key(4)) == [AllocationKind.GRANTED]
    assert index.exists([_key(1), _key(2), _key(3), _key(4)]) == [True, False, True, True]
    # Now key 3 is the least recently used; one use of it, applied by a tick, leaves key 1.
    use(3)
    clock.now += 1
    index.tick()
    assert _put(index, _key(5)) == [AllocationKind.GRANTED]
    assert index.exists([_key(1), _key(3), _key(4), _key(5)]) == [False, True, True, True]


def test_when_every_entry_was_used_since_queued_the_least_recently_used_goes() -> None:
    size = record_size(1000)
    index, clock = _index(capacity=3 * size)
    for n in (1, 2, 3):
        _put(index, _key(n))
    # Every entry is passed over once (each was used since it was queued); the walk then
    # ranks them by those uses: key 2's is the oldest.
    for n in (2, 3, 1):
        clock.now += 1
        assert len(index.lookup_copies([_key(n)]).descriptors) == 1
    clock.now += 1
    assert _put(index, _key(4)) == [AllocationKind.GRANTED]
    assert index.exists([_key(1), _key(2), _key(3), _key(4)]) == [True, False, True, True]
    assert index.stats()["evictions"] == 1


def test_headroom_is_kept_by_evicting_ahead_of_need() -> None:
    size = record_size(1000)
    index, clock = _index(capacity=10 * size, headroom=0.25, grace=5.0)
    # A record every 2 s with a 5 s grace: evicting only on demand would refuse puts once
    # full; 25% headroom (3 slots) keeps enough space on its way back to free.
    outcomes = []
    for i in range(30):
        outcomes.append(_put(index, _key(i))[0])
        clock.now += 2.0
    assert outcomes == [AllocationKind.GRANTED] * 30
    stats = index.stats()
    assert stats["free_bytes"] + stats["retired_bytes"] >= int(0.25 * 10 * size)
    assert stats["evictions"] == 30 - stats["entries"]


def test_headroom_for_a_many_key_put_is_made_in_one_ranked_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put of six keys leaves the store six entries short of its headroom: the six least
    worth keeping go (old, stored once), chosen in one pass over the LRU's head rather
    than a fresh sample per entry, and the often-stored old entries stay."""
    size = record_size(1000)
    index, clock = _index(capacity=20 * size, headroom=0.5)
    _put(index, *(_key(i) for i in range(10)))  # half full: exactly the headroom
    for _ in range(7):  # keys 0 and 1: the oldest, but eight writers stored them
        assert _put(index, _key(0), _key(1)) == [AllocationKind.EXISTS] * 2
    clock.now += 1
    sampled = _count_calls(monkeypatch, Eviction, "_evict_one")
    assert _put(index, *(_key(i) for i in range(100, 106))) == [AllocationKind.GRANTED] * 6
    kept = index.exists([_key(i) for i in (*range(10), *range(100, 106))])
    assert kept == [True, True] + [False] * 6 + [True, True] + [True] * 6
    stats = index.stats()
    assert (stats["evictions"], sampled[0]) == (6, 0)
    assert stats["free_bytes"] + stats["retired_bytes"] >= 10 * size


def _half_full_for_extents(headroom: float = 0.5) -> tuple[MemoryIndex, int]:
    """An index of 20 records' room holding 10 (exactly its headroom), and a record's size.
    A lease of ``k`` records' room then leaves the headroom ``k / 2`` short: free space
    shrinks by ``k``, and the headroom, half of the space not leased, by ``k / 2``."""
    size = record_size(1000)
    index, _ = _index(capacity=20 * size, headroom=headroom)
    _put(index, *(_key(i) for i in range(10)))
    return index, size


def test_once_an_owner_calls_idle_a_lease_leaves_eviction_ahead_of_need_to_it() -> None:
    """The eviction a lease owes the headroom waits for idle(): the lease's reply does not
    wait for it, and the next lease reports it (each eviction reported once)."""
    index, size = _half_full_for_extents()
    index.idle()  # an owner that calls it: a controller between requests
    extents = index.lease_extents(4 * size, 4 * size, 1)
    assert [e.size for e in extents] == [4 * size]
    assert (index.stats()["evictions"], extents[0].evictions) == (0, 0)  # owed, not done
    index.idle()
    assert index.stats()["evictions"] == 2
    stats = index.stats()
    assert stats["free_bytes"] + stats["retired_bytes"] >= 8 * size  # half of 16 not leased
    assert index.lease_extents(size, size, 1)[0].evictions == 2  # idle()'s, reported once
    index.idle()
    assert index.lease_extents(size, size, 1)[0].evictions == 1  # only the last idle()'s


def test_without_idle_a_lease_evicts_ahead_of_need_before_it_returns() -> None:
    index, size = _half_full_for_extents()
    extents = index.lease_extents(4 * size, 4 * size, 1)
    assert (index.stats()["evictions"], extents[0].evictions) == (2, 2)


def test_an_owed_eviction_is_made_by_the_next_grant_if_idle_has_not_come() -> None:
    """The headroom lags at most one grant: two leases with no idle() between them (two
    requests queued at once) and the second makes what the first owed first."""
    index, size = _half_full_for_extents()
    index.idle()
    index.lease_extents(4 * size, 4 * size, 1)
    second = index.lease_extents(2 * size, 2 * size, 1)
    assert index.stats()["evictions"] == 2  # the first lease's, made by the second
    assert second[0].evictions == 2
    index.idle()  # the second's: one more
    assert index.stats()["evictions"] == 3


def test_evictions_a_lease_made_without_an_extent_to_carry_them_are_reported_next() -> None:
    index, size = _half_full_for_extents()
    index.idle()
    index.lease_extents(4 * size, 4 * size, 1)  # owes two evictions
    assert index.lease_extents(size, size, 0) == []  # asks for none: makes the two
    assert index.stats()["evictions"] == 2
    assert index.lease_extents(size, size, 1)[0].evictions == 2


def test_an_allocate_defers_eviction_to_idle_as_a_lease_does() -> None:
    index, _ = _half_full_for_extents()
    index.idle()
    result = index.allocate([AllocationRequest(key=_key(100 + i), length=1000) for i in range(3)])
    assert [a.kind for a in result.allocations] == [AllocationKind.GRANTED] * 3
    assert (index.stats()["evictions"], result.evictions) == (0, 0)
    index.idle()
    assert index.stats()["evictions"] == 3
    again = index.allocate([AllocationRequest(key=_key(200), length=1000)])
    assert again.evictions == 3  # idle()'s three; its own eviction is owed to the next idle()
    index.idle()
    assert index.stats()["evictions"] == 4


def test_extents_writers_left_holding_do_not_make_the_headroom_evict_what_was_just_stored() -> None:
    """Writers that vanished (a forked child exits without closing) hold leased extents
    until their leases run out. Eviction cannot free that space, so the headroom is a share
    of the rest: it evicts the least recently used of what it can act on, never every entry
    there is (which lost values a live writer had stored a moment before)."""
    size = record_size(1000)
    index, clock = _index(capacity=40 * size, headroom=0.25)
    index.idle()  # an owner that calls it, as a controller does between requests
    _put(index, *(_key(i) for i in range(4)))  # the oldest entries
    for _ in range(2):  # two writers that vanished, each with an extent it never wrote
        assert [e.size for e in index.lease_extents(16 * size, 16 * size, 1)] == [16 * size]
        index.idle()
    clock.now += 1
    _put(index, *(_key(100 + i) for i in range(4)))  # a live writer's, just stored
    index.idle()
    stats = index.stats()
    assert stats["extent_bytes"] == 32 * size
    # Not leased: 8 slots, 25% of them (2) kept free or retired by evicting the oldest two.
    assert stats["evictions"] == 2
    assert index.exists([_key(i) for i in range(4)]) == [False, False, True, True]
    assert index.exists([_key(100 + i) for i in range(4)]) == [True] * 4


def test_churn_within_the_grace_reuses_retired_slots_pricing_one_window_per_put(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full store written faster than its grace ends (the clock never moves here): each put
    reuses a retired slot early, and finding it costs one priced window, not a walk past
    every slot reused before (that walk once cost ~1 ms a key under churn)."""
    size = record_size(1000)
    index, _ = _index(capacity=10 * size, headroom=0.25, grace=5.0)
    for i in range(20):
        _put(index, _key(i))
    priced = _count_calls(monkeypatch, RegionSpace, "plan")
    puts = 2000
    outcomes = [_put(index, _key(20 + i))[0] for i in range(puts)]
    assert outcomes == [AllocationKind.GRANTED] * puts
    assert priced[0] == puts
    stats = index.stats()
    assert stats["early_reuse"] >= puts
    # The queue of retirements holds what is still retired, not every slot reused early.
    assert len(index._regions.retired) <= 10


def test_reregistering_a_node_keeps_its_id_and_entries() -> None:
    index, _ = _index()
    _put(index, _key(1))
    info = index.nodes()[0]
    again = index.register_node(NodeInfo(name="n1", regions=info.regions, endpoints=info.endpoints))
    assert again.id == info.id
    assert index.exists([_key(1)]) == [True]


@pytest.mark.parametrize("count", [1, 100])
def test_stats_account_for_every_byte(count: int) -> None:
    index, _ = _index()
    _put(index, *[_key(i) for i in range(count)], length=500)
    stats = index.stats()
    assert stats["entries"] == count
    assert stats["used_bytes"] == count * record_size(500)
    assert stats["stored_payload_bytes"] == count * 500
    assert stats["used_bytes"] + stats["free_bytes"] == stats["capacity_bytes"]


# -- room that eviction cannot make, or makes away from the least recently used -----------

_SLOT = 256 << 10
_PAYLOAD = _SLOT - record_size(0)  # a record of this payload fills a 256 KiB slot exactly


def _fill_extent(index: MemoryIndex, size: int, first_key: int) -> int:
    """Lease an extent of ``size`` bytes, publish records filling it, return how many."""
    (extent,) = index.lease_extents(size, size, 1)
    records = [
        CarvedRecord(
            extent=extent.id,
            key=_key(first_key + n),
            offset=extent.offset + n * _SLOT,
            length=_PAYLOAD,
            version=extent.first_version + n,
            crc=n,
        )
        for n in range(size // _SLOT)
    ]
    assert set(index.publish_carved(records)) == {CarveOutcome.STORED}
    return len(records)


def test_a_lease_no_eviction_can_make_room_for_evicts_nothing() -> None:
    """The middle half of the region leased to a writer: entries on either side, 16 MiB
    each, so no window of 17 MiB or more can ever be opened. Such a lease or allocate is
    refused at once and every entry stays (evicting them one by one in search of room
    emptied a store so and held its controller for 72 s)."""
    index, _ = _index(capacity=64 << 20)
    stored = _fill_extent(index, 16 << 20, 0)  # [0, 16 MiB)
    (writing,) = index.lease_extents(32 << 20, 32 << 20, 1)  # [16, 48 MiB), being written
    stored += _fill_extent(index, 16 << 20, 1000)  # [48, 64 MiB)
    assert writing.offset == 16 << 20
    assert index.lease_extents(17 << 20, 32 << 20, 1) == []
    (allocation,) = index.allocate([AllocationRequest(key=_key(5000), length=17 << 20)]).allocations
    assert allocation.kind is AllocationKind.NO_SPACE
    stats = index.stats()
    assert (stats["entries"], stats["evictions"], stats["extents"]) == (stored, 0, 1)
    # Room that can be made still is: a window of 16 MiB on one side.
    (extent,) = index.lease_extents(16 << 20, 16 << 20, 1)
    assert extent.evictions == (16 << 20) // _SLOT


def test_room_blocked_around_the_oldest_entries_is_made_where_a_window_can_open() -> None:
    """The oldest entries lie between the region's start and an extent being written: no
    window around them reaches 24 MiB. The lease evicts a window of newer entries past the
    extent, exactly its 24 MiB, and keeps every older entry (which evicting the oldest one
    by one first would all have lost, for nothing)."""
    index, _ = _index(capacity=64 << 20)
    old = _fill_extent(index, 16 << 20, 0)  # [0, 16 MiB), used least recently
    (writing,) = index.lease_extents(16 << 20, 16 << 20, 1)  # [16, 32 MiB)
    newer = _fill_extent(index, 32 << 20, 1000)  # [32, 64 MiB)
    assert writing.offset == 16 << 20
    (extent,) = index.lease_extents(24 << 20, 24 << 20, 1)
    assert extent.offset == 32 << 20
    assert extent.evictions == index.stats()["evictions"] == (24 << 20) // _SLOT
    assert index.stats()["entries"] == old + newer - (24 << 20) // _SLOT
    assert all(d is not None for d in index.resolve([_key(n) for n in range(old)]))
