"""KV events with the index in Redis: one relay for the whole deployment.

Data-node processes register with Redis (no controller in the data path) and clients write,
delete and evict through the redis index's functions; a controller started with ``--index
redis --kv-events`` relays what those functions append to each arena's stream. A router
that applies the events in order must end up believing exactly what the tier holds, on one
server and on the 3-master cluster; with no relay the functions write no stream at all.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from kv_event_subscriber import Named, Subscriber, engine_chain, follows
from redis_servers import RedisDeployment

import kvfabric
from kvfabric.testing import Cluster, free_port, wait_for

pytestmark = pytest.mark.slow


def _master_ports(deployment: RedisDeployment) -> list[int]:
    if deployment.is_cluster:
        return sorted(deployment.masters())
    return [deployment.servers[0].port]


def _arena_keys(deployment: RedisDeployment, namespace: str, suffix: str) -> list[bytes]:
    """Every arena key of ``namespace`` ending in ``suffix`` (``m`` meta, ``v`` stream)."""
    found: list[bytes] = []
    for port in _master_ports(deployment):
        client = deployment.client(port)
        try:
            found += list(client.scan_iter(match=f"*{namespace}:a*:{suffix}", count=1000))
        finally:
            client.close()
    return found


def _relay_asks(deployment: RedisDeployment, namespace: str) -> bool:
    """Whether every arena's functions are told to write events (its meta's ``ev``)."""
    import redis

    metas = _arena_keys(deployment, namespace, "m")
    asked: set[bytes] = set()
    for port in _master_ports(deployment):
        client = deployment.client(port)
        try:
            for meta in metas:
                try:
                    if client.hget(meta, "ev") is not None:
                        asked.add(meta)
                except redis.exceptions.MovedError:
                    continue  # another master serves it
        finally:
            client.close()
    return bool(metas) and asked == set(metas)


@pytest.fixture(scope="module", params=["single", "cluster"])
def deployment(request: pytest.FixtureRequest) -> RedisDeployment:
    return request.getfixturevalue(f"redis_{request.param}")


@pytest.fixture(scope="module")
def cluster(deployment: RedisDeployment) -> Iterator[Cluster]:
    nodes = 3 if deployment.is_cluster else 1
    with Cluster(nodes=nodes, capacity="2MiB", redis=deployment.url) as cluster:
        cluster.wait_nodes(nodes)
        yield cluster


@pytest.fixture(scope="module")
def store(cluster: Cluster) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(cluster.url(timeout="60s")) as store:
        yield store


@pytest.fixture(scope="module")
def named() -> Named:
    return Named()


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def relay(
    cluster: Cluster,
    store: kvfabric.Store,
    named: Named,
    deployment: RedisDeployment,
    ports: tuple[int, int],
) -> Iterator[subprocess.Popen[bytes]]:
    # Before any relay: clients' writes, deletes and evictions leave no stream behind.
    keys = named.put(store, 8)
    assert store.delete(keys[:2]) == 2
    for _ in range(8):  # 8 x 16 x 64 KiB: more than the nodes' 2 MiB each hold
        keys += named.put(store, 16)
    assert not all(store.batched_exists(keys[2:])), "nothing was evicted"
    assert _arena_keys(deployment, cluster.namespace, "m")
    assert _arena_keys(deployment, cluster.namespace, "v") == []
    # Emptied again (untold too), so that what the tests put next fits.
    store.delete([k for k, held in zip(keys, store.batched_exists(keys), strict=True) if held])
    assert not any(store.batched_exists(keys))
    named.names.clear()
    pub, replay = ports
    args = [sys.executable, "-m", "kvfabric", "controller", "--listen"]
    args += [f"127.0.0.1:{free_port()}", "--index", "redis"]
    for option, value in cluster.index_options().items():
        args += ["--index-opt", f"{option}={value}"]
    args += ["--kv-events", f"tcp://*:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
    process = subprocess.Popen(args)
    try:
        wait_for(
            "the relay asks every arena for events",
            lambda: _relay_asks(deployment, cluster.namespace),
            60,
        )
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def subscriber(relay: subprocess.Popen[bytes], ports: tuple[int, int]) -> Iterator[Subscriber]:
    pub, replay = ports
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    sub.replay_from(0)
    try:
        yield sub
    finally:
        sub.close()


def test_a_router_following_the_relay_holds_exactly_what_clients_stored(
    store: kvfabric.Store, subscriber: Subscriber, named: Named, deployment: RedisDeployment
) -> None:
    plain = named.put(store, 8)
    engine = named.put(store, 4, blocks=engine_chain(4, first=1000))
    assert store.delete([plain[0], plain[1], engine[3]]) == 3
    wait_for("the events of the puts and deletes", lambda: follows(subscriber, named, store))
    events = subscriber.events()
    assert events[0] == {"type": "AllBlocksCleared"}  # the controller's first word
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert set(plain) <= set(stored)
    assert {b.hash for b in engine_chain(4, first=1000)} <= set(stored)
    # In order per key: each deleted key's store comes before its removal.
    order = [
        (e["type"], h) for e in events if e["type"] != "AllBlocksCleared" for h in e["block_hashes"]
    ]
    for name in (plain[0], plain[1], (1003).to_bytes(8, "big")):
        assert order.index(("BlockStored", name)) < order.index(("BlockRemoved", name))
    if not deployment.is_cluster:
        # One arena: the chain is one function call's, so one BlockStored as vLLM sends it.
        chain = next(e for e in events if (1000).to_bytes(8, "big") in e.get("block_hashes", ()))
        assert chain["block_hashes"] == [b.hash for b in engine_chain(4, first=1000)]
        assert chain["token_ids"] == list(range(64))
        assert chain["block_size"] == 16
    seqs = [seq for seq, _ in subscriber.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_evictions_are_told_as_removals(
    store: kvfabric.Store, subscriber: Subscriber, named: Named
) -> None:
    before = set(named.held(store))
    mine: list[bytes] = []
    for _ in range(6):  # 6 x 16 x 64 KiB: more than the nodes' 2 MiB each can hold
        mine += named.put(store, 16)
    wait_for("the events of the evictions", lambda: follows(subscriber, named, store))
    # Whichever values made room (earlier tests' or this test's first puts: placement
    # decides), each was evicted and must have been told.
    gone = (before | {named.names[k] for k in mine}) - named.held(store)
    assert gone, "nothing was evicted"
    removed = {
        h for e in subscriber.events() if e["type"] == "BlockRemoved" for h in e["block_hashes"]
    }
    assert gone <= removed


def test_a_subscriber_that_was_away_recovers_the_gap_through_replay(
    store: kvfabric.Store, subscriber: Subscriber, named: Named, ports: tuple[int, int]
) -> None:
    pub, replay = ports
    witness = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        witness.replay_from(0)
        subscriber.disconnect()
        away = named.put(store, 4)

        def witnessed() -> bool:
            witness.poll()
            if set(away) <= witness.view():
                return True
            away.extend(named.put(store, 1))  # ...until the witness's connection is up
            return False

        wait_for("the events sent while the subscriber was away", witnessed)
    finally:
        witness.close()
    subscriber.reconnect()
    gaps = subscriber.gaps

    def caught_up() -> bool:
        if subscriber.gaps == gaps:
            named.put(store, 1)  # ...until a later batch shows the gap
        return follows(subscriber, named, store)

    wait_for("the subscriber caught up through replay", caught_up)
    assert subscriber.gaps > gaps
    assert subscriber.replayed > 0
