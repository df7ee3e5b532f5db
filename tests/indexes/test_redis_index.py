"""The redis index against real Redis: the shipped conformance suite, then what only it promises.

Every conformance test gets an index in a namespace of its own, purged afterwards (and checked
to have left no key behind), on a single server and on a 3-master cluster with replicas.
Round trips are counted by the index itself (``round_trip_counts``): a lookup is one round
trip per master holding any of its keys, a put is two rounds, a re-put one round and no grant.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from redis_fixtures import keys_left, namespace, redis_index
from redis_servers import RedisDeployment

from kvfabric.descriptor import Descriptor
from kvfabric.errors import ConfigError, NameInUseError, PluginUnavailableError
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
    record_size,
)
from kvfabric.testing import IndexConformance, MakeIndex, wait_for

_MIB = 1 << 20


def _keys(n: int, salt: bytes = b"redis-index") -> list[bytes]:
    return [fold_key(i, salt + str(time.monotonic_ns()).encode()) for i in range(n)]


def _node(name: str, *sizes: int, restoring: bool = False, rkey: int = 1000) -> NodeInfo:
    regions = tuple(RegionInfo(id=i, size=size, rkey=rkey + i) for i, size in enumerate(sizes))
    return NodeInfo(name=name, regions=regions, endpoints=(), restoring=restoring)


def _put(index: IndexPlugin, keys: list[bytes], length: int = 1000) -> list[AllocationKind]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    grants = [
        GrantRef.of(a.descriptor, crc=7)
        for a in result.allocations
        if a.kind is AllocationKind.GRANTED and a.descriptor is not None
    ]
    assert all(index.publish(grants))
    return [a.kind for a in result.allocations]


class _Conformance(IndexConformance):
    deployment_fixture = ""

    @pytest.fixture
    def deployment(self, request: pytest.FixtureRequest) -> RedisDeployment:
        deployment: RedisDeployment = request.getfixturevalue(self.deployment_fixture)
        return deployment

    @pytest.fixture
    def make_index(self, deployment: RedisDeployment) -> Iterator[MakeIndex]:
        made: list[RedisIndex] = []

        def make(config: IndexConfig) -> IndexPlugin:
            index = redis_index(deployment, config, node_ttl="60s")
            assert isinstance(index, RedisIndex)
            made.append(index)
            return index

        yield make
        for index in made:
            namespace = index.namespace
            index.purge()
            index.close()
            assert keys_left(deployment, namespace) == 0


class TestRedisIndexSingle(_Conformance):
    deployment_fixture = "redis_single"


class TestRedisIndexCluster(_Conformance):
    deployment_fixture = "redis_cluster"


# -- round trips, counted -------------------------------------------------------------------


@pytest.fixture
def cluster_index(redis_cluster: RedisDeployment) -> Iterator[RedisIndex]:
    index = redis_index(redis_cluster, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    # Three regions, three arenas: arena n sits on slot ⌊frac(n·φ)·16384⌋, one per master.
    index.register_node(_node("n1", _MIB, _MIB, _MIB))
    yield index
    index.purge()
    index.close()


@pytest.fixture
def single_index(redis_single: RedisDeployment) -> Iterator[RedisIndex]:
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    index.register_node(_node("n1", _MIB, _MIB, _MIB))
    yield index
    index.purge()
    index.close()


def _delta(index: RedisIndex, before: dict[str, int]) -> dict[str, int]:
    after = index.round_trip_counts()
    return {
        name: after[name] - before.get(name, 0)
        for name in after
        if after[name] != before.get(name, 0)
    }


def test_a_lookup_is_one_round_trip_per_master_holding_its_keys(cluster_index: RedisIndex) -> None:
    keys = _keys(64)
    _put(cluster_index, keys)
    masters = {cluster_index.shard_of(k) for k in keys}
    assert len(masters) == 3
    before = cluster_index.round_trip_counts()
    assert len(cluster_index.lookup_prefix(keys)) == 64
    delta = _delta(cluster_index, before)
    assert delta == {"rounds": 1, "round_trips": 3, **dict.fromkeys(masters, 1)}
    # Keys of one master only: one round trip, to that master.
    one = cluster_index.shard_of(keys[0])
    mine = [k for k in keys if cluster_index.shard_of(k) == one]
    before = cluster_index.round_trip_counts()
    assert [d.key for d in cluster_index.resolve(mine)] == mine
    assert _delta(cluster_index, before) == {"rounds": 1, "round_trips": 1, one: 1}


def test_a_put_is_two_rounds_and_a_re_put_one_round_without_a_grant(
    cluster_index: RedisIndex,
) -> None:
    keys = _keys(48)
    masters = {cluster_index.shard_of(k) for k in keys}
    before = cluster_index.round_trip_counts()
    assert _put(cluster_index, keys) == [AllocationKind.GRANTED] * 48
    assert _delta(cluster_index, before) == {
        "rounds": 2,
        "round_trips": 2 * len(masters),
        **dict.fromkeys(masters, 2),
    }
    grants = cluster_index.stats()["grants"]
    before = cluster_index.round_trip_counts()
    result = cluster_index.allocate([AllocationRequest(key=k, length=1000) for k in keys])
    assert [a.kind for a in result.allocations] == [AllocationKind.EXISTS] * 48
    assert _delta(cluster_index, before) == {
        "rounds": 1,
        "round_trips": len(masters),
        **dict.fromkeys(masters, 1),
    }
    stats = cluster_index.stats()
    assert stats["grants"] == grants
    assert stats["dedup_hits"] == 48


def test_on_a_single_server_every_call_is_one_round_trip(single_index: RedisIndex) -> None:
    keys = _keys(100)
    before = single_index.round_trip_counts()
    _put(single_index, keys)
    single_index.lookup_prefix(keys)
    single_index.exists(keys)
    single_index.unpublish(keys[:10])
    delta = _delta(single_index, before)
    assert delta["rounds"] == delta["round_trips"] == 5


# -- what only the redis index promises ---------------------------------------------------------


def test_arenas_spread_evenly_over_the_masters(redis_cluster: RedisDeployment) -> None:
    index = redis_index(redis_cluster, IndexConfig())
    assert isinstance(index, RedisIndex)
    try:
        for n in range(10):
            index.register_node(_node(f"n{n}", _MIB, _MIB, _MIB))
        keys = _keys(3000)
        counts: dict[str, int] = {}
        for key in keys:
            master = index.shard_of(key)
            counts[master] = counts.get(master, 0) + 1
        print(f"3000 keys over 30 arenas: {sorted(counts.values())} per master")
        assert len(counts) == 3
        stats = index.stats()
        assert stats["arenas"] == 30
        assert stats["shards"] == 3
    finally:
        index.purge()
        index.close()


def test_a_second_client_shares_the_index(redis_cluster: RedisDeployment) -> None:
    first = redis_index(redis_cluster, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(first, RedisIndex)
    second = RedisIndex.create(
        IndexConfig(options={"url": redis_cluster.url, "namespace": first.namespace})
    )
    try:
        node = first.register_node(_node("n1", _MIB, _MIB))
        keys = _keys(20)
        _put(first, keys)
        assert [d.key for d in second.lookup_prefix(keys)] == keys
        assert [n.id for n in second.nodes()] == [node.id]
        assert (
            second.allocate([AllocationRequest(key=keys[0], length=1000)]).allocations[0].kind
            is AllocationKind.EXISTS
        )
    finally:
        first.purge()
        first.close()
        second.close()


def test_drop_invalid_removes_only_the_reported_version(single_index: RedisIndex) -> None:
    keys = _keys(3)
    _put(single_index, keys)
    found = single_index.resolve(keys)
    assert all(d is not None for d in found)
    stale = GrantRef(key=keys[0], version=found[0].version + 1 if found[0] else 0)
    current = [GrantRef.of(d) for d in found[1:] if d is not None]
    assert single_index.drop_invalid([stale, *current]) == 2
    assert single_index.exists(keys) == [True, False, False]
    assert single_index.stats()["invalid_reports"] == 2


def test_a_node_that_stops_heartbeating_is_dropped_with_its_entries(
    redis_single: RedisDeployment,
) -> None:
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0), node_ttl="400ms")
    assert isinstance(index, RedisIndex)
    try:
        quiet = index.register_node(_node("quiet", _MIB))
        alive = index.register_node(_node("alive", _MIB))
        keys = _keys(40)
        _put(index, keys)
        on_quiet = [d.key for d in index.resolve(keys) if d is not None and d.node == quiet.id]
        assert on_quiet

        def beat_and_tick() -> list[str]:
            assert index.heartbeat(alive.id, alive.incarnation)
            index.tick()
            return [n.name for n in index.nodes()]

        wait_for(
            "the quiet node dropped",
            beat_and_tick,
            until=lambda names: names == ["alive"],
            every=0.1,  # alive heartbeats well inside its 400 ms
        )
        assert index.exists(on_quiet) == [False] * len(on_quiet)
        assert index.stats()["nodes_expired"] == 1
        # The dropped node must register again: its old incarnation is refused.
        assert not index.heartbeat(quiet.id, quiet.incarnation)
        back = index.register_node(_node("quiet", _MIB))
        assert back.id == quiet.id
        assert back.incarnation > quiet.incarnation
    finally:
        index.purge()
        index.close()


def test_a_live_nodes_name_is_refused_to_another_process(redis_single: RedisDeployment) -> None:
    index = redis_index(redis_single, IndexConfig(), node_ttl="500ms")
    assert isinstance(index, RedisIndex)
    try:
        first = index.register_node(attrs.evolve(_node("n1", _MIB), instance=1))
        # The same process registering again is a restart of the node: fine.
        again = index.register_node(attrs.evolve(_node("n1", _MIB), instance=1))
        assert again.id == first.id
        with pytest.raises(NameInUseError, match="belongs to a live node"):
            index.register_node(attrs.evolve(_node("n1", _MIB), instance=2))

        def take_the_name() -> NodeInfo | None:
            try:
                return index.register_node(attrs.evolve(_node("n1", _MIB), instance=2))
            except NameInUseError:
                return None

        # n1 stopped heartbeating: its name is free once its liveness key expires.
        taken = wait_for("n1's name free", take_the_name, every=0.1)
        assert taken.id == first.id
        assert taken.incarnation > again.incarnation
    finally:
        index.purge()
        index.close()


def test_eviction_takes_the_least_recently_read_entry(redis_single: RedisDeployment) -> None:
    """Recency is Redis's own LRU clock of the entry (OBJECT IDLETIME, 1 s resolution)."""
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    try:
        index.register_node(_node("n1", 4 * record_size(1000)))
        keys = _keys(5)
        _put(index, keys[:4])
        time.sleep(2.2)  # time passing is the point: ages apart on Redis's 1 s LRU clock
        index.lookup_prefix([keys[0], keys[1], keys[3]])  # keys[2] is the only one not read
        result = index.allocate([AllocationRequest(key=keys[4], length=1000)])
        assert result.evictions == 1
        assert index.exists(keys[:4]) == [True, True, False, True]
    finally:
        index.purge()
        index.close()


def test_a_record_restored_where_another_arena_owns_its_key(redis_single: RedisDeployment) -> None:
    """The record stays where the node found it; the key's arena points to it, and the slot
    comes back when the entry goes."""
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    try:
        one = index.register_node(_node("n1", _MIB, restoring=True))
        two = index.register_node(_node("n2", _MIB, restoring=True))
        key = next(k for k in _keys(200) if index.home(k)[0] == two.id)
        record = Descriptor(
            key=key, node=0, region=0, offset=4096, length=1000, rkey=0, version=77, crc=5
        )
        assert index.restore(one.id, [record]) == 1
        index.restore_done(one.id)
        index.restore_done(two.id)
        (found,) = index.resolve([key])
        assert found is not None
        assert (found.node, found.region, found.offset, found.rkey) == (one.id, 0, 4096, 1000)
        assert (found.version, found.crc) == (77, 5)
        assert index.stats()["used_bytes"] == record_size(1000)
        assert index.unpublish([key]) == 1
        assert index.stats()["used_bytes"] == 0
        # Restored again, then its node goes: the entry in the other node's arena goes too.
        index.register_node(_node("n1", _MIB, restoring=True))
        assert index.restore(one.id, [record]) == 1
        assert index.remove_node(one.id) == 1
        assert index.exists([key]) == [False]
    finally:
        index.purge()
        index.close()


def test_a_node_done_restoring_is_listed_as_such_and_its_lost_arena_takes_grants_again(
    redis_single: RedisDeployment,
) -> None:
    """After ``restore_done`` the registry lists the node and its arenas as not restoring:
    an arena whose keys were lost (a shard that lost its data) is made again from the
    registry and takes grants at once. (The registry kept the registration's flag: the
    arena was made again restoring, refusing every grant for good.)"""
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    try:
        node = index.register_node(_node("n1", _MIB, restoring=True))
        assert [n.restoring for n in index.nodes()] == [True]
        index.restore_done(node.id)
        assert [n.restoring for n in index.nodes()] == [False]
        assert [(n.id, n.incarnation) for n in index.nodes()] == [(node.id, node.incarnation)]
        client = redis_single.client(redis_single.servers[0].port)
        [arena] = index._view.refresh().arenas.values()
        assert not arena.restoring
        lost = list(client.scan_iter(match=arena.prefix + b"*"))
        assert lost
        client.delete(*lost)
        assert _put(index, _keys(8)) == [AllocationKind.GRANTED] * 8
    finally:
        index.purge()
        index.close()


def test_an_arena_made_from_the_old_registry_after_redis_restarted_empty_is_made_again(
    redis_single: RedisDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarted empty between a node's reading of the registry and the making of its
    arena: the old registry's arena is made in the new Redis, under an id the new registry
    gives out again. When the node registers again (restoring), the making of its new arena
    clears that one and makes it as listed now, and every record the node reports is
    restored. (It was kept: every claim was refused, "restored 0 of 21 records", seen with
    node processes beside a busy one.) An older registry's making of it later changes
    nothing."""
    config = IndexConfig(grace=0.0, headroom=0.0)
    shared = namespace()
    first = redis_index(redis_single, config, namespace=shared)
    second = redis_index(redis_single, config, namespace=shared)
    assert isinstance(first, RedisIndex)
    assert isinstance(second, RedisIndex)
    port = redis_single.servers[0].port
    try:
        first.register_node(_node("n1", _MIB))
        read = second._view.refresh
        before_restart: list[Any] = []

        def read_then_restart(*, force: bool = False) -> Any:
            view = read(force=force)
            before_restart.append(view)
            redis_single.restart(port)
            monkeypatch.setattr(second._view, "refresh", read)
            return view

        monkeypatch.setattr(second._view, "refresh", read_then_restart)
        second.register_node(_node("n2", _MIB))  # its arena is made in the new, empty Redis
        [old_view] = before_restart

        again = [
            first.register_node(_node("n1", _MIB, restoring=True)),
            second.register_node(_node("n2", _MIB, restoring=True)),
        ]
        reported: list[bytes] = []
        expected: list[tuple[int, int, int]] = []
        for index, node in zip((first, second), again, strict=True):
            records = [
                Descriptor(
                    key=k,
                    node=0,
                    region=0,
                    offset=i * 4096,
                    length=1000,
                    rkey=0,
                    version=i + 1,
                    crc=9,
                )
                for i, k in enumerate(_keys(20, salt=node.name.encode()))
            ]
            assert index.restore(node.id, records) == len(records)
            index.restore_done(node.id)
            reported += [r.key for r in records]
            expected += [(node.id, r.offset, r.version) for r in records]
        # The older registry's making of the id now given to n2's arena leaves it as it is.
        stale = [a for a in old_view.arenas.values() if a.node == again[1].id]
        assert stale
        second._registry.init_arenas(old_view, stale)
        found = first.resolve(reported)
        assert [(d.node, d.offset, d.version) if d else None for d in found] == expected
        assert _put(first, _keys(8)) == [AllocationKind.GRANTED] * 8
    finally:
        first.purge()
        first.close()
        second.close()


def test_evicting_a_restored_record_drops_its_entry_in_the_other_arena(
    redis_single: RedisDeployment,
) -> None:
    index = redis_index(redis_single, IndexConfig(grace=0.0, headroom=0.0))
    assert isinstance(index, RedisIndex)
    try:
        one = index.register_node(_node("n1", 4 * record_size(1000), restoring=True))
        two = index.register_node(_node("n2", _MIB, restoring=True))
        candidates = _keys(400)
        key = next(k for k in candidates if index.home(k)[0] == two.id)
        record = Descriptor(
            key=key, node=0, region=0, offset=0, length=1000, rkey=0, version=9, crc=1
        )
        assert index.restore(one.id, [record]) == 1
        index.restore_done(one.id)
        index.restore_done(two.id)
        # Fill node 1: the restored record (unread since) is the cheapest to evict.
        local = [k for k in candidates if index.home(k)[0] == one.id][:4]
        assert _put(index, local[:3]) == [AllocationKind.GRANTED] * 3
        result = index.allocate([AllocationRequest(key=local[3], length=1000)])
        assert result.allocations[0].kind is AllocationKind.GRANTED
        assert result.allocations[0].descriptor is not None
        assert result.allocations[0].descriptor.offset == 0
        assert result.evictions == 1
        assert index.exists([key]) == [False]
        assert index.stats()["hosted_drops"] == 1
    finally:
        index.purge()
        index.close()


def test_over_tls_with_a_password(redis_single: RedisDeployment) -> None:
    """rediss:// with the certificate authority in the URL, and AUTH; a wrong password is a
    configuration error, not an outage."""
    with RedisDeployment.single(password="s3cret", tls=True) as secured:
        assert secured.url.startswith("rediss://:s3cret@")
        index = redis_index(secured, IndexConfig(grace=0.0, headroom=0.0))
        assert isinstance(index, RedisIndex)
        try:
            index.register_node(_node("n1", _MIB))
            keys = _keys(10)
            _put(index, keys)
            assert [d.key for d in index.lookup_prefix(keys)] == keys
        finally:
            index.purge()
            index.close()
        wrong = RedisIndex.create(
            IndexConfig(options={"url": secured.url.replace("s3cret", "wrong")})
        )
        with pytest.raises(ConfigError, match="user:password@"):
            wrong.nodes()
        wrong.close()


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="redis:// or rediss://"):
        RedisIndex.parse_options({"url": "http://127.0.0.1:6379"})
    with pytest.raises(ConfigError, match="namespace"):
        RedisIndex.parse_options({"namespace": "a b"})
    with pytest.raises(ConfigError, match=r"did you mean redis\.namespace"):
        RedisIndex.parse_options({"namespac": "x"})
    assert RedisIndex.parse_options({"node_ttl": "500ms"})["node_ttl"] == 0.5


def test_without_redis_py_the_plugin_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(PluginUnavailableError, match=r"pip install 'kvfabric\[redis\]'"):
        RedisIndex.check_available()
