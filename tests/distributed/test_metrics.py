"""Prometheus metrics: real controller and node processes with ``--metrics-port``, scraped
over HTTP the way Prometheus does, and ``kvfabric stats --format prometheus``."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric._runtime.record import record_size
from kvfabric.testing import Cluster

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def _metrics_url(ready_line: str) -> str:
    match = re.search(r"http://\S+/metrics", ready_line)
    assert match, ready_line
    return match.group(0)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` → value, for every sample line."""
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            found[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return found


def _types(text: str) -> dict[str, str]:
    return {
        parts[2]: parts[3]
        for parts in (line.split() for line in text.splitlines() if line.startswith("# TYPE "))
    }


_CLIENT_REQUESTS = "client requests"
_CLIENT_CALLS = ("allocate", "publish", "publish_carved", "lease_extents", "lookup_prefix")
_GRANTED = 'kvfabric_index_offered_keys_total{outcome="granted"}'
_DEDUPLICATED = 'kvfabric_index_offered_keys_total{outcome="deduplicated"}'


def _requests(operation: str) -> str:
    return f'kvfabric_controller_requests_total{{operation="{operation}"}}'


def _keys(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(
        nodes=1,
        transports=("tcp",),
        controller_args=["--metrics-port", "0"],
        node_args=["--metrics-port", "0"],
    ) as c:
        yield c


def test_the_endpoints_have_help_and_type_lines_and_type_levels_as_gauges(
    cluster: Cluster,
) -> None:
    assert cluster.controller is not None
    node = cluster.nodes[0]
    assert node is not None
    text = _scrape(_metrics_url(cluster.controller.ready_line))
    node_text = _scrape(_metrics_url(node.ready_line))
    types = _types(text)
    assert "# HELP kvfabric_index_entries " in text
    assert types["kvfabric_index_entries"] == "gauge"
    assert types["kvfabric_index_capacity_bytes"] == "gauge"
    assert types["kvfabric_index_used_bytes"] == "gauge"
    # The lookup image's levels rise and fall: gauges, with help of their own.
    for level in ("entries", "spilled", "buckets", "prefault_seconds"):
        assert types[f"kvfabric_index_image_{level}"] == "gauge"
    assert "# HELP kvfabric_index_image_prefault_seconds Seconds the index took" in text
    # prometheus-client names a counter family by its samples' `_total` name.
    assert types["kvfabric_index_lookup_keys_total"] == "counter"
    assert types["kvfabric_controller_requests_total"] == "counter"
    assert types["kvfabric_client_operation_duration_seconds"] == "histogram"
    samples = _samples(text)
    assert samples["kvfabric_up"] == 1.0
    assert samples[f'kvfabric_build_info{{version="{kvfabric.__version__}"}}'] == 1.0
    assert "process_resident_memory_bytes" in samples
    # The nodes serve their own counters: the controller's endpoint leaves them out.
    assert not [name for name in types if name.startswith("kvfabric_node_")]
    node_types = _types(node_text)
    assert node_types["kvfabric_node_capacity_bytes"] == "gauge"
    assert node_types["kvfabric_node_transport_written_bytes_total"] == "counter"
    # Levels of the node, not totals: gauges, each with a help of its own.
    assert node_types["kvfabric_node_prefault_seconds"] == "gauge"
    assert node_types["kvfabric_node_huge_page_bytes"] == "gauge"
    assert "# HELP kvfabric_node_huge_page_bytes Bytes of this node's regions mapped" in node_text
    node_samples = _samples(node_text)
    # Labelled by the node's name, which it keeps across restarts (not the id it was given).
    assert node_samples['kvfabric_node_capacity_bytes{node="node0"}'] == 256 << 20
    assert node_samples['kvfabric_node_registered{node="node0"}'] == 1.0
    assert "process_resident_memory_bytes" in node_samples


@pytest.mark.parametrize("extents", [True, False], ids=["extents", "allocate"])
def test_a_put_moves_the_counters_by_exactly_what_it_did(cluster: Cluster, extents: bool) -> None:
    assert cluster.controller is not None
    node = cluster.nodes[0]
    assert node is not None
    controller_url = _metrics_url(cluster.controller.ready_line)
    node_url = _metrics_url(node.ready_line)
    # Tags of this case's own: the cluster outlives it.
    keys, value = _keys(4, 1 + 2 * extents), b"x" * 1000
    with kvfabric.connect(cluster.url(transport="tcp", extents=str(int(extents)))) as store:
        # Node table fetched, connection open (and with extents, one leased).
        store.batched_put(_keys(1, 2 * extents), [b"warm-up"])
        before, node_before = _samples(_scrape(controller_url)), _samples(_scrape(node_url))
        assert store.batched_put(keys, [value] * 4) == [kvfabric.PutOutcome.STORED] * 4
        after, node_after = _samples(_scrape(controller_url)), _samples(_scrape(node_url))
        again = store.batched_put(keys, [value] * 4)
        assert again == [kvfabric.PutOutcome.DEDUPLICATED] * 4
        repeat, node_repeat = _samples(_scrape(controller_url)), _samples(_scrape(node_url))

    def moved(name: str, old: dict[str, float], new: dict[str, float]) -> float:
        if name == _CLIENT_REQUESTS:  # the requests of clients' calls, by their operations
            return sum(moved(_requests(op), old, new) for op in _CLIENT_CALLS)
        return new.get(name, 0.0) - old.get(name, 0.0)

    # With an extent held, one publish of the records laid into it; else one allocate and
    # one publish. The scrapes themselves are not client RPCs.
    if extents:
        assert moved(_CLIENT_REQUESTS, before, after) == 1
        assert moved(_requests("publish_carved"), before, after) == 1
        assert moved("kvfabric_index_carved_total", before, after) == 4
        assert moved(_GRANTED, before, after) == 0
        assert moved("kvfabric_index_extent_bytes", before, after) == -4 * record_size(1000)
    else:
        assert moved(_CLIENT_REQUESTS, before, after) == 2
        assert moved(_requests("allocate"), before, after) == 1
        assert moved(_requests("publish"), before, after) == 1
        assert moved(_GRANTED, before, after) == 4
    assert moved("kvfabric_index_published_total", before, after) == 4
    assert moved("kvfabric_index_entries", before, after) == 4
    assert moved("kvfabric_index_stored_payload_bytes", before, after) == 4 * 1000
    assert moved("kvfabric_index_used_bytes", before, after) == 4 * record_size(1000)
    assert moved(_DEDUPLICATED, before, after) == 0
    written = 'kvfabric_node_transport_written_bytes_total{node="node0",transport="tcp"}'
    assert moved(written, node_before, node_after) == 4 * (64 + 1000)

    # Stored keys offered again: one call that answers (or is told) "stored", no bytes, no
    # entries.
    assert moved(_CLIENT_REQUESTS, after, repeat) == 1
    assert moved(_DEDUPLICATED, after, repeat) == 4
    assert moved("kvfabric_index_entries", after, repeat) == 0
    assert moved(_GRANTED, after, repeat) == 0
    assert moved(written, node_after, node_repeat) == 0


def test_stats_prints_the_same_exposition_and_takes_host_port(cluster: Cluster) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric",
            "stats",
            "--controller",
            f"127.0.0.1:{cluster.port}",
            "--format",
            "prometheus",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    types = _types(result.stdout)
    assert types["kvfabric_index_entries"] == "gauge"
    assert types["kvfabric_controller_requests_total"] == "counter"
    assert "# HELP kvfabric_index_offered_keys_total " in result.stdout
    # What the controller knows of its nodes too (each node's endpoint serves its own).
    assert 'kvfabric_node_capacity_bytes{node="node0"}' in result.stdout
