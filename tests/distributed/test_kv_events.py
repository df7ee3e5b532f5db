"""KV events from real processes, read the way a router reads vLLM's: plain msgpack here
(the vllm env reads them again with vLLM's own classes).

A router that applies the events in order must end up believing exactly what the tier
holds: every store, delete and eviction told, the blocks named by the engine's hashes where
the writer attached them, gaps filled from the replay socket, and a clear after a restart
that lost the index.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kv_event_subscriber import Named, Subscriber, engine_chain, follows

import kvfabric
from kvfabric.testing import Cluster, free_port, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def cluster(ports: tuple[int, int]) -> Iterator[Cluster]:
    pub, replay = ports
    events = ["--kv-events", f"tcp://*:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
    with Cluster(nodes=1, capacity="2MiB", controller_args=events) as cluster:
        cluster.wait_nodes(1)
        yield cluster


@pytest.fixture(scope="module")
def store(cluster: Cluster) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(cluster.url(retry_interval="200ms")) as store:
        yield store


@pytest.fixture(scope="module")
def subscriber(ports: tuple[int, int]) -> Iterator[Subscriber]:
    pub, replay = ports
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    # Everything since the controller started (it keeps the batches for replay), then live.
    sub.replay_from(0)
    try:
        yield sub
    finally:
        sub.close()


@pytest.fixture(scope="module")
def named() -> Named:
    return Named()


def test_a_router_following_the_events_holds_exactly_what_the_tier_holds(
    store: kvfabric.Store, subscriber: Subscriber, named: Named
) -> None:
    plain = named.put(store, 8)
    engine = named.put(store, 4, blocks=engine_chain(4, first=1000))
    assert store.delete([plain[0], plain[1], engine[3]]) == 3
    wait_for("the events of the puts and deletes", lambda: follows(subscriber, named, store))
    events = subscriber.events()
    assert events[0] == {"type": "AllBlocksCleared"}  # the controller's first word
    stored = [e for e in events if e["type"] == "BlockStored"]
    # Without blocks, each key alone, named by itself (32 bytes); with them, one chain as
    # vLLM's own events run: hashes, parent and tokens.
    assert [e["block_hashes"] for e in stored[:8]] == [[k] for k in plain]
    assert all(e["medium"] == "kvfabric" and e["parent_block_hash"] is None for e in stored[:8])
    assert stored[8]["block_hashes"] == [b.hash for b in engine_chain(4, first=1000)]
    assert stored[8]["parent_block_hash"] is None
    assert stored[8]["token_ids"] == list(range(64))
    assert stored[8]["block_size"] == 16
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed == [plain[0], plain[1], (1003).to_bytes(8, "big")]
    # Sequence numbers count up by one; nothing was lost on the way.
    seqs = [seq for seq, _ in subscriber.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_blocks_travel_with_grants_as_with_extents(
    cluster: Cluster, subscriber: Subscriber, named: Named
) -> None:
    # extents=false: allocate, write, publish (the test above wrote into leased extents).
    with kvfabric.connect(cluster.url(extents="false")) as granted:
        named.put(granted, 3, blocks=engine_chain(3, first=2000))
        wait_for("the events of a granted put", lambda: follows(subscriber, named, granted))
    first = (2000).to_bytes(8, "big")
    chain = [e for e in subscriber.events() if first in e.get("block_hashes", ())]
    assert chain[0]["block_hashes"] == [b.hash for b in engine_chain(3, first=2000)]
    assert chain[0]["token_ids"] == list(range(48))


def test_evictions_are_removals_in_order(
    store: kvfabric.Store, subscriber: Subscriber, named: Named
) -> None:
    before = set(named.held(store))
    mine: list[bytes] = []
    for _ in range(4):  # 4 x 16 x 64 KiB into a 2 MiB node: most of it is evicted
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
    cluster: Cluster, store: kvfabric.Store, subscriber: Subscriber, named: Named
) -> None:
    subscriber.disconnect()
    before = cluster.stats()["controller"]["kv_events_published"]
    named.put(store, 4)
    wait_for(
        "the puts' events sent while the subscriber was away",
        lambda: cluster.stats()["controller"]["kv_events_published"] >= before + 4,
    )
    subscriber.reconnect()
    gaps = subscriber.gaps

    def caught_up() -> bool:
        if subscriber.gaps == gaps:
            named.put(store, 1)  # ...until a later batch shows the gap
        return follows(subscriber, named, store)

    wait_for("the subscriber caught up through replay", caught_up)
    assert subscriber.gaps > gaps
    assert subscriber.replayed > 0


def test_a_restarted_controller_is_followed_by_a_clear_then_what_it_restored(
    cluster: Cluster, store: kvfabric.Store, subscriber: Subscriber, named: Named
) -> None:
    cluster.kill_controller()
    cluster.start_controller()
    cluster.wait_nodes(1)
    # The node's records come back, named by their keys: what a writer said of a block is
    # not in the record.
    named.names = {k: k for k in named.names}
    seen = len(subscriber.batches)

    def caught_up() -> bool:
        if len(subscriber.batches) == seen:
            named.put(store, 1)  # a batch after the subscriber's connection came back
        return follows(subscriber, named, store)

    wait_for("the events after the controller's restart", caught_up)
    after = [e for _, (_, events, _) in subscriber.batches[seen:] for e in events]
    assert after[0] == {"type": "AllBlocksCleared"}


def test_a_subscriber_that_never_reads_slows_no_put(
    cluster: Cluster, store: kvfabric.Store, ports: tuple[int, int], named: Named
) -> None:
    stuck = Subscriber(f"tcp://127.0.0.1:{ports[0]}", None)
    try:
        before = cluster.stats()["controller"]
        for _ in range(20):
            named.put(store, 16)  # asserts every put STORED
        counters = wait_for(
            "every change sent",
            lambda: cluster.stats()["controller"],
            until=lambda c: c["kv_events_queued"] == 0,
        )
        assert counters["kv_events_published"] - before["kv_events_published"] >= 20 * 16
        assert counters["kv_events_dropped"] == 0
    finally:
        stuck.close()


def test_serve_publishes_to_a_subscriber_that_binds() -> None:
    # llm-d's manager binds and engines connect to it: an endpoint without a wildcard.
    sub = Subscriber("tcp://127.0.0.1:0", None, bind=True)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfabric",
            "serve",
            "--listen",
            f"tcp://127.0.0.1:{port}",
            "--capacity",
            "8MiB",
            "--transport",
            "tcp",
            "--kv-events",
            sub.endpoint,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = ""
        while "kvfabric serving on" not in line:
            line = proc.stdout.readline()
            assert line, "serve exited"
        assert f"KV events on {sub.endpoint}" in line, line
        named = Named()
        with kvfabric.connect(f"kvfabric://127.0.0.1:{port}") as store:

            def seen() -> bool:
                named.put(store, 2)  # until the connection is up, batches go nowhere
                return follows(sub, named, store) or bool(sub.view() & named.held(store))

            wait_for("events from serve", seen)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        sub.close()
