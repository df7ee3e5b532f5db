"""Restarts, with real processes: the client created before the fault recovers by itself.

Each test asserts what a long-lived client sees (stored again, hits again, never a wrong
value) and prints how long recovery took; bounds are generous, for a busy 2-core machine.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits, wait_for


def _keys(n: int, salt: str) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=f"{salt}-{time.monotonic_ns()}".encode())


def _values(keys: list[bytes], size: int) -> list[bytes]:
    return [np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size) for k in keys]


def _stores_again(store: Store, salt: str) -> Callable[[], bool]:
    def check() -> bool:
        keys = _keys(8, salt)
        values = _values(keys, 4096)
        if store.batched_put(keys, values) != [PutOutcome.STORED] * 8:
            return False
        return exact_hits(store, keys, values) == 8

    return check


def _mapped_regions() -> int:
    """How many data-node memfd regions this process has mapped (shm clients map them)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return len({line.split()[-2] for line in maps if "memfd:kvfabric-region" in line})


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_node_killed_and_restarted_under_its_name_serves_the_same_client(
    transport: str,
) -> None:
    with (
        Cluster(nodes=1, transports=(transport,)) as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms")) as store,
    ):
        keys = _keys(32, "before")
        values = _values(keys, 8192)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 32
        old = cluster.node_infos()[0]
        cluster.kill_node(0)
        during = store.batched_put(_keys(4, "during"), [b"x"] * 4)
        # shm writes and reads the dead node's memory, still mapped here, until the
        # controller drops the node; tcp finds no one to talk to.
        if transport == "tcp":
            assert during == [PutOutcome.FAILED] * 4
        assert exact_hits(store, keys, values) in (0, 32)
        cluster.start_node(0)
        wait_for(
            "the restarted node registered (after the old one timed out)",
            lambda: [n.instance for n in cluster.node_infos()] not in ([], [old.instance]),
        )
        wait_for(
            f"{transport}: stored and read back after a node restart",
            _stores_again(store, "after"),
            every=0.1,
        )
        # dram died with the process: the old keys are misses now, never wrong values.
        assert exact_hits(store, keys, values) == 0
        if transport == "shm":
            assert _mapped_regions() == 1  # the dead incarnation's memory was let go


def test_a_node_dropped_for_silence_then_restarted_serves_the_same_client() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",)) as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms")) as store,
    ):
        assert store.batched_put(_keys(4, "a"), [b"v"] * 4) == [PutOutcome.STORED] * 4
        cluster.signal_node(0, signal.SIGSTOP)
        wait_for("the controller dropped the silent node", lambda: cluster.node_names() == [])
        cluster.signal_node(0, signal.SIGCONT)
        cluster.kill_node(0)
        cluster.start_node(0)
        wait_for(
            "stored and read back after drop and restart", _stores_again(store, "b"), every=0.1
        )


def test_a_node_replaced_by_a_new_one_on_a_new_port_serves_the_same_client() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",)) as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms")) as store,
    ):
        assert store.batched_put(_keys(4, "a"), [b"v"] * 4) == [PutOutcome.STORED] * 4
        old = cluster.node_infos()[0]
        cluster.kill_node(0)
        replacement = cluster.add_node()
        wait_for(
            "stored and read back through the replacement", _stores_again(store, "b"), every=0.1
        )
        wait_for("the dead node dropped", lambda: cluster.node_names() == [f"node{replacement}"])
        wait_for(
            "stored and read back with only the replacement", _stores_again(store, "c"), every=0.1
        )
        new = cluster.node_infos()[0]
        assert new.id != old.id
        assert new.endpoints[0].address != old.endpoints[0].address


def test_a_node_restarted_with_a_smaller_capacity_is_filled_normally() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",), capacity="8MiB") as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms")) as store,
    ):
        store.batched_put(_keys(64, "big"), [os.urandom(64 * 1024)] * 64)
        cluster.kill_node(0)
        cluster.start_node(0, capacity="4MiB")
        wait_for(
            "the index reports the new capacity",
            lambda: cluster.stats()["index"]["capacity_bytes"] == 4 << 20,
        )
        wait_for("stored again after the restart", _stores_again(store, "c"), every=0.1)
        # Twice the capacity in 64 KiB values: every put is stored, evicting older ones.
        outcomes: list[PutOutcome] = []
        for n in range(8):
            keys = _keys(16, f"fill{n}")
            outcomes += store.batched_put(keys, [os.urandom(64 * 1024)] * 16)
        assert set(outcomes) == {PutOutcome.STORED}
        assert cluster.stats()["index"]["evictions"] > 0


def test_a_live_nodes_name_cannot_be_taken_over() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",)) as cluster,
        kvfabric.connect(cluster.url()) as store,
    ):
        keys = _keys(8, "owned")
        values = _values(keys, 1000)
        store.batched_put(keys, values)
        owner = cluster.node_infos()[0]
        # A second process claiming the live node's name, on its own port and memory.
        cluster.nodes.append(None)
        cluster.start_node(len(cluster.nodes) - 1, name="node0")
        wait_for(
            "the controller refused the takeover",
            lambda: cluster.stats()["controller"].get("takeovers_refused", 0) >= 1,
        )
        (still,) = cluster.node_infos()
        assert (still.instance, still.incarnation) == (owner.instance, owner.incarnation)
        assert exact_hits(store, keys, values) == 8


def test_a_controller_holding_100k_entries_restarts_with_them() -> None:
    count = 100_000
    with (
        Cluster(nodes=1, transports=("tcp", "shm"), capacity="64MiB") as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms", control_timeout="2s")) as store,
    ):
        keys = _keys(count, "many")
        values = [k[:16] for k in keys]  # 16-byte values derived from their keys
        for start in range(0, count, 5000):
            chunk = slice(start, start + 5000)
            assert set(store.batched_put(keys[chunk], values[chunk])) == {PutOutcome.STORED}
        assert cluster.stats()["index"]["entries"] == count
        cluster.kill_controller()  # SIGKILL
        cluster.start_controller()
        wait_for(
            "the restarted controller rebuilt 100k entries from the node",
            lambda: cluster.stats()["index"].get("entries", 0) >= count,
        )
        found = 0
        wait_for(
            "the same client hits its keys again",
            lambda: store.batched_contains(keys[:1000]) == 1000,
        )
        for start in range(0, count, 10_000):
            chunk = slice(start, start + 10_000)
            found += exact_hits(store, keys[chunk], values[chunk])
        print(f"hits after the restart: {found} of {count}")
        assert found >= 0.999 * count


def test_a_file_node_with_1gib_killed_restarts_with_its_records(tmp_path: Path) -> None:
    size = 256 * 1024
    count = (1 << 30) // size  # 1 GiB of values
    with (
        Cluster(nodes=1, transports=("tcp", "shm"), capacity="1100MiB", backend="file") as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms", timeout="10s")) as store,
    ):
        keys = _keys(count, "file")
        for start in range(0, count, 256):
            batch = keys[start : start + 256]
            assert set(store.batched_put(batch, _values(batch, size))) == {PutOutcome.STORED}
        old = cluster.node_infos()[0]
        cluster.kill_node(0)  # SIGKILL: nothing flushed, the page cache keeps the bytes
        cluster.start_node(0)
        wait_for(
            "the restarted file node rescanned, registered and restored its records",
            lambda: (
                [n.instance for n in cluster.node_infos()] not in ([], [old.instance])
                and cluster.stats()["index"].get("entries", 0) >= count
            ),
        )
        wait_for("the same client stores again", _stores_again(store, "after"), every=0.1)
        found = 0
        for start in range(0, count, 256):
            batch = keys[start : start + 256]
            found += exact_hits(store, batch, _values(batch, size))
        print(f"hits after kill -9 and restart: {found} of {count}")
        assert found >= 0.999 * count


def test_a_torn_record_on_a_file_node_reads_as_a_miss_and_its_slot_is_reused() -> None:
    with (
        Cluster(nodes=1, transports=("tcp",), capacity="16MiB", backend="file") as cluster,
        kvfabric.connect(cluster.url(retry_interval="200ms")) as store,
    ):
        keys = _keys(16, "torn")
        values = _values(keys, 100_000)
        store.batched_put(keys, values)
        (victim,) = store.locate([keys[5]])
        assert victim is not None
        old = cluster.node_infos()[0]
        cluster.kill_node(0)
        region = cluster.node_path(0) / f"region-{victim.region}.kvf"
        with open(region, "r+b") as f:  # tear the payload as a crash mid-write would
            f.seek(victim.offset + 64 + 50_000)
            f.write(b"\x00" * 4096)
        cluster.start_node(0)
        wait_for(
            "the restarted node rescanned and registered",
            lambda: (
                [n.instance for n in cluster.node_infos()] not in ([], [old.instance])
                and cluster.stats()["index"].get("entries", 0) == 15
            ),
        )
        assert store.batched_get(keys)[5] is None
        assert exact_hits(store, keys[:5] + keys[6:], values[:5] + values[6:]) == 15
        # The torn record's slot is free again: a value of its size allocated per key (a
        # put through an extent lands wherever its extent is) lands right there.
        (newcomer,) = _keys(1, "newcomer")
        with kvfabric.connect(cluster.url(extents="0")) as allocating:
            stored = allocating.batched_put([newcomer], _values([newcomer], 100_000))
        assert stored == [PutOutcome.STORED]
        (placed,) = store.locate([newcomer])
        assert placed is not None
        assert (placed.region, placed.offset) == (victim.region, victim.offset)
        # And the torn key is stored again by its next put.
        assert store.batched_put([keys[5]], [values[5]]) == [PutOutcome.STORED]
        assert exact_hits(store, [keys[5]], [values[5]]) == 1
