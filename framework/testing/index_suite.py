"""Conformance tests every index plugin must pass (the built-in ``memory`` and ``redis`` pass them).

An index plugin author subclasses :class:`IndexConformance` and overrides one fixture::

    class TestMyIndex(IndexConformance):
        @pytest.fixture
        def make_index(self) -> Iterator[MakeIndex]:
            made = []
            def make(config: IndexConfig) -> IndexPlugin:
                index = MyIndex.create(config)
                made.append(index)
                return index
            yield make
            for index in made:
                index.close()

The suite registers its own data nodes (regions of known size, no real memory behind them:
an index never touches payload bytes) and checks grants, publishing, prefix lookups, dedup,
leases, the grace period, eviction, membership and the counters. Time-based checks use short
leases and wait past them: a slow machine only makes them wait longer, never fail.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import attrs
import pytest

from kvfabric.descriptor import Descriptor
from kvfabric.keys import fold_key
from kvfabric.spi import (
    SLOT_ALIGN,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Extent,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
    record_size,
)

__all__ = ["IndexConformance", "MakeIndex"]

MakeIndex = Callable[[IndexConfig], IndexPlugin]

_VALUE = 1000
_SLOT = record_size(_VALUE)


def _keys(n: int) -> list[bytes]:
    salt = uuid.uuid4().bytes
    return [fold_key(i, salt) for i in range(n)]


def _node(name: str, *sizes: int, restoring: bool = False, rkey: int = 1000) -> NodeInfo:
    regions = tuple(RegionInfo(id=i, size=size, rkey=rkey + i) for i, size in enumerate(sizes))
    return NodeInfo(name=name, regions=regions, endpoints=(), restoring=restoring)


def _record(key: bytes, offset: int, version: int, region: int = 0) -> Descriptor:
    """A record as a node reports it after scanning its memory (node and rkey: any)."""
    return Descriptor(
        key=key,
        node=0,
        region=region,
        offset=offset,
        length=_VALUE,
        rkey=0,
        version=version,
        crc=99,
    )


def _grants(index: IndexPlugin, keys: Sequence[bytes], length: int = _VALUE) -> list[Descriptor]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    out = []
    for allocation in result.allocations:
        assert allocation.kind is AllocationKind.GRANTED, allocation.kind
        assert allocation.descriptor is not None
        out.append(allocation.descriptor)
    return out


def _put(index: IndexPlugin, keys: Sequence[bytes], length: int = _VALUE) -> list[AllocationKind]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    granted = [
        GrantRef.of(a.descriptor, crc=7)
        for a in result.allocations
        if a.kind is AllocationKind.GRANTED and a.descriptor is not None
    ]
    assert all(index.publish(granted))
    return [a.kind for a in result.allocations]


def _leased(index: IndexPlugin, need: int, want: int = 0, count: int = 1) -> list[Extent]:
    """Extents leased, or the test skipped for an index that leases none."""
    extents = index.lease_extents(need, want or need, count)
    if not extents and index.lease_extents(_SLOT, _SLOT, 1) == []:
        pytest.skip(f"{type(index).__name__} leases no extents")
    return extents


def _carved(
    extent: Extent, keys: Sequence[bytes], *, skip: int = 0, length: int = _VALUE
) -> list[CarvedRecord]:
    """Records for ``keys`` laid back to back in ``extent`` from its start, ``skip`` slots
    left empty first."""
    at = extent.offset + skip * record_size(length)
    out = []
    for n, key in enumerate(keys):
        version = extent.first_version + skip + n
        out.append(
            CarvedRecord(
                extent=extent.id, key=key, offset=at, length=length, version=version, crc=7
            )
        )
        at += record_size(length)
    return out


def _wait_past(seconds: float, index: IndexPlugin) -> None:
    """Let ``seconds`` pass, then tick: time running out (a lease, a grace period) is the
    behaviour under test, so this sleeps on purpose, past the short lease the test set."""
    time.sleep(seconds)
    index.tick()


class IndexConformance:
    """Mixin: override ``make_index`` with a factory of fresh, empty indexes."""

    @pytest.fixture
    def make_index(self) -> MakeIndex:
        pytest.fail("IndexConformance needs a make_index fixture: IndexConfig -> a new index")

    @pytest.fixture
    def index(self, make_index: MakeIndex) -> IndexPlugin:
        """A fresh index with one node of two 1 MiB regions, no grace and no headroom."""
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 1 << 20, 1 << 20))
        return index

    # -- what the class declares ---------------------------------------------------------

    def test_the_class_declares_a_name_and_options_as_data(self, index: IndexPlugin) -> None:
        cls = type(index)
        assert isinstance(cls.name, str)
        assert cls.name
        assert isinstance(cls.options, tuple)

    # -- grants and publishing -----------------------------------------------------------

    def test_a_grant_is_invisible_until_published_with_its_crc(self, index: IndexPlugin) -> None:
        (key,) = _keys(1)
        (grant,) = _grants(index, [key])
        assert grant.key == key
        assert grant.length == _VALUE
        assert grant.rkey in (1000, 1001)
        assert index.exists([key]) == [False]
        assert index.lookup_prefix([key]) == []
        assert index.resolve([key]) == [None]
        assert index.publish([GrantRef.of(grant, crc=0xABCD)]) == [True]
        (published,) = index.lookup_prefix([key])
        assert published.crc == 0xABCD
        assert (published.version, published.offset) == (grant.version, grant.offset)
        assert index.resolve([key]) == [published]
        assert index.exists([key]) == [True]

    def test_grants_of_one_call_never_overlap(self, index: IndexPlugin) -> None:
        lengths = [1, 63, 64, 65, 4000, 100_000, 0, 12_345] * 8
        keys = _keys(len(lengths))
        result = index.allocate(
            [AllocationRequest(key=k, length=n) for k, n in zip(keys, lengths, strict=True)]
        )
        spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for allocation, length in zip(result.allocations, lengths, strict=True):
            assert allocation.kind is AllocationKind.GRANTED
            d = allocation.descriptor
            assert d is not None
            spans.setdefault((d.node, d.region), []).append((d.offset, record_size(length)))
        for extents in spans.values():
            extents.sort()
            for (a, a_size), (b, _) in itertools.pairwise(extents):
                assert a + a_size <= b

    def test_versions_are_unique_and_grow(self, index: IndexPlugin) -> None:
        grants = _grants(index, _keys(20))
        versions = [g.version for g in grants]
        assert len(set(versions)) == 20
        later = _grants(index, _keys(1))[0]
        assert later.version > max(versions)

    def test_a_second_writer_is_told_in_flight_and_a_third_after_publish_exists(
        self, index: IndexPlugin
    ) -> None:
        (key,) = _keys(1)
        (grant,) = _grants(index, [key])
        again = index.allocate([AllocationRequest(key=key, length=_VALUE)]).allocations[0]
        assert again.kind is AllocationKind.IN_FLIGHT
        assert index.publish([GrantRef.of(grant)]) == [True]
        third = index.allocate([AllocationRequest(key=key, length=_VALUE)]).allocations[0]
        assert third.kind is AllocationKind.EXISTS
        assert third.descriptor is not None
        assert third.descriptor.version == grant.version

    def test_dedup_hits_are_counted(self, index: IndexPlugin) -> None:
        keys = _keys(5)
        _put(index, keys)
        before = index.stats()["dedup_hits"]
        assert _put(index, keys) == [AllocationKind.EXISTS] * 5
        assert index.stats()["dedup_hits"] - before == 5

    def test_an_aborted_grant_cannot_be_published_and_the_key_can_be_granted_again(
        self, index: IndexPlugin
    ) -> None:
        (key,) = _keys(1)
        (grant,) = _grants(index, [key])
        index.abort([GrantRef.of(grant)])
        assert index.publish([GrantRef.of(grant)]) == [False]
        assert _put(index, [key]) == [AllocationKind.GRANTED]

    def test_publish_of_a_grant_never_made_is_refused(self, index: IndexPlugin) -> None:
        (key,) = _keys(1)
        assert index.publish([GrantRef(key=key, version=12345, crc=1)]) == [False]
        assert index.exists([key]) == [False]

    def test_a_lease_that_ran_out_refuses_the_late_publish(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(lease=0.2, grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 1 << 20))
        (key,) = _keys(1)
        (grant,) = _grants(index, [key])
        _wait_past(0.5, index)
        assert index.publish([GrantRef.of(grant)]) == [False]
        assert index.exists([key]) == [False]
        (regrant,) = _grants(index, [key])
        assert regrant.version > grant.version

    # -- lookups -------------------------------------------------------------------------

    @pytest.mark.parametrize("gap", [0, 1, 7, 15])
    def test_lookup_prefix_stops_at_the_first_gap(self, index: IndexPlugin, gap: int) -> None:
        keys = _keys(16)
        _put(index, keys[:gap] + keys[gap + 1 :])
        found = index.lookup_prefix(keys)
        assert [d.key for d in found] == keys[:gap]

    def test_resolve_and_exists_answer_per_key(self, index: IndexPlugin) -> None:
        keys = _keys(6)
        _put(index, [keys[1], keys[4]])
        assert index.exists(keys) == [False, True, False, False, True, False]
        resolved = index.resolve(keys)
        assert [d is not None for d in resolved] == [False, True, False, False, True, False]
        assert [d.key for d in resolved if d is not None] == [keys[1], keys[4]]

    def test_a_large_batch_is_one_call(self, index: IndexPlugin) -> None:
        keys = _keys(1024)
        _put(index, keys, length=64)
        assert len(index.lookup_prefix(keys)) == 1024
        assert index.exists(keys) == [True] * 1024

    # -- removal, grace, eviction --------------------------------------------------------

    def test_unpublish_removes_at_once_and_counts(self, index: IndexPlugin) -> None:
        keys = _keys(4)
        _put(index, keys)
        assert index.unpublish([keys[1], keys[2], _keys(1)[0]]) == 2
        assert index.exists(keys) == [True, False, False, True]
        assert len(index.lookup_prefix(keys)) == 1

    def test_a_retired_slot_waits_out_the_grace_period_while_there_is_other_room(
        self, make_index: MakeIndex
    ) -> None:
        index = make_index(IndexConfig(grace=60.0, headroom=0.0))
        index.register_node(_node("n1", 2 * _SLOT))  # room for exactly two records
        first, second, third = _keys(3)
        _put(index, [first])
        old = index.resolve([first])[0]
        assert old is not None
        assert index.unpublish([first]) == 1
        (grant,) = _grants(index, [second])
        assert grant.offset != old.offset
        index.publish([GrantRef.of(grant)])
        # Nothing else is free now: a put is never refused for a grace period; the retired
        # slot is reused early (cheaper than evicting), under a new version.
        (late,) = _grants(index, [third])
        assert (late.region, late.offset) == (old.region, old.offset)
        assert late.version > old.version
        assert index.exists([second]) == [True]

    def test_a_freed_slot_comes_back_under_a_new_version(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.2, headroom=0.0))
        index.register_node(_node("n1", _SLOT))
        first, second = _keys(2)
        _put(index, [first])
        old = index.resolve([first])[0]
        assert old is not None
        index.unpublish([first])
        _wait_past(0.5, index)
        (grant,) = _grants(index, [second])
        assert (grant.region, grant.offset) == (old.region, old.offset)
        assert grant.version > old.version

    def test_a_full_index_evicts_to_make_room(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 4 * _SLOT))
        keys = _keys(10)
        for key in keys:
            assert _put(index, [key]) == [AllocationKind.GRANTED]
        stats = index.stats()
        assert stats["entries"] == 4
        assert stats["evictions"] == 6
        assert index.exists(keys[-1:]) == [True]

    def test_allocate_reports_the_evictions_it_caused(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 2 * _SLOT))
        _put(index, _keys(2))
        result = index.allocate([AllocationRequest(key=_keys(1)[0], length=_VALUE)])
        assert result.allocations[0].kind is AllocationKind.GRANTED
        assert result.evictions == 1

    def test_a_value_larger_than_any_region_is_refused_and_evicts_nothing(
        self, index: IndexPlugin
    ) -> None:
        keys = _keys(100)
        _put(index, keys)
        before = index.stats()
        result = index.allocate([AllocationRequest(key=_keys(1)[0], length=2 << 20)])
        assert result.allocations[0].kind is AllocationKind.NO_SPACE
        assert result.evictions == 0
        assert index.stats()["evictions"] == before["evictions"]
        assert index.exists(keys) == [True] * 100

    def test_a_full_index_with_mixed_sizes_keeps_storing(self, make_index: MakeIndex) -> None:
        """Fragmentation must not turn into refusals: room is made where a value fits."""
        index = make_index(IndexConfig(grace=60.0))
        index.register_node(_node("n1", 8 << 20))
        sizes = [4096 * (1 + (i * 7919) % 512) for i in range(600)]  # 4 KiB - 2 MiB
        refused = 0
        for key, size in zip(_keys(len(sizes)), sizes, strict=True):
            refused += _put(index, [key], length=size) == [AllocationKind.NO_SPACE]
        stats = index.stats()
        assert stats["evictions"] > 0
        assert refused == 0

    # -- membership ----------------------------------------------------------------------

    def test_nodes_get_distinct_ids_and_a_name_keeps_its_id(self, index: IndexPlugin) -> None:
        first = index.nodes()[0]
        second = index.register_node(_node("n2", 1 << 20))
        assert second.id != first.id
        again = index.register_node(_node("n1", 1 << 20, 1 << 20))
        assert again.id == first.id
        assert sorted(n.name for n in index.nodes()) == ["n1", "n2"]

    def test_removing_a_node_drops_its_entries(self, index: IndexPlugin) -> None:
        keys = _keys(3)
        _put(index, keys)
        (node,) = index.nodes()
        assert index.remove_node(node.id) == 3
        assert index.exists(keys) == [False] * 3
        assert index.nodes() == []
        result = index.allocate([AllocationRequest(key=_keys(1)[0], length=10)])
        assert result.allocations[0].kind is AllocationKind.NO_SPACE

    def test_grants_spread_over_every_node(self, index: IndexPlugin) -> None:
        index.register_node(_node("n2", 1 << 20, 1 << 20))
        grants = _grants(index, _keys(64))
        assert len({g.node for g in grants}) == 2

    # -- counters and threads ------------------------------------------------------------

    def test_stats_account_for_entries_and_bytes(self, index: IndexPlugin) -> None:
        _put(index, _keys(10), length=500)
        stats = index.stats()
        assert stats["entries"] == 10
        assert stats["nodes"] == 1
        assert stats["capacity_bytes"] == 2 << 20
        assert stats["stored_payload_bytes"] == 10 * 500
        assert stats["used_bytes"] == 10 * record_size(500)

    def test_concurrent_writers_of_one_key_get_exactly_one_grant(self, index: IndexPlugin) -> None:
        (key,) = _keys(1)
        kinds: list[AllocationKind] = []
        lock = threading.Lock()

        def writer() -> None:
            result = index.allocate([AllocationRequest(key=key, length=_VALUE)])
            with lock:
                kinds.append(result.allocations[0].kind)

        threads = [threading.Thread(target=writer) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert kinds.count(AllocationKind.GRANTED) == 1
        assert kinds.count(AllocationKind.IN_FLIGHT) == 15

    # -- restarts: ids, incarnations, regions, records restored -----------------------------

    def test_a_node_id_is_never_given_to_another_node(self, index: IndexPlugin) -> None:
        first = index.nodes()[0]
        index.remove_node(first.id)
        other = index.register_node(_node("n2", 1 << 20))
        assert other.id != first.id
        back = index.register_node(_node("n1", 1 << 20))
        assert back.id == first.id

    def test_every_registration_gets_a_new_incarnation(self, index: IndexPlugin) -> None:
        first = index.nodes()[0]
        again = index.register_node(_node("n1", 1 << 20, 1 << 20))
        assert again.incarnation != first.incarnation
        assert index.nodes()[0].incarnation == again.incarnation

    def test_reregistering_with_fewer_regions_drops_their_entries_and_capacity(
        self, index: IndexPlugin
    ) -> None:
        keys = _keys(64)
        _put(index, keys)
        on_region_1 = [d.key for d in index.resolve(keys) if d is not None and d.region == 1]
        assert on_region_1
        index.register_node(_node("n1", 1 << 20))  # region 1 is gone
        assert index.stats()["capacity_bytes"] == 1 << 20
        assert index.exists(on_region_1) == [False] * len(on_region_1)
        grants = _grants(index, _keys(32))
        assert {g.region for g in grants} == {0}

    def test_a_region_whose_rkey_changed_loses_its_entries(self, index: IndexPlugin) -> None:
        keys = _keys(8)
        _put(index, keys)
        index.register_node(_node("n1", 1 << 20, 1 << 20, rkey=5000))
        assert index.exists(keys) == [False] * 8
        assert {g.rkey for g in _grants(index, _keys(8))} <= {5000, 5001}

    def test_restored_records_are_published_and_their_slots_never_granted(
        self, make_index: MakeIndex
    ) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        node = index.register_node(_node("n1", 4 * _SLOT, restoring=True))
        held = _keys(2)
        # Until the node is done reporting, its region takes no grant.
        blocked = index.allocate([AllocationRequest(key=_keys(1)[0], length=_VALUE)])
        assert blocked.allocations[0].kind is AllocationKind.NO_SPACE
        kept = index.restore(node.id, [_record(held[0], 0, 7), _record(held[1], 2 * _SLOT, 8)])
        assert kept == 2
        found = index.lookup_prefix(held)
        assert [(d.offset, d.version, d.crc, d.node) for d in found] == [
            (0, 7, 99, node.id),
            (2 * _SLOT, 8, 99, node.id),
        ]
        assert {d.rkey for d in found} == {1000}
        index.restore_done(node.id)
        grants = _grants(index, _keys(2))
        assert sorted(g.offset for g in grants) == [_SLOT, 3 * _SLOT]

    def test_puts_while_a_node_restores_never_evict_its_records(
        self, make_index: MakeIndex
    ) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        node = index.register_node(_node("n1", 4 * _SLOT, restoring=True))
        held = _keys(3)
        index.restore(node.id, [_record(k, i * _SLOT, 5) for i, k in enumerate(held)])
        for key in _keys(10):  # writers arrive before the node is done reporting
            result = index.allocate([AllocationRequest(key=key, length=_VALUE)])
            assert result.allocations[0].kind is AllocationKind.NO_SPACE
            assert result.evictions == 0
        assert index.exists(held) == [True] * 3
        index.restore_done(node.id)
        assert _put(index, _keys(1)) == [AllocationKind.GRANTED]
        assert index.exists(held) == [True] * 3

    def test_a_key_reported_by_two_nodes_is_kept_once(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        one = index.register_node(_node("n1", 1 << 20, restoring=True))
        two = index.register_node(_node("n2", 1 << 20, restoring=True))
        (key,) = _keys(1)
        assert index.restore(one.id, [_record(key, 0, 5)]) == 1
        assert index.restore(two.id, [_record(key, 0, 6)]) == 0
        index.restore_done(one.id)
        index.restore_done(two.id)
        (found,) = index.resolve([key])
        assert found is not None
        assert found.node == one.id
        # The second copy's space is free again: the whole of node 2 takes grants.
        assert index.stats()["entries"] == 1

    def test_restored_records_that_do_not_fit_are_dropped(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        node = index.register_node(_node("n1", 2 * _SLOT, restoring=True))
        a, b, c = _keys(3)
        kept = index.restore(
            node.id,
            [_record(a, _SLOT, 1), _record(b, 2 * _SLOT, 2), _record(c, 0, 3, region=9)],
        )
        assert kept == 1
        index.restore_done(node.id)
        assert index.exists([a, b, c]) == [True, False, False]

    # -- extents (an index that leases none skips these) ----------------------------------

    def test_records_carved_from_an_extent_are_published_as_laid(self, index: IndexPlugin) -> None:
        (extent,) = _leased(index, 4 * _SLOT)
        assert extent.size >= 4 * _SLOT
        assert extent.offset % SLOT_ALIGN == 0
        keys = _keys(4)
        records = _carved(extent, keys)
        assert index.publish_carved(records) == [CarveOutcome.STORED] * 4
        found = index.lookup_prefix(keys)
        assert [(d.key, d.offset, d.version, d.crc) for d in found] == [
            (r.key, r.offset, r.version, r.crc) for r in records
        ]
        assert {(d.node, d.region, d.rkey, d.length) for d in found} == {
            (extent.node, extent.region, extent.rkey, _VALUE)
        }

    def test_extents_and_grants_never_overlap(self, index: IndexPlugin) -> None:
        index.register_node(_node("n2", 1 << 20))
        extents = _leased(index, 8 * _SLOT, count=2)
        assert len({e.node for e in extents}) == 2
        extents += _leased(index, 8 * _SLOT)
        grants = _grants(index, _keys(32))
        spans = sorted(
            [(e.node, e.region, e.offset, e.end) for e in extents]
            + [(g.node, g.region, g.offset, g.offset + _SLOT) for g in grants]
        )
        for (node, region, _, end), (next_node, next_region, start, _) in itertools.pairwise(spans):
            assert (node, region) != (next_node, next_region) or end <= start
        versions = [v for e in extents for v in range(e.first_version, e.first_version + 4)]
        assert len(set(versions) | {g.version for g in grants}) == len(versions) + len(grants)

    def test_a_record_outside_the_unused_part_of_its_extent_is_refused(
        self, index: IndexPlugin
    ) -> None:
        (extent,) = _leased(index, 4 * _SLOT)
        first, *others = _keys(7)
        (record,) = _carved(extent, [first])
        assert index.publish_carved([record]) == [CarveOutcome.STORED]
        # Each breaks one rule; the next slot and the next version are what a good one has.
        good = attrs.evolve(record, offset=record.offset + _SLOT, version=record.version + 1)
        bad = [
            attrs.evolve(good, key=others[0], offset=record.offset),  # a published record's
            attrs.evolve(good, key=others[1], offset=extent.end - _SLOT + SLOT_ALIGN),  # past end
            attrs.evolve(good, key=others[2], offset=good.offset + 1),  # unaligned
            attrs.evolve(good, key=others[3], version=record.version),  # a version used
            attrs.evolve(good, key=others[4], version=extent.first_version + extent.versions),
            attrs.evolve(good, key=others[5], extent=extent.id + 1000),  # no such extent
        ]
        assert index.publish_carved(bad) == [CarveOutcome.REFUSED] * len(bad)
        assert index.exists(others) == [False] * len(others)

    def test_a_key_stored_or_being_written_is_not_carved_again(self, index: IndexPlugin) -> None:
        stored, pending, fresh = _keys(3)
        _put(index, [stored])
        _grants(index, [pending])
        (extent,) = _leased(index, 4 * _SLOT)
        before = index.stats()["dedup_hits"]
        outcomes = index.publish_carved(_carved(extent, [stored, pending, fresh]))
        assert outcomes == [CarveOutcome.EXISTS, CarveOutcome.IN_FLIGHT, CarveOutcome.STORED]
        assert index.stats()["dedup_hits"] == before + 1
        index.publish_carved([], again=[stored, fresh, _keys(1)[0]])
        assert index.stats()["dedup_hits"] == before + 3

    def test_an_extents_unused_part_comes_back_when_returned(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 4 * _SLOT))
        (extent,) = _leased(index, 4 * _SLOT)
        a, b = _keys(2)
        # Records in its first and third slots: the second and fourth are not used.
        records = _carved(extent, [a]) + _carved(extent, [b], skip=2)
        assert index.publish_carved(records) == [CarveOutcome.STORED] * 2
        assert index.lease_extents(0, 0, 0, returned=[extent.id]) == []
        grants = _grants(index, _keys(2))
        assert sorted(g.offset for g in grants) == [
            extent.offset + _SLOT,
            extent.offset + 3 * _SLOT,
        ]
        assert index.stats()["evictions"] == 0
        assert index.exists([a, b]) == [True, True]

    def test_an_extent_whose_lease_ran_out_refuses_its_records_and_gives_its_space_back(
        self, make_index: MakeIndex
    ) -> None:
        index = make_index(IndexConfig(lease=0.2, grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 4 * _SLOT))
        (extent,) = _leased(index, 4 * _SLOT)
        keys = _keys(4)
        _wait_past(0.5, index)
        assert index.publish_carved(_carved(extent, keys)) == [CarveOutcome.REFUSED] * 4
        assert index.exists(keys) == [False] * 4
        # The whole region is free again: four keys fit without evicting anything.
        assert _put(index, keys) == [AllocationKind.GRANTED] * 4
        assert index.stats()["evictions"] == 0

    def test_eviction_never_takes_an_extents_unused_part(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 8 * _SLOT))
        (extent,) = _leased(index, 4 * _SLOT)
        for key in _keys(20):
            result = index.allocate([AllocationRequest(key=key, length=_VALUE)])
            (allocation,) = result.allocations
            assert allocation.kind is AllocationKind.GRANTED
            assert allocation.descriptor is not None
            offset = allocation.descriptor.offset
            assert offset + _SLOT <= extent.offset or offset >= extent.end
            index.publish([GrantRef.of(allocation.descriptor, crc=7)])
        assert index.publish_carved(_carved(extent, _keys(4))) == [CarveOutcome.STORED] * 4

    def test_an_extent_goes_with_its_node(self, index: IndexPlugin) -> None:
        (extent,) = _leased(index, 4 * _SLOT)
        (node,) = index.nodes()
        index.remove_node(node.id)
        assert index.publish_carved(_carved(extent, _keys(1))) == [CarveOutcome.REFUSED]

    def test_no_extent_larger_than_any_region_is_leased(self, index: IndexPlugin) -> None:
        _leased(index, _SLOT)
        assert index.lease_extents(4 << 20, 4 << 20, 1) == []

    def test_a_lease_reports_the_evictions_it_caused(self, make_index: MakeIndex) -> None:
        index = make_index(IndexConfig(grace=0.0, headroom=0.0))
        index.register_node(_node("n1", 2 * _SLOT))
        _leased(index, _SLOT)  # half the node, never evicted; skips for an index leasing none
        _put(index, _keys(1))  # the other half: the node is full
        assert index.stats()["evictions"] == 0
        (extent,) = index.lease_extents(_SLOT, _SLOT, 1)
        assert extent.evictions == 1
        assert index.stats()["evictions"] == 1
