"""Metrics of a store whose index is in Redis: nodes started with ``--index redis`` and
``--metrics-port`` serve the index's counters too (no controller does), per shard, and the
per-shard levels are gauges."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from redis_servers import RedisDeployment

import kvfabric
from kvfabric._tools.metrics import families
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster


@pytest.fixture(scope="module")
def nodes(redis_cluster: RedisDeployment) -> Iterator[Cluster]:
    with Cluster(
        nodes=1, transports=("tcp",), redis=redis_cluster.url, node_args=["--metrics-port", "0"]
    ) as cluster:
        yield cluster


def _scrape(cluster: Cluster) -> str:
    node = cluster.nodes[0]
    assert node is not None
    match = re.search(r"http://\S+/metrics", node.ready_line)
    assert match, node.ready_line
    with urllib.request.urlopen(match.group(0), timeout=10) as response:
        return str(response.read().decode())


def test_per_shard_levels_are_gauges_and_round_trips_counters() -> None:
    kinds = {
        metric.name: metric.type
        for metric in families(
            {
                "index": {
                    "shard0_entries": 3,
                    "shard12_used_bytes": 4096,
                    "shard0_round_trips": 9,
                    "shards": 3,
                    "arenas": 12,
                    "entries": 3,
                    "round_trips": 9,
                }
            }
        )
    }
    # prometheus-client names a counter family without its `_total`.
    assert kinds == {
        "kvfabric_index_shard_entries": "gauge",
        "kvfabric_index_shard_used_bytes": "gauge",
        "kvfabric_index_shard_round_trips": "counter",
        "kvfabric_index_shards": "gauge",
        "kvfabric_index_arenas": "gauge",
        "kvfabric_index_entries": "gauge",
        "kvfabric_index_round_trips": "counter",
    }
    shards = {
        sample.labels["shard"]
        for metric in families({"index": {"shard0_entries": 3, "shard12_entries": 1}})
        for sample in metric.samples
    }
    assert shards == {"0", "12"}


def test_a_node_of_a_shared_index_serves_its_counters_per_shard(nodes: Cluster) -> None:
    keys = chain_keys(list(range(300)), 1, namespace=uuid.uuid4().bytes)
    with kvfabric.connect(nodes.url(transport="tcp")) as store:
        store.batched_put(keys, [b"v" * 100] * len(keys))
    text = _scrape(nodes)
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert "# TYPE kvfabric_index_shard_entries gauge" in text
    assert "# TYPE kvfabric_index_entries gauge" in text
    assert float(samples["kvfabric_index_shards"]) == 3
    per_shard = [float(samples[f'kvfabric_index_shard_entries{{shard="{i}"}}']) for i in range(3)]
    print(f"\nentries per shard: {per_shard}")
    assert sum(per_shard) == float(samples["kvfabric_index_entries"]) == 300
    assert float(samples["kvfabric_index_published_total"]) == 300


def test_stats_reads_a_shared_index_directly(nodes: Cluster) -> None:
    # `kvfabric stats --index redis` asks Redis itself: there is no controller to ask.
    keys = chain_keys(list(range(50)), 1, namespace=uuid.uuid4().bytes)
    with kvfabric.connect(nodes.url(transport="tcp")) as store:
        store.batched_put(keys, [b"v" * 100] * len(keys))
    options = [f"--index-opt={k}={v}" for k, v in nodes.index_options().items()]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric",
            "stats",
            "--index",
            "redis",
            *options,
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    scopes = json.loads(done.stdout)
    assert scopes["index"]["shards"] == 3
    assert sum(scopes["index"][f"shard{i}_entries"] for i in range(3)) == scopes["index"]["entries"]
    assert scopes["index"]["entries"] >= 50
    # Lookups run read-only in Redis and are counted by each client, not here (where they
    # would read as 0 whatever the clients did).
    assert "lookups" not in scopes["index"]
    assert "round_trips" not in scopes["index"]
    (node,) = [v for k, v in scopes.items() if k.startswith("node ")]
    assert node["capacity_bytes"] > 0


def test_stats_refuses_an_index_that_lives_in_a_controller() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfabric", "stats", "--index", "memory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "controller" in done.stderr
    assert "Traceback" not in done.stderr
