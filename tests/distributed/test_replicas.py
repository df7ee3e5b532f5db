"""Values on two nodes (``kvfabric controller --replicas 2``), with real controller and node
processes over tcp: exact round trips, a node killed with SIGKILL (every key still hits, the
reads counted falling over), a corrupted copy, the repair of a key that lost a copy.

Reads go over tcp so a dead node is dead to the client (an shm client keeps the node's
memory mapped after the process is gone).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, corrupt_payload, wait_for
from kvfabric.testing.store_suite import ReplicatedStoreConformance


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _values(keys: list[bytes], size: int = 4096) -> list[bytes]:
    return [os.urandom(size) for _ in keys]


def _as_bytes(values: list[memoryview | None]) -> list[bytes | None]:
    return [bytes(v) if v is not None else None for v in values]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(
        nodes=3, transports=("tcp",), capacity="64MiB", controller_args=["--replicas", "2"]
    ) as c:
        yield c


class TestTwoCopiesOverTcp(ReplicatedStoreConformance):
    @pytest.fixture
    def store_url(self, cluster: Cluster) -> str:
        return cluster.url(transport="tcp")


def _node_ids(cluster: Cluster) -> dict[str, int]:
    return {n.name: n.id for n in cluster.node_infos()}


def _delta(after: dict[str, int], before: dict[str, int], *names: str) -> dict[str, int]:
    return {name: after[name] - before[name] for name in names}


@pytest.mark.parametrize("image", [True, False], ids=["image", "rpc"])
def test_a_put_writes_two_copies_in_two_rpcs_and_a_lookup_then_get_stays_one_or_none(
    cluster: Cluster, image: bool
) -> None:
    url = cluster.url(transport="tcp", lookup_image="1" if image else "0")
    with kvfabric.connect(url) as store:
        keys = _keys(64)
        values = _values(keys)
        before = store.stats()
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 64
        after = store.stats()
        put = _delta(after, before, "control_rpcs", "payload_bytes_written", "replica_writes")
        assert put == {
            "control_rpcs": 2,
            "payload_bytes_written": 2 * 64 * 4096,
            "replica_writes": 64,
        }
        before = store.stats()
        assert store.batched_contains(keys) == 64
        assert _as_bytes(store.batched_get(keys)) == values
        after = store.stats()
        assert after["control_rpcs"] - before["control_rpcs"] == (0 if image else 1)
        assert after["replica_reads"] == before["replica_reads"]
        # A re-put moves nothing and is one call.
        before = store.stats()
        assert store.batched_put(keys, values) == [PutOutcome.DEDUPLICATED] * 64
        after = store.stats()
        assert _delta(after, before, "control_rpcs", "payload_bytes_written") == {
            "control_rpcs": 1,
            "payload_bytes_written": 0,
        }
    index = cluster.stats()["index"]
    assert index["replica_grants"] == 64
    assert index["stored_payload_bytes"] == 2 * 64 * 4096


@pytest.mark.parametrize("image", [True, False], ids=["image", "rpc"])
def test_a_node_killed_loses_no_hit_and_the_reads_fall_over_to_the_other_copy(
    cluster: Cluster, image: bool
) -> None:
    url = cluster.url(transport="tcp", timeout="2s", lookup_image="1" if image else "0")
    with kvfabric.connect(url) as store:
        keys = _keys(96)
        values = _values(keys)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 96
        victim = _node_ids(cluster)["node1"]
        first_on_victim = sum(d is not None and d.node == victim for d in store.locate(keys))
        assert first_on_victim > 0
        assert store.batched_contains(keys) == 96  # descriptors (and copies) prefetched
        cluster.kill_node(1)
        before = store.stats()
        started = time.perf_counter()
        got = store.batched_get(keys)
        took = time.perf_counter() - started
        after = store.stats()
        assert _as_bytes(got) == values
        fell_over = _delta(after, before, "replica_reads", "replica_hits", "control_rpcs")
        print(
            f"\nnode killed: {first_on_victim} of 96 keys read from their other copy "
            f"in the same get ({took * 1e3:.1f} ms, {fell_over})"
        )
        assert fell_over == {
            "replica_reads": first_on_victim,
            "replica_hits": first_on_victim,
            "control_rpcs": 0,
        }
        # Once the controller drops the node, the surviving copies are read first.
        cluster.wait_nodes(2)
        wait_for(
            "every key found again", lambda: store.batched_contains(keys), until=lambda n: n == 96
        )
        before = store.stats()
        assert _as_bytes(store.batched_get(keys)) == values
        after = store.stats()
        assert after["replica_reads"] == before["replica_reads"]


def test_a_key_that_lost_a_copy_gets_it_back_on_the_next_put(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp")) as store:
        keys = _keys(48)
        values = _values(keys)
        store.batched_put(keys, values)
        cluster.kill_node(2)
        cluster.wait_nodes(2)
        index = cluster.stats()["index"]
        assert index["entries"] == 48  # every key kept its other copy
        before = store.stats()
        assert store.batched_put(keys, values) == [PutOutcome.DEDUPLICATED] * 48
        repaired = store.stats()["replica_repairs"] - before["replica_repairs"]
        index = cluster.stats()["index"]
        assert repaired == index["replica_repairs"] > 0
        assert index["stored_payload_bytes"] == 2 * 48 * 4096
        # Whole again: nothing more to write.
        before = store.stats()
        store.batched_put(keys, values)
        assert store.stats()["payload_bytes_written"] == before["payload_bytes_written"]


def test_a_corrupted_copy_reads_from_the_other_and_only_it_is_dropped(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp", lookup_image="0")) as store:
        keys = _keys(4)
        values = _values(keys)
        store.batched_put(keys, values)
        bad = corrupt_payload(store, keys[2])
        before = store.stats()
        assert store.batched_contains(keys) == 4
        assert _as_bytes(store.batched_get(keys)) == values
        after = store.stats()
        assert _delta(after, before, "validation_failures", "replica_hits", "invalid_reported") == {
            "validation_failures": 1,
            "replica_hits": 1,
            "invalid_reported": 1,
        }
        index = cluster.stats()["index"]
        assert (index["invalid_reports"], index["entries"]) == (1, 4)
        # The key is now read from its good copy first.
        first = store.locate([keys[2]])[0]
        assert first is not None
        assert first.version != bad.version
        assert _as_bytes(store.batched_get(keys[2:3])) == values[2:3]
