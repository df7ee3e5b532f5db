"""Faults of a store whose index is in Redis, with real data-node processes and clients.

* kill -9 of a Redis master under load: four clients put, look up and read, checking every
  byte, while a master holding some of the arenas is killed. Its keys miss (reads) and are
  refused (puts) until the cluster promotes its replica; then puts and lookups of its keys
  work again, and no value read is ever wrong. The times are printed.
* kill -9 of a data node with two copies of each value: every key still hits, in the same
  get that found the node dead (the reads that fell over are counted), and again once the
  node is dropped from the registry, when the arenas of the second copies are the keys'
  homes.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from redis_servers import RedisDeployment

import kvfabric
from kvfabric import PutOutcome
from kvfabric._client import shared_index
from kvfabric._client.shared_index import IndexUpkeep
from kvfabric._client.store import Store
from kvfabric.errors import KvfabricError
from kvfabric.keys import chain_keys
from kvfabric.spi import IndexPlugin
from kvfabric.testing import Cluster, wait_for

_RECOVERY_LIMIT = 60.0
"""Seconds after the kill by which the replica must have taken over: a bound on a hang,
not a measure of speed (it takes 2-3 s here)."""


def _value(key: bytes, size: int = 2048) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


class _Load:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.wrong = 0
        self.reads = 0
        self.hits = 0
        self.stored: list[bytes] = []
        self.victim_put_at: float | None = None
        self.victim_hit_at: float | None = None
        self.errors: list[str] = []


@pytest.fixture
def nodes(redis_cluster: RedisDeployment) -> Iterator[Cluster]:
    # node_ttl well above a failover: the registry's master may be the one killed.
    with Cluster(
        nodes=2, transports=("tcp",), capacity="256MiB", redis=redis_cluster.url, node_ttl="30s"
    ) as cluster:
        yield cluster


def _client(
    url: str, keys: list[bytes], victims: set[bytes], load: _Load, killed: list[float]
) -> None:
    """Put batches of new keys, look up and read back the last ones stored, check every
    byte; once the master is killed, note when a put of one of its keys (started after
    the kill) is stored, and when a lookup of one stored before finds it."""
    try:
        with kvfabric.connect(url) as store:
            mine: list[bytes] = []
            for start in range(0, len(keys), 8):
                if load.stop.is_set():
                    break
                batch = keys[start : start + 8]
                began = time.monotonic()
                outcomes = store.batched_put(batch, [_value(k) for k in batch])
                after_kill = bool(killed) and began > killed[0]
                for key, outcome in zip(batch, outcomes, strict=True):
                    if outcome is PutOutcome.STORED:
                        mine.append(key)
                        if after_kill and key in victims and load.victim_put_at is None:
                            load.victim_put_at = time.monotonic() - killed[0]
                recent = mine[-32:]
                store.batched_contains(recent)
                got = store.batched_get(recent)
                with load.lock:
                    load.reads += len(recent)
                    for key, value in zip(recent, got, strict=True):
                        if value is not None:
                            load.hits += 1
                            load.wrong += bytes(value) != _value(key)
                if after_kill and load.victim_hit_at is None:
                    old = next((k for k in mine[:64] if k in victims), None)
                    if old is not None and store.batched_contains([old]) == 1:
                        load.victim_hit_at = time.monotonic() - killed[0]
            with load.lock:
                load.stored += mine
    except Exception as exc:  # the test reports it, failing
        load.errors.append(repr(exc))


@pytest.mark.slow
def test_killing_a_redis_master_under_load_loses_no_value_and_work_resumes_after_failover(
    redis_cluster: RedisDeployment, nodes: Cluster
) -> None:
    index = nodes.index()
    pools = [chain_keys(list(range(20_000)), 1, namespace=uuid.uuid4().bytes) for _ in range(4)]
    # The victim: a master holding the home arenas of some keys, with a replica in sync.
    by_master: dict[str, int] = {}
    for key in pools[0][:2000]:
        shard = index.shard_of(key)
        by_master[shard] = by_master.get(shard, 0) + 1
    # Not the server the URL names: a client starting later finds the cluster through it.
    seed = nodes.redis.rsplit(":", 1)[1] if nodes.redis else ""
    victim_port = next(
        port
        for port in redis_cluster.masters()
        if f"127.0.0.1:{port}" in by_master
        and str(port) != seed
        and int(redis_cluster.client(port).info("replication").get("connected_slaves", 0)) >= 1
    )
    victim = f"127.0.0.1:{victim_port}"
    victims = {k for pool in pools for k in pool if index.shard_of(k) == victim}
    load = _Load()
    killed: list[float] = []
    url = nodes.url(transport="tcp", timeout="10s")
    threads = [
        threading.Thread(target=_client, args=(url, pool, victims, load, killed)) for pool in pools
    ]
    for thread in threads:
        thread.start()
    try:
        # The kill lands in the midst of the load: each client has stored and read back
        # keys of its own by then (a batch reads back at most 32).
        wait_for("the clients storing and reading", lambda: load.reads, until=lambda n: n >= 2048)
        redis_cluster.kill(victim_port)
        killed.append(time.monotonic())
        healthy = redis_cluster.wait_healthy(timeout=_RECOVERY_LIMIT)
        wait_for(
            "the killed master's keys stored and hit again (or the clients done)",
            lambda: (load.victim_put_at, load.victim_hit_at, any(t.is_alive() for t in threads)),
            _RECOVERY_LIMIT,
            until=lambda seen: None not in seen[:2] or not seen[2],
        )
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=120)
    print(
        f"\nmaster {victim} killed: cluster healthy after {healthy:.1f} s; its keys stored "
        f"again after {load.victim_put_at} s and hit again after {load.victim_hit_at} s; "
        f"{load.hits} of {load.reads} reads hit, {load.wrong} wrong; "
        f"{len(load.stored)} keys stored by 4 clients"
    )
    assert load.errors == []
    assert load.wrong == 0
    assert load.victim_put_at is not None
    assert load.victim_hit_at is not None
    # Everything stored since reads back right (a miss allowed: a publish the master
    # acknowledged in its last replication window is lost with it).
    with kvfabric.connect(url) as store:
        sample = load.stored[-2000:]
        got = store.batched_get(sample)
    assert all(v is None or bytes(v) == _value(k) for k, v in zip(sample, got, strict=True))
    assert sum(v is not None for v in got) >= len(sample) * 0.99


@pytest.fixture
def three_nodes(redis_single: RedisDeployment) -> Iterator[Cluster]:
    with Cluster(
        nodes=3, transports=("tcp",), capacity="64MiB", redis=redis_single.url, node_ttl="2s"
    ) as cluster:
        yield cluster


def test_killing_a_data_node_with_two_copies_loses_no_hit(three_nodes: Cluster) -> None:
    url = three_nodes.url(transport="tcp", timeout="2s", replicas="2")
    keys = chain_keys(list(range(96)), 1, namespace=uuid.uuid4().bytes)
    values = [os.urandom(4096) for _ in keys]
    with kvfabric.connect(url) as store:
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 96
        victim = next(n.id for n in three_nodes.node_infos() if n.name == "node1")
        first_on_victim = sum(d is not None and d.node == victim for d in store.locate(keys))
        found = three_nodes.index().resolve_copies(keys)
        copies_on_victim = sum(
            victim in {d.node for d in (first, *found.alternates.get(i, ())) if d is not None}
            for i, first in enumerate(found.descriptors)
        )
        assert 0 < first_on_victim < copies_on_victim
        assert store.batched_contains(keys) == 96
        three_nodes.kill_node(1)
        before = store.stats()
        got = store.batched_get(keys)
        after = store.stats()
        assert [bytes(v) if v is not None else None for v in got] == values
        fell_over = {
            name: after[name] - before[name]
            for name in ("replica_reads", "replica_hits", "control_rpcs")
        }
        print(
            f"\ndata node killed: {first_on_victim} of 96 keys read from their other copy: "
            f"{fell_over}"
        )
        assert fell_over == {
            "replica_reads": first_on_victim,
            "replica_hits": first_on_victim,
            "control_rpcs": 0,
        }
        # Once the node's liveness key expires it is dropped: the second copies' arenas
        # are the keys' homes, and every key is found there without falling over.
        wait_for(
            "the killed node dropped",
            three_nodes.node_infos,
            until=lambda infos: len(infos) <= 2,
            context=three_nodes.tail,
        )
        assert len(three_nodes.node_infos()) == 2
        store.ping()
        before = store.stats()
        assert store.batched_contains(keys) == 96
        assert [bytes(v) if v is not None else None for v in store.batched_get(keys)] == values
        after = store.stats()
        assert after["replica_reads"] == before["replica_reads"]
        # A re-put gives every key that had a copy there its second copy back.
        before = store.stats()
        store.batched_put(keys, values)
        repaired = store.stats()["replica_repairs"] - before["replica_repairs"]
    assert repaired == copies_on_victim


def test_a_redis_restarted_empty_gets_the_nodes_and_their_records_back(
    redis_single: RedisDeployment,
) -> None:
    """Redis restarted without persistence: each node finds its registration gone,
    registers again and reports the records its memory holds (as after a controller
    restart); the client reads the new registry (a new birth, its epochs counted afresh)
    and finds every value again, and stores new ones."""
    with Cluster(nodes=2, transports=("tcp",), capacity="64MiB", redis=redis_single.url) as nodes:
        # A node stopped and started again: the registry's epoch moves on, past where the
        # new registry will be when both nodes are back.
        stopping = nodes.nodes[1]
        assert stopping is not None
        stopping.stop()  # SIGTERM: it deregisters
        nodes.nodes[1] = None
        nodes.wait_nodes(1)
        nodes.start_node(1)
        nodes.wait_nodes(2)
        keys = chain_keys(list(range(64)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(1000) for _ in keys]
        with kvfabric.connect(nodes.url(transport="tcp")) as store:
            assert store.batched_put(keys[:32], values[:32]) == [PutOutcome.STORED] * 32
            redis_single.restart(redis_single.servers[0].port)
            wait_for(
                "redis restarted empty: every key found again",
                lambda: store.batched_contains(keys[:32]),
                until=lambda hits: hits == 32,
                context=nodes.tail,
            )
            assert store.batched_put(keys, values) == (
                [PutOutcome.DEDUPLICATED] * 32 + [PutOutcome.STORED] * 32
            )
            assert store.batched_contains(keys) == 64
            assert [bytes(v) if v is not None else None for v in store.batched_get(keys)] == values


def test_nodes_back_under_new_incarnations_before_the_first_tick_are_relearned(
    redis_single: RedisDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarted empty between a client's connect and its upkeep's first tick, the
    nodes registered again (new incarnations) by the time that tick runs: the tick compares
    with the nodes the store learned at connect, tells the store, and the store's next put
    goes to the nodes as they are now. (It used to take that tick's answer as its baseline,
    so the store kept the old incarnations and its puts failed for good.) The ticks are run
    by the test, so the order is certain."""
    upkeeps: list[IndexUpkeep] = []

    def upkeep_run_by_the_test(index: IndexPlugin, store: Store) -> IndexUpkeep:
        upkeeps.append(IndexUpkeep(index, store, interval=None))
        return upkeeps[-1]

    monkeypatch.setattr(shared_index, "IndexUpkeep", upkeep_run_by_the_test)
    with Cluster(nodes=2, transports=("tcp",), capacity="64MiB", redis=redis_single.url) as nodes:
        keys = chain_keys(list(range(64)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(1000) for _ in keys]
        with kvfabric.connect(nodes.url(transport="tcp")) as store:
            [upkeep] = upkeeps
            learned = store.learned_nodes
            assert learned is not None
            assert len(learned) == 2
            assert store.batched_put(keys[:32], values[:32]) == [PutOutcome.STORED] * 32

            redis_single.restart(redis_single.servers[0].port)

            # Until both nodes are registered again, under new incarnations (read past the
            # store, whose routes are what is tested). Another client ticks the index
            # meanwhile, as every client of a deployment does (this store's ticks are the
            # test's).
            def registered() -> set[tuple[int, int]]:
                try:
                    nodes.index().tick()
                    return {(n.id, n.incarnation) for n in nodes.index().nodes()}
                except KvfabricError:
                    return set()

            back = wait_for(
                "both nodes registered again, under new incarnations",
                registered,
                until=lambda back: len(back) == 2 and back.isdisjoint(learned),
                context=nodes.tail,
                every=0.1,
            )

            assert upkeep.check() is True
            # Each node reports its records once registered: every key is found again (a
            # node registering while Redis restarted used to restore none of its own).
            wait_for(
                "every key found again",
                lambda: store.batched_contains(keys[:32]),
                until=lambda hits: hits == 32,
                context=nodes.tail,
            )
            # Every put lands on the nodes as they are now: none fails for a stale route.
            outcomes = store.batched_put(keys, values)
            assert outcomes == [PutOutcome.DEDUPLICATED] * 32 + [PutOutcome.STORED] * 32
            assert [bytes(v) if v is not None else None for v in store.batched_get(keys)] == values
        # A store that learned the nodes as they are: its first tick sees no change, so it
        # costs no relearn (the vLLM load path counts 0 control calls).
        with kvfabric.connect(nodes.url(transport="tcp")) as late:
            assert late.learned_nodes == back
            assert upkeeps[-1].check() is False
