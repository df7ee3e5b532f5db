"""Every metric family real servers expose follows Prometheus' conventions, and the shipped
Grafana dashboard queries only metrics they expose.

A controller and a node with ``--metrics-port`` (and ``kvfabric serve``) are scraped after a
client did some of everything; the exposition must parse with prometheus-client's own parser
and each family must have: a ``kvfabric_`` (or the client library's ``process_``/``python_``)
prefix, counters' samples ending in ``_total``, base units (no ``_ms``), ``_bytes`` and
``_seconds`` as the unit suffix, HELP text of its own, no label that changes when a node
restarts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvfabric
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, free_port, wait_for

DASHBOARD = Path(__file__).parents[2] / "docs" / "deploy" / "grafana-kvfabric.json"
_METRICS_URL = re.compile(r"http://\S+/metrics")
_FALLBACK_HELP = re.compile(r"\((controller|index|clients|node)\)\.$")
_HISTOGRAM_SAMPLES = ("_bucket", "_sum", "_count")


def _scrape(ready_line: str) -> str:
    match = _METRICS_URL.search(ready_line)
    assert match, ready_line
    with urllib.request.urlopen(match.group(0), timeout=10) as response:
        return str(response.read().decode())


@pytest.fixture(scope="module")
def expositions() -> Iterator[dict[str, str]]:
    """The text of each server's ``/metrics``, after a client put, looked up and read."""
    with Cluster(
        nodes=1,
        transports=("tcp", "shm"),
        controller_args=["--metrics-port", "0"],
        node_args=["--metrics-port", "0"],
    ) as cluster:
        keys = chain_keys(list(range(8)), 1)
        with kvfabric.connect(cluster.url(transport="tcp")) as store:
            store.batched_put(keys[:4], [b"v" * 100] * 4)
            store.batched_contains(keys)
            store.batched_get(keys)
        assert cluster.controller is not None
        assert cluster.nodes[0] is not None
        controller_text = wait_for(
            "the client's report in the controller's metrics",
            lambda: _scrape(cluster.controller.ready_line),  # type: ignore[union-attr]
            until=lambda text: 'kvfabric_client_get_keys_total{outcome="hit"} 4.0' in text,
        )
        yield {
            "controller": controller_text,
            "node": _scrape(cluster.nodes[0].ready_line),
            "serve": _serve_exposition(),
        }


def _serve_exposition() -> str:
    port = free_port()
    command = [sys.executable, "-m", "kvfabric", "serve", "--listen", f"127.0.0.1:{port}"]
    command += ["--capacity", "32MiB", "--metrics-port", "0"]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        # The node's counters reach the controller with its first heartbeat.
        return wait_for(
            "serve's node in its metrics",
            lambda: _scrape(line),
            until=lambda text: "kvfabric_node_capacity_bytes{" in text,
        )
    finally:
        serve.terminate()
        serve.wait(timeout=30)


@pytest.mark.parametrize("server", ["controller", "node", "serve"])
def test_every_family_follows_the_conventions(expositions: dict[str, str], server: str) -> None:
    families = list(text_string_to_metric_families(expositions[server]))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a family exposed twice"
    assert "kvfabric_build_info" in names
    assert any(name.startswith("process_") for name in names)
    for family in families:
        where = f"{server}: {family.name}"
        assert family.name.startswith(("kvfabric_", "process_", "python_")), where
        assert "_ms" not in family.name, where
        assert "millis" not in family.name, where
        assert family.documentation.strip(), where
        assert not _FALLBACK_HELP.search(family.documentation), f"{where}: filler HELP"
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), f"{where}: {sample.name}"
            # A node is labelled by the name it keeps across restarts, never by its id.
            assert "name" not in sample.labels, where
            assert "id" not in sample.labels, where
        base = family.name.removesuffix("_total")
        for unit in ("bytes", "seconds"):
            if unit in base.split("_"):
                assert base.endswith(f"_{unit}"), where
        if family.type == "counter":
            assert not base.endswith("_total"), where
        # Levels are gauges: a family named as a level is never a counter.
        if base.endswith(("_capacity_bytes", "_used_bytes", "_free_bytes", "_entries")):
            assert family.type == "gauge", where


def test_each_value_is_exported_by_the_process_that_owns_it(expositions: dict[str, str]) -> None:
    controller = {f.name for f in text_string_to_metric_families(expositions["controller"])}
    node = {f.name for f in text_string_to_metric_families(expositions["node"])}
    serve = {f.name for f in text_string_to_metric_families(expositions["serve"])}
    # The nodes' counters come from the nodes; the controller leaves them out.
    assert not {n for n in controller if n.startswith("kvfabric_node_")}
    assert "kvfabric_node_capacity_bytes" in node
    # `serve` is controller and node in one: its node's servers serve the lookup image too,
    # so their counters appear once, as the node's.
    assert "kvfabric_node_capacity_bytes" in serve
    assert not {n for n in serve if n.startswith("kvfabric_image_transport_")}
    # The controller's request total is the sum of its requests by operation: not exported.
    assert "kvfabric_controller_rpcs" not in controller


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    assert exprs
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b((?:kvfabric|process|python)_[a-z0-9_]+)", expr))
    return names


def test_the_dashboard_queries_only_metrics_the_servers_expose(
    expositions: dict[str, str],
) -> None:
    exposed = set()
    for text in (expositions["controller"], expositions["node"]):
        for family in text_string_to_metric_families(text):
            exposed |= {sample.name for sample in family.samples}
    missing = set()
    for name in _dashboard_metrics():
        if name not in exposed and not any(
            name.endswith(suffix) and name.removesuffix(suffix) + "_count" in exposed
            for suffix in _HISTOGRAM_SAMPLES
        ):
            missing.add(name)
    assert not missing, f"the dashboard queries metrics no server exposes: {sorted(missing)}"
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for panel in ("hit rate", "latency", "bytes", "capacity", "evictions", "nodes", "refusals"):
        assert panel in titles
