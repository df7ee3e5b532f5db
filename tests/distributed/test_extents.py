"""Puts into extents leased from the controller, with real processes.

A client holding extents lays its records into them itself and publishes them in one call:
these tests count the round trips exactly, check what a batch stored already moves, and
assert what a client sees when the faults an operator meets hit it while it holds extents
(a client killed, the controller restarted, the data node restarted), and how soon the
store is whole again. Bounds are generous, for a busy 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric.keys import chain_keys
from kvfabric.spi import record_size
from kvfabric.testing import Cluster, exact_hits, wait_for

_VALUE = 256 << 10
_BATCH = 16
_CAPACITY = 256 << 20
# The controller leases at most 1/16 of the capacity per extent (and a client asks for
# more than one put needs): the puts one extent holds.
_PUTS_PER_EXTENT = (_CAPACITY // 16) // (_BATCH * record_size(_VALUE))


def _keys(n: int, salt: str) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=f"{salt}-{time.monotonic_ns()}".encode())


def _values(keys: list[bytes], size: int = _VALUE) -> list[bytes]:
    return [np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size) for k in keys]


def _index(cluster: Cluster) -> dict[str, int]:
    return cluster.stats()["index"]


def _put_rpcs(store: Store, keys: list[bytes], values: list[bytes]) -> int:
    """Control round trips one put took (it must store every key)."""
    before = store.stats()["control_rpcs"]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
    return store.stats()["control_rpcs"] - before


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_put_into_held_extents_is_one_control_round_trip(transport: str) -> None:
    assert _PUTS_PER_EXTENT == 3  # what the counts below are worked out for
    with (
        Cluster(nodes=1, transports=(transport,), capacity=str(_CAPACITY)) as cluster,
        kvfabric.connect(cluster.url(transport=transport)) as store,
    ):
        rpcs = []
        for n in range(5):
            keys = _keys(_BATCH, f"put{n}")
            values = _values(keys)
            rpcs.append(_put_rpcs(store, keys, values))
            assert exact_hits(store, keys, values) == _BATCH
        # A lease and the publish, then the publish alone while the extent has room; the
        # put that finds it full gives it back in the same call that leases the next.
        assert rpcs == [2, 1, 1, 2, 1]
        index = _index(cluster)
        assert (index["extents_leased"], index["extents_returned"], index["extents"]) == (2, 1, 1)
        assert index["carved"] == 5 * _BATCH
        assert cluster.stats()["controller"].get("rpc_allocate", 0) == 0
        stats = store.stats()
        assert stats["extent_leases"] == 2
        assert stats["carved_writes"] == 5 * _BATCH
        assert stats["payload_bytes_written"] == 5 * _BATCH * _VALUE


def test_a_put_spreads_over_the_nodes_one_extent_each() -> None:
    with (
        Cluster(nodes=2, transports=("tcp",), capacity=str(_CAPACITY)) as cluster,
        kvfabric.connect(cluster.url()) as store,
    ):
        keys = _keys(_BATCH, "spread")
        values = _values(keys)
        # Both extents in one lease call, then the publish.
        assert _put_rpcs(store, keys, values) == 2
        nodes = [d.node for d in store.locate(keys) if d is not None]
        # Dealt round-robin: every run of the keys, a prefix too, reads from both nodes.
        assert len(set(nodes[:2])) == 2
        assert nodes.count(nodes[0]) == _BATCH // 2
        assert _index(cluster)["extents"] == 2
        assert exact_hits(store, keys, values) == _BATCH


def test_a_stored_batch_put_again_moves_no_bytes_and_counts_as_stored_again() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",), capacity=str(_CAPACITY)) as cluster,
        kvfabric.connect(cluster.url()) as store,
    ):
        keys = _keys(_BATCH, "again")
        values = _values(keys)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * _BATCH
        before, dedup_before = store.stats(), _index(cluster)["dedup_hits"]
        assert store.batched_put(keys, values) == [PutOutcome.DEDUPLICATED] * _BATCH
        after = store.stats()
        assert after["payload_bytes_written"] == before["payload_bytes_written"]
        assert after["control_rpcs"] - before["control_rpcs"] == 1
        assert _index(cluster)["dedup_hits"] - dedup_before == _BATCH
        assert exact_hits(store, keys, values) == _BATCH


_HOLDER = """
import sys, time
import kvfabric
from kvfabric.keys import chain_keys
with kvfabric.connect(sys.argv[1]) as store:
    keys = chain_keys(list(range(4)), 1, namespace=b"holder")
    assert set(store.batched_put(keys, [b"h" * 4096] * 4)) == {kvfabric.PutOutcome.STORED}
    print("holding", flush=True)
    time.sleep(600)  # holds its extent until the test kills it
"""


def test_a_client_killed_holding_an_extent_gives_its_space_back_when_the_lease_runs_out() -> None:
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity=str(_CAPACITY),
        controller_args=["--lease", "2s", "--grace", "0s"],
    ) as cluster:
        holder = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_HOLDER), cluster.url()],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "holding"
            index = _index(cluster)
            assert index["extents"] == 1
            # The extent's unused part is neither free nor used while it is leased.
            assert index["extent_bytes"] == _CAPACITY // 16 - 4 * record_size(4096)
            assert index["free_bytes"] == _CAPACITY - _CAPACITY // 16
        finally:
            holder.kill()  # SIGKILL: the extent is never given back
            holder.wait()
        wait_for(
            "a killed client's extent taken back when its lease ran out",
            lambda: _index(cluster)["extents"] == 0,
        )
        index = _index(cluster)
        assert index["extent_expiries"] == 1
        # What it published stays; the rest of the extent is free again.
        assert index["entries"] == 4
        assert index["extent_bytes"] == 0
        assert index["used_bytes"] == 4 * record_size(4096)
        assert index["free_bytes"] == _CAPACITY - 4 * record_size(4096)


_MANY_HOLDERS = """
import sys
import kvfabric
from kvfabric.keys import chain_keys
stores = [kvfabric.connect(sys.argv[1]) for _ in range(int(sys.argv[2]))]
for n, store in enumerate(stores):  # each store leases an extent of its own
    keys = chain_keys(list(range(4)), 1, namespace=b"holder %d" % n)
    assert set(store.batched_put(keys, [b"h" * 4096] * 4)) == {kvfabric.PutOutcome.STORED}
print("holding", flush=True)
sys.stdin.read()  # holds the extents until the test kills it
"""


def test_clients_killed_holding_most_of_the_space_do_not_evict_what_a_live_client_stores() -> None:
    """Twelve extents (3/4 of the capacity) leased to clients that were then killed stay
    leased until their leases run out, and eviction cannot free them. The headroom (a
    quarter here) is a share of the rest, so a live client's values stay stored: a share
    of all the capacity would evict every entry, the live client's just stored too."""
    holders = 12
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity=str(_CAPACITY),
        controller_args=["--headroom", "0.25"],
    ) as cluster:
        holder = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_MANY_HOLDERS), cluster.url(), str(holders)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "holding"
        finally:
            holder.kill()  # SIGKILL: no extent is given back
            holder.wait()
        assert _index(cluster)["extents"] == holders
        with kvfabric.connect(cluster.url()) as store:
            keys = _keys(8, "live")
            values = _values(keys, 1 << 20)
            assert store.batched_put(keys, values) == [PutOutcome.STORED] * 8
            index = _index(cluster)  # a request after the put's: the controller was idle
            assert exact_hits(store, keys, values) == 8
        assert index["extents"] == holders + 1
        assert index["evictions"] == 0
        assert index["entries"] == 4 * holders + 8


def test_a_controller_restarted_under_a_client_holding_extents() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",), capacity=str(_CAPACITY)) as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms", control_timeout="2s")) as store,
    ):
        keys = _keys(_BATCH, "before")
        values = _values(keys)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * _BATCH
        cluster.kill_controller()  # SIGKILL
        cluster.start_controller()
        seen: set[PutOutcome] = set()

        def stores_again() -> bool:
            fresh = _keys(_BATCH, "after")
            fresh_values = _values(fresh)
            outcomes = store.batched_put(fresh, fresh_values)
            seen.update(outcomes)
            return outcomes == [PutOutcome.STORED] * _BATCH and exact_hits(
                store, fresh, fresh_values
            ) == len(fresh)

        wait_for("stored through new extents after a controller restart", stores_again, every=0.1)
        # The old extent went with the old controller: a put with it fails, never raises.
        # While the node restores its records the new index places nothing (NO_SPACE).
        assert seen <= {PutOutcome.STORED, PutOutcome.FAILED, PutOutcome.NO_SPACE}

        def one_round_trip() -> bool:
            after = _keys(_BATCH, "settled")
            return _put_rpcs(store, after, _values(after)) == 1

        wait_for("puts cost one control round trip again", one_round_trip, every=0.1)
        # The records restored from the node read back.
        wait_for(
            "the same client hits its keys again", lambda: exact_hits(store, keys, values) == 16
        )


@pytest.mark.parametrize(
    ("transport", "backend"),
    [("tcp", "dram"), ("shm", "file")],
    ids=["tcp-dram", "shm-file"],
)
def test_a_node_restarted_under_a_client_holding_extents(transport: str, backend: str) -> None:
    """Over shm with the file backend the client maps the very file the restarted node
    serves again: an extent leased before the restart must not be written into (the index
    dropped it and may hand its space to others). The client sees the index's nodes
    generation move in the lookup image and gives such extents back unwritten."""
    with (
        Cluster(
            nodes=1, transports=(transport,), capacity=str(_CAPACITY), backend=backend
        ) as cluster,
        kvfabric.connect(cluster.url(transport=transport, retry_interval="200ms")) as store,
    ):
        keys = _keys(_BATCH, "before")
        assert store.batched_put(keys, _values(keys)) == [PutOutcome.STORED] * _BATCH
        old = cluster.node_infos()[0]
        cluster.kill_node(0)
        during = _keys(4, "during")
        outcomes = store.batched_put(during, _values(during, 4096))
        # tcp finds no one to talk to; shm writes the file, still mapped here.
        if transport == "tcp":
            assert outcomes == [PutOutcome.FAILED] * 4
        cluster.start_node(0)
        wait_for(
            "the restarted node registered",
            lambda: [n.instance for n in cluster.node_infos()] not in ([], [old.instance]),
        )

        def stores_again() -> bool:
            fresh = _keys(_BATCH, "after")
            fresh_values = _values(fresh)
            if store.batched_put(fresh, fresh_values) != [PutOutcome.STORED] * _BATCH:
                return False
            return exact_hits(store, fresh, fresh_values) == _BATCH

        wait_for("stored through a new extent after a node restart", stores_again, every=0.1)
        index = _index(cluster)
        # Nothing was laid into the extent from before the restart: the index never had to
        # refuse a record of it.
        assert index["carve_refused"] == 0
        assert index["extents"] == 1
