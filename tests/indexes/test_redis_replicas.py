"""The redis index with ``replicas=2``, on a real single server and a real 3+3 cluster.

A key's copies sit in the first arenas clockwise on distinct nodes, each an entry of the
arena holding it; the home's entry lists the others, so a lookup still reads the home alone.
Round trips are counted by the index itself: a put of two copies is still two rounds, a
re-put one, a lookup one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis_fixtures import keys_left, redis_index
from redis_servers import RedisDeployment

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    NodeInfo,
    RegionInfo,
)

_MIB = 1 << 20


def _keys(n: int) -> list[bytes]:
    return [fold_key(i, b"replicas" + str(time.monotonic_ns()).encode()) for i in range(n)]


def _node(name: str, rkey: int, *, restoring: bool = False) -> NodeInfo:
    regions = (RegionInfo(id=0, size=4 * _MIB, rkey=rkey),)
    return NodeInfo(name=name, regions=regions, endpoints=(), restoring=restoring)


@pytest.fixture(params=["redis_single", "redis_cluster"])
def deployment(request: pytest.FixtureRequest) -> RedisDeployment:
    found: RedisDeployment = request.getfixturevalue(request.param)
    return found


@pytest.fixture
def index(deployment: RedisDeployment) -> Iterator[RedisIndex]:
    made = redis_index(deployment, IndexConfig(grace=0.0, headroom=0.0, replicas=2))
    assert isinstance(made, RedisIndex)
    for n in range(3):
        made.register_node(_node(f"n{n}", 100 + n))
    yield made
    namespace = made.namespace
    made.purge()
    made.close()
    assert keys_left(deployment, namespace) == 0


def _grants(index: RedisIndex, keys: list[bytes]) -> list[list[Descriptor]]:
    result = index.allocate([AllocationRequest(key=k, length=1000) for k in keys])
    out = []
    for a in result.allocations:
        assert a.kind is AllocationKind.GRANTED
        assert a.descriptor is not None
        out.append([a.descriptor, *a.replicas])
    return out


def _copies(index: RedisIndex, keys: list[bytes]) -> list[list[int]]:
    """Each key's copies, by version, the one read first first ([] for a miss)."""
    found = index.resolve_copies(keys)
    return [
        [] if d is None else [d.version, *(a.version for a in found.alternates.get(i, ()))]
        for i, d in enumerate(found.descriptors)
    ]


def _rounds(index: RedisIndex) -> int:
    return index.round_trip_counts()["rounds"]


def test_two_copies_on_distinct_nodes_in_two_rounds_and_a_lookup_returns_both(
    index: RedisIndex,
) -> None:
    keys = _keys(48)
    before = _rounds(index)
    copies = _grants(index, keys)
    assert index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]) == [True] * 96
    assert _rounds(index) - before == 2
    for key, (first, second) in zip(keys, copies, strict=True):
        assert first.node != second.node
        assert (first.node, first.region) == index.home(key)
    before = _rounds(index)
    found = index.lookup_copies(keys)
    assert _rounds(index) - before == 1
    assert [d.version for d in found.descriptors if d is not None] == [c[0].version for c in copies]
    assert {i: [a.version for a in alts] for i, alts in found.alternates.items()} == {
        i: [c[1].version] for i, c in enumerate(copies)
    }
    assert all(a.crc == 7 for alts in found.alternates.values() for a in alts)
    # A re-put: one round, every copy there, nothing granted.
    before = _rounds(index)
    result = index.allocate([AllocationRequest(key=k, length=1000) for k in keys])
    assert _rounds(index) - before == 1
    assert {(a.kind, a.replicas) for a in result.allocations} == {(AllocationKind.EXISTS, ())}
    stats = index.stats()
    assert (stats["entries"], stats["pending"], stats["replica_grants"]) == (96, 0, 48)


def test_a_copy_that_did_not_land_is_aborted_in_the_publish_round(index: RedisIndex) -> None:
    keys = _keys(8)
    copies = _grants(index, keys)
    before = _rounds(index)
    assert index.publish([GrantRef.of(c[0], crc=7) for c in copies]) == [True] * 8
    assert _rounds(index) - before == 1
    assert _copies(index, keys) == [[c[0].version] for c in copies]
    assert index.stats()["pending"] == 0


def test_a_key_whose_home_copy_did_not_land_is_not_published_and_its_other_copy_is_reused(
    index: RedisIndex,
) -> None:
    keys = _keys(4)
    copies = _grants(index, keys)
    assert index.publish([GrantRef.of(c[1], crc=7) for c in copies]) == [False] * 4
    assert _copies(index, keys) == [[]] * 4
    # The next put writes the home copy only and lists the copy already stored.
    again = _grants(index, keys)
    assert [len(c) for c in again] == [1] * 4
    assert all(index.publish([GrantRef.of(c[0], crc=7) for c in again]))
    assert _copies(index, keys) == [
        [a[0].version, c[1].version] for a, c in zip(again, copies, strict=True)
    ]


def test_when_the_home_node_goes_the_second_copy_is_the_new_home_and_a_reput_repairs(
    index: RedisIndex,
) -> None:
    keys = _keys(60)
    copies = _grants(index, keys)
    assert all(index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]))
    lost = copies[0][0].node
    index.remove_node(lost)
    # Every key is still found: where its home went, the arena of its second copy is home.
    survivors = [[d.version for d in c if d.node != lost] for c in copies]
    assert [found[:1] for found in _copies(index, keys)] == [s[:1] for s in survivors]
    before = _rounds(index)
    result = index.allocate([AllocationRequest(key=k, length=1000) for k in keys])
    repairs = [(i, a.replicas) for i, a in enumerate(result.allocations) if a.replicas]
    assert {a.kind for a in result.allocations} == {AllocationKind.EXISTS}
    assert len(repairs) == sum(len(s) == 1 for s in survivors) > 0
    grants = [GrantRef.of(d, crc=7) for _, replicas in repairs for d in replicas]
    assert all(index.publish(grants))
    assert _rounds(index) - before == 2
    assert all(len(found) == 2 for found in _copies(index, keys))


def test_an_invalid_copy_goes_alone(index: RedisIndex) -> None:
    keys = _keys(2)
    copies = _grants(index, keys)
    assert all(index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]))
    # The second copy of key 0 is bad: the home forgets it, its arena drops it.
    assert index.drop_invalid([GrantRef.of(copies[0][1])]) == 1
    assert _copies(index, keys) == [[copies[0][0].version], [d.version for d in copies[1]]]
    # The home copy of key 1 is bad: its other copy is read first from now on.
    assert index.drop_invalid([GrantRef.of(copies[1][0])]) == 1
    assert _copies(index, keys[1:]) == [[copies[1][1].version]]
    # ... until that one is bad too.
    assert index.drop_invalid([GrantRef.of(copies[1][1])]) == 1
    assert _copies(index, keys[1:]) == [[]]
    stats = index.stats()
    assert (stats["entries"], stats["pending"]) == (1, 0)  # key 0, its home copy


def test_a_delete_takes_every_copy(index: RedisIndex) -> None:
    keys = _keys(10)
    copies = _grants(index, keys)
    assert all(index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]))
    assert index.unpublish(keys) == 10
    stats = index.stats()
    assert (stats["entries"], stats["unpublished"], stats["replicas_dropped"]) == (0, 10, 10)


def test_grants_a_refused_key_could_not_use_are_aborted_by_the_next_round(
    index: RedisIndex, deployment: RedisDeployment
) -> None:
    (key,) = _keys(1)
    # A writer storing one copy holds the key's home grant...
    single = redis_index(
        deployment, IndexConfig(grace=0.0, headroom=0.0), namespace=index.namespace
    )
    try:
        (held,) = single.allocate([AllocationRequest(key=key, length=1000)]).allocations
        assert held.kind is AllocationKind.GRANTED
        # ... so this one is told IN_FLIGHT, though the key's other arena granted it a copy.
        (refused,) = index.allocate([AllocationRequest(key=key, length=1000)]).allocations
        assert refused.kind is AllocationKind.IN_FLIGHT
        assert refused.replicas == ()
        stats = index.stats()
        assert (stats["orphan_grants"], stats["pending"]) == (1, 2)
        index.tick()
        assert index.stats()["pending"] == 1
    finally:
        single.close()


def test_fewer_nodes_than_copies_store_one_per_node_and_count_the_shortfall(
    deployment: RedisDeployment,
) -> None:
    index = redis_index(deployment, IndexConfig(grace=0.0, headroom=0.0, replicas=3))
    assert isinstance(index, RedisIndex)
    try:
        index.register_node(_node("a", 1))
        index.register_node(_node("b", 2))
        copies = _grants(index, _keys(5))
        assert [len(c) for c in copies] == [2] * 5
        assert index.stats()["replica_shortfall"] == 5
    finally:
        index.purge()
        index.close()


def test_a_key_two_restarted_nodes_report_is_kept_twice_and_the_home_lists_the_copy(
    deployment: RedisDeployment,
) -> None:
    index = redis_index(deployment, IndexConfig(grace=0.0, headroom=0.0, replicas=2))
    assert isinstance(index, RedisIndex)
    try:
        for n in range(3):
            index.register_node(_node(f"n{n}", 100 + n))
        keys = _keys(20)
        copies = _grants(index, keys)
        assert all(index.publish([GrantRef.of(d, crc=7) for c in copies for d in c]))
        # Every node restarts (a file backend) and reports the records it holds.
        nodes = {n.name: n for n in index.nodes()}
        restored = 0
        for name, node in sorted(nodes.items()):
            registered = index.register_node(_node(name, 100 + int(name[1:]), restoring=True))
            held = [d for c in copies for d in c if d.node == node.id]
            restored += index.restore(registered.id, held)
            index.restore_done(registered.id)
        assert restored == 40
        assert [sorted(found) for found in _copies(index, keys)] == [
            sorted(d.version for d in c) for c in copies
        ]
    finally:
        index.purge()
        index.close()
