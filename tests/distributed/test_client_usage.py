"""Clients' usage reports: real controller and node processes, clients whose lookups read the
lookup image one-sidedly (tcp and shm), and the fleet's key counts in the controller's
``stats`` and ``/metrics`` exactly as the clients counted them, a forked child's once."""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from fork_children import in_children
from prometheus_client.parser import text_string_to_metric_families

import kvfabric
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_for

_REPORT = "0.1"
"""Seconds between a test client's usage reports."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm"), controller_args=["--metrics-port", "0"]) as c:
        yield c


def _clients(cluster: Cluster) -> dict[str, int]:
    return cluster.stats()["clients"]


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _scrape(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert cluster.controller is not None
    match = re.search(r"http://\S+/metrics", cluster.controller.ready_line)
    assert match
    with urllib.request.urlopen(match.group(0), timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _moved(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_lookups_from_the_image_show_in_the_controllers_stats_and_metrics(
    cluster: Cluster, transport: str
) -> None:
    keys = _keys(10)
    with kvfabric.connect(cluster.url(transport=transport)) as writer:
        assert writer.batched_put(keys[:6], [b"v" * 100] * 6) == [kvfabric.PutOutcome.STORED] * 6
    # The writer's report came with its close: the counts from here on are the reader's.
    before, index_before = _clients(cluster), cluster.stats()["index"]
    scraped_before = _scrape(cluster)
    url = cluster.url(transport=transport, report_interval=_REPORT)
    with kvfabric.connect(url) as store:
        assert store.batched_contains(keys) == 6  # 6 hits, 4 misses
        assert store.batched_contains(keys[:3]) == 3  # 3 hits
        assert store.batched_exists(keys[4:8]) == [True, True, False, False]  # 2 and 2
        values = store.batched_get(keys[:8])  # 6 hits, 2 misses
        assert sum(v is not None for v in values) == 6
        assert store.stats()["onesided_lookups"] == 3  # none of them asked the controller
        expected = {
            "lookup_keys": 10 + 3 + 4,
            "lookup_hits": 6 + 3 + 2,
            "get_keys": 8,
            "get_hits": 6,
            "get_misses": 2,
            "get_failures": 0,
            "bytes_read": 600,
            "put_keys": 0,
        }
        # Reported in the background, within a report interval, while the store is open.
        moved = wait_for(
            "the client's usage reported",
            lambda: _moved(_clients(cluster), before),
            until=lambda m: m["get_keys"] == 8 and m["lookup_keys"] == 17,
        )
        assert {name: moved[name] for name in expected} == expected
        calls = sum(moved[f"lookup_bucket_{i}"] for i in range(18))
        assert calls == 3  # one observation per lookup call, whatever its keys
        assert sum(moved[f"get_bucket_{i}"] for i in range(18)) == 1
        assert moved["lookup_duration_ns"] > 0
        assert store.stats()["usage_reports"] >= 1
    # The controller never saw these lookups itself: only the clients could tell it.
    assert cluster.stats()["index"]["lookup_keys"] == index_before["lookup_keys"]

    scraped = _scrape(cluster)

    def metric(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return scraped[key] - scraped_before.get(key, 0.0)

    assert metric("kvfabric_client_lookup_keys_total", outcome="hit") == 11
    assert metric("kvfabric_client_lookup_keys_total", outcome="miss") == 6
    assert metric("kvfabric_client_get_keys_total", outcome="hit") == 6
    assert metric("kvfabric_client_get_keys_total", outcome="miss") == 2
    assert metric("kvfabric_client_read_bytes_total") == 600
    assert metric("kvfabric_client_operation_duration_seconds_count", operation="lookup") == 3
    assert metric("kvfabric_client_operation_duration_seconds_count", operation="get") == 1
    inf = {"operation": "lookup", "le": "+Inf"}
    assert metric("kvfabric_client_operation_duration_seconds_bucket", **inf) == 3


def test_a_forked_childs_counts_are_added_once(cluster: Cluster) -> None:
    keys = _keys(8)
    with kvfabric.connect(cluster.url(transport="tcp")) as writer:
        writer.batched_put(keys[:5], [b"v" * 10] * 5)
    before = _clients(cluster)
    # No periodic report: the parent's counts travel only when it closes, so whatever the
    # child sent could only be the child's own.
    store = kvfabric.connect(cluster.url(transport="tcp", report_interval="0"))
    try:
        assert store.batched_contains(keys) == 5  # the parent's: 8 asked, 5 hits

        def child() -> int:
            found = store.batched_contains(keys[:4])  # the child's: 4 asked, 4 hits
            store.close()  # sends the child's report
            return found

        assert in_children("os.fork", child, count=1) == [4]
        moved = wait_for(
            "the child's report",
            lambda: _moved(_clients(cluster), before),
            until=lambda m: m["lookup_keys"] >= 4,
        )
        assert (moved["lookup_keys"], moved["lookup_hits"]) == (4, 4)
        assert store.batched_contains(keys[5:]) == 0  # the parent's: 3 asked, none hit
    finally:
        store.close()
    moved = _moved(_clients(cluster), before)
    assert (moved["lookup_keys"], moved["lookup_hits"]) == (4 + 8 + 3, 4 + 5)


def test_a_report_to_a_dead_controller_is_dropped_and_nothing_blocks() -> None:
    with Cluster(nodes=1, transports=("tcp",)) as cluster:
        store = kvfabric.connect(cluster.url(transport="tcp", report_interval=_REPORT))
        try:
            keys = _keys(4)
            store.batched_put(keys, [b"v"] * 4)
            assert store.batched_contains(keys) == 4
            wait_for("a report", lambda: store.stats()["usage_reports"] >= 1)
            assert cluster.controller is not None
            cluster.controller.stop()
            store.batched_contains(keys)
            wait_for("a dropped report", lambda: store.stats()["usage_reports_dropped"] >= 1)
        finally:
            store.close()  # the last report failed: close does not wait for a controller
