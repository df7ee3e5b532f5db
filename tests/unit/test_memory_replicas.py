"""The memory index with ``replicas``: copies on distinct nodes, and every path that must
keep them right (publish, node loss, invalid copies, eviction, repair, restore, the image).

A fake clock drives leases and the grace period. After each scenario the index is checked
through its own answers: copies on distinct nodes, no slot held twice, the bytes add up.
"""

from __future__ import annotations

import attrs
import pytest
from manual_clock import Clock

from kvfabric._runtime.image import (
    IMAGE_REGION,
    ImageGeometry,
    ImageStop,
    alternate_key,
    image_prefix,
)
from kvfabric._runtime.record import record_size
from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.keys import fold_key
from kvfabric.spi.index import (
    AllocationKind,
    AllocationRequest,
    Copies,
    GrantRef,
    IndexConfig,
    NodeInfo,
    RegionInfo,
)


def _key(n: int) -> bytes:
    return fold_key(n, b"replicas")


def _index(
    *, nodes: int = 3, replicas: int = 2, capacity: int = 1 << 20, grace: float = 0.0
) -> tuple[MemoryIndex, Clock, list[int]]:
    clock = Clock()
    index = MemoryIndex(lease=30.0, grace=grace, headroom=0.0, replicas=replicas, clock=clock)
    ids = [
        index.register_node(
            NodeInfo(
                name=f"n{i}", regions=(RegionInfo(id=0, size=capacity, rkey=40 + i),), endpoints=()
            )
        ).id
        for i in range(nodes)
    ]
    return index, clock, ids


def _grants(index: MemoryIndex, keys: list[bytes], length: int = 1000) -> list[list[Descriptor]]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    out = []
    for a in result.allocations:
        assert a.kind is AllocationKind.GRANTED
        assert a.descriptor is not None
        out.append([a.descriptor, *a.replicas])
    return out


def _put(index: MemoryIndex, keys: list[bytes], length: int = 1000) -> list[list[Descriptor]]:
    copies = _grants(index, keys, length)
    assert all(index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]))
    return copies


def _copies(index: MemoryIndex, key: bytes) -> list[Descriptor]:
    found = index.resolve_copies([key])
    first = found.descriptors[0]
    return [] if first is None else [first, *found.alternates.get(0, ())]


def _check(index: MemoryIndex, keys: list[bytes], length: int = 1000) -> None:
    """Seen through the index's own answers: each key's copies are on distinct nodes, no
    two copies share a slot, and the bytes in use are exactly theirs (nothing pending)."""
    slots: set[tuple[int, int, int]] = set()
    copies = 0
    for key in keys:
        found = _copies(index, key)
        assert len({d.node for d in found}) == len(found), "two copies on one node"
        slots |= {(d.node, d.region, d.offset) for d in found}
        copies += len(found)
    assert len(slots) == copies
    stats = index.stats()
    assert stats["pending"] == 0
    assert stats["used_bytes"] == copies * record_size(length)


def test_a_put_is_granted_on_distinct_nodes_and_a_lookup_returns_every_copy() -> None:
    index, _, _ids = _index(nodes=3, replicas=2)
    keys = [_key(i) for i in range(32)]
    copies = _put(index, keys)
    for c in copies:
        assert len(c) == 2
        assert c[0].node != c[1].node
        assert len({d.version for d in c}) == 2
    found = index.lookup_copies(keys)
    assert isinstance(found, Copies)
    assert [d.key for d in found.descriptors if d is not None] == keys
    assert {i: tuple(d.version for d in alts) for i, alts in found.alternates.items()} == {
        i: (c[1].version,) for i, c in enumerate(copies)
    }
    # The plain calls are unchanged: the copy read first.
    assert index.lookup_prefix(keys) == list(found.descriptors)
    assert index.stats()["stored_payload_bytes"] == 2 * 1000 * len(keys)
    assert index.stats()["replica_grants"] == len(keys)
    _check(index, keys)


def test_fewer_nodes_than_replicas_grant_one_copy_per_node_and_count_the_shortfall() -> None:
    index, _, _ = _index(nodes=2, replicas=3)
    (copies,) = _put(index, [_key(1)])
    assert len(copies) == 2
    assert index.stats()["replica_shortfall"] == 1
    _check(index, [_key(1)])


def test_a_copy_that_did_not_land_is_dropped_by_the_publish_of_the_others() -> None:
    index, _, _ = _index(nodes=3, replicas=2, grace=0.0)
    ((first, second),) = _grants(index, [_key(1)])
    assert index.publish([GrantRef.of(first, crc=5)]) == [True]
    assert _copies(index, _key(1)) == [attrs.evolve(first, crc=5)]
    # The copy not named is no longer granted: its publish is refused, its slot is free.
    assert index.publish([GrantRef.of(second, crc=5)]) == [False]
    assert index.stats()["replicas_dropped"] == 1
    _check(index, [_key(1)])


def test_when_only_a_later_copy_landed_it_is_the_one_read_first() -> None:
    index, _, _ = _index(nodes=3, replicas=2)
    ((_first, second),) = _grants(index, [_key(1)])
    assert index.publish([GrantRef.of(second, crc=5)]) == [True]
    assert [d.version for d in _copies(index, _key(1))] == [second.version]
    _check(index, [_key(1)])


def test_a_lost_node_costs_only_its_copies() -> None:
    index, _, ids = _index(nodes=3, replicas=2)
    keys = [_key(i) for i in range(30)]
    copies = _put(index, keys)
    lost = ids[0]
    assert index.remove_node(lost) == 0  # every entry had a copy elsewhere
    for key, c in zip(keys, copies, strict=True):
        left = _copies(index, key)
        assert [d.version for d in left] == [d.version for d in c if d.node != lost]
    assert index.stats()["promotions"] == sum(c[0].node == lost for c in copies)
    # The second node to go takes the keys whose both copies were on those two nodes.
    both = sum({d.node for d in c} == {ids[0], ids[1]} for c in copies)
    assert index.remove_node(ids[1]) == both
    assert index.stats()["entries"] == len(keys) - both
    _check(index, keys)


def test_an_invalid_copy_goes_alone_and_the_key_stays_readable() -> None:
    index, clock, _ = _index(nodes=2, replicas=2, grace=1.0)
    ((first, second),) = _put(index, [_key(1)])
    assert index.drop_invalid([GrantRef(key=_key(1), version=first.version)]) == 1
    assert [d.version for d in _copies(index, _key(1))] == [second.version]
    assert index.stats()["retired_bytes"] == record_size(1000)
    # A stale report (that copy is gone already) does nothing.
    assert index.drop_invalid([GrantRef(key=_key(1), version=first.version)]) == 0
    assert index.drop_invalid([GrantRef(key=_key(1), version=second.version)]) == 1
    assert _copies(index, _key(1)) == []
    clock.now += 2
    index.tick()
    assert index.stats()["free_bytes"] == index.stats()["capacity_bytes"]
    _check(index, [_key(1)])


def test_unpublish_and_eviction_take_every_copy() -> None:
    size = record_size(1000)
    index, clock, _ = _index(nodes=2, replicas=2, capacity=4 * size)
    keys = [_key(i) for i in range(8)]
    _put(index, keys[:4])
    assert index.unpublish([keys[0]]) == 1
    assert index.stats()["used_bytes"] == 3 * 2 * size
    clock.now += 1
    # Room for 4 copies per node: the next 4 keys evict the 3 stored ones, whole.
    _put(index, keys[4:])
    stats = index.stats()
    assert stats["evictions"] == 3
    assert stats["entries"] == 4
    assert stats["used_bytes"] == stats["entries"] * 2 * size
    _check(index, keys)


def test_a_reput_of_a_key_that_lost_a_copy_is_granted_the_missing_one() -> None:
    index, _, _ids = _index(nodes=3, replicas=2)
    ((first, second),) = _put(index, [_key(1)])
    index.remove_node(first.node)
    result = index.allocate([AllocationRequest(key=_key(1), length=1000)])
    (alloc,) = result.allocations
    assert alloc.kind is AllocationKind.EXISTS
    assert alloc.descriptor is not None
    assert alloc.descriptor.version == second.version
    (repair,) = alloc.replicas
    assert repair.node not in (first.node, second.node)
    assert index.publish([GrantRef.of(repair, crc=7)]) == [True]
    assert [d.version for d in _copies(index, _key(1))] == [second.version, repair.version]
    # Whole again: the next re-put moves nothing.
    (again,) = index.allocate([AllocationRequest(key=_key(1), length=1000)]).allocations
    assert again.kind is AllocationKind.EXISTS
    assert again.replicas == ()
    assert index.stats()["replica_repairs"] == 1
    _check(index, [_key(1)])


def test_all_grants_aborted_leave_nothing_and_leases_expire_every_copy() -> None:
    index, clock, _ = _index(nodes=3, replicas=3)
    ((a, b, c),) = _grants(index, [_key(1)])
    index.abort([GrantRef.of(d) for d in (a, b, c)])
    assert index.stats()["pending"] == 0
    assert index.stats()["used_bytes"] == 0
    _grants(index, [_key(2)])
    clock.now += 31
    index.tick()
    stats = index.stats()
    assert (stats["pending"], stats["used_bytes"], stats["lease_expiries"]) == (0, 0, 3)
    _check(index, [_key(1), _key(2)])


@pytest.mark.parametrize(("replicas", "kept"), [(1, 1), (2, 2)])
def test_a_key_two_nodes_report_after_a_restart_is_kept_up_to_replicas_times(
    replicas: int, kept: int
) -> None:
    index = MemoryIndex.create(IndexConfig(replicas=replicas))
    key = _key(1)
    restored = 0
    for name, rkey in (("a", 1), ("b", 2)):
        info = index.register_node(
            NodeInfo(
                name=name,
                regions=(RegionInfo(id=0, size=1 << 20, rkey=rkey),),
                endpoints=(),
                restoring=True,
            )
        )
        record = Descriptor(
            key=key, node=info.id, region=0, offset=0, length=100, rkey=rkey, version=rkey, crc=9
        )
        restored += index.restore(info.id, [record])
        index.restore_done(info.id)
    assert restored == kept
    found = index.resolve_copies([key])
    assert 1 + len(found.alternates.get(0, ())) == kept
    _check(index, [key], length=100)


def test_the_lookup_image_files_each_alternate_in_a_bucket_of_its_own() -> None:
    index, _, ids = _index(nodes=3, replicas=2)
    region = index.lookup_image()
    assert region is not None
    assert region.id == IMAGE_REGION
    image_id = ImageGeometry.from_header(region.view).image_id
    keys = [_key(i) for i in range(16)]
    copies = _put(index, keys)

    def probe(probed: list[bytes]) -> list[Descriptor]:
        hits, stop, wires = image_prefix(region.view, probed, image_id, 0.0)
        assert (hits, stop) == (len(probed), ImageStop.HIT)
        return Descriptor.many_from_bytes(wires)

    assert [d.version for d in probe(keys)] == [c[0].version for c in copies]
    alternates = probe([alternate_key(k, 1) for k in keys])
    assert [d.version for d in alternates] == [c[1].version for c in copies]
    # A lost node: its copies leave the image, the survivors are read first.
    index.remove_node(ids[0])
    survivors = [[d for d in c if d.node != ids[0]] for c in copies]
    assert [d.version for d in probe(keys)] == [s[0].version for s in survivors]
    single = [k for k, s in zip(keys, survivors, strict=True) if len(s) == 1]
    hits, stop, _ = image_prefix(region.view, [alternate_key(single[0], 1)], image_id, 0.0)
    assert (hits, stop) == (0, ImageStop.MISS)
    index.close()
