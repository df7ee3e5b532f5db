"""Stores whose index is in Redis, opened before a fork and used by the child.

``kvfabric://HOST:PORT?index=redis``: the child makes its own Redis connections and its own
upkeep thread, and shares the store with the parent (each reads what the other stored).
``embedded://?index=redis``: the node stays the parent's (registered with the index); the
child is one more client of the index and reads and writes that node like any other. Either
way the parent reads every record it stored and keeps storing. Real redis-server and data
node processes; children bounded (``fork_children``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from fork_children import (
    MECHANISMS,
    ChildReport,
    check_child,
    holding_locks,
    in_children,
    parent_still_whole,
    round_trip,
)
from redis_servers import RedisDeployment

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits


@pytest.fixture(scope="module")
def nodes_on_redis(redis_single: RedisDeployment) -> Iterator[Cluster]:
    with Cluster(
        nodes=2, transports=("tcp", "shm"), capacity="256MiB", redis=redis_single.url
    ) as c:
        yield c


def _stored(store: Store, count: int = 256) -> tuple[list[bytes], list[bytes]]:
    keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
    values = [f"parent {i} ".encode().ljust(2048, b"p") for i in range(count)]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * count
    assert exact_hits(store, keys, values) == count
    return keys, values


def _read_back(store: Store, reports: list[ChildReport]) -> None:
    for report in reports:
        keys = chain_keys(list(range(len(report.expected))), 1, namespace=report.namespace)
        assert exact_hits(store, keys, report.expected) == len(keys)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_store_on_redis_forked_any_way_is_shared_by_parent_and_children(
    nodes_on_redis: Cluster, mechanism: str
) -> None:
    # The timeout bounds a hang, not the machine's speed.
    with kvfabric.connect(nodes_on_redis.url(timeout="30s")) as store:
        keys, values = _stored(store)
        reports = in_children(mechanism, lambda: round_trip(store, keys), count=2)
        for report in reports:
            check_child(report, values)
        parent_still_whole(store, keys, values)
        _read_back(store, reports)


def test_a_fork_while_parent_threads_hold_the_locks_of_a_store_on_redis(
    nodes_on_redis: Cluster,
) -> None:
    with kvfabric.connect(nodes_on_redis.url(timeout="30s")) as store:
        keys, values = _stored(store)
        with holding_locks(store) as held:
            assert held >= 8
            reports = in_children("os.fork", lambda: round_trip(store, keys), count=2)
        for report in reports:
            check_child(report, values)
        parent_still_whole(store, keys, values)


def test_an_embedded_store_on_redis_forked_makes_the_child_a_client_of_the_same_index(
    redis_single: RedisDeployment,
) -> None:
    name = f"f{uuid.uuid4().hex[:10]}"
    url = (
        f"embedded://{name}?capacity=64MiB&transport=shm&timeout=30s"
        f"&index=redis&redis.url={redis_single.url}&redis.namespace={name}"
    )
    with kvfabric.connect(url) as store:
        keys, values = _stored(store)
        parent_node = store.local_node
        assert parent_node is not None

        def child() -> tuple[ChildReport, bool]:
            # No node of its own: the node stays the parent's, which the child reads and
            # writes through the index like any other client.
            return round_trip(store, keys), store.local_node is None

        for mechanism in ("os.fork", "multiprocessing"):
            outcomes = in_children(mechanism, child, count=2)
            assert store.local_node is parent_node
            parent_still_whole(store, keys, values)
            for report, without_node in outcomes:
                assert without_node
                check_child(report, values)
            _read_back(store, [report for report, _ in outcomes])
