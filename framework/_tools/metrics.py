"""kvfabric's counters for Prometheus: one collector, served over HTTP or printed as text.

The controller reports scopes of counters (``controller``, ``index``, one ``node ID NAME``
per data node; see :mod:`kvfabric._tools.stats_format`). :class:`ScopesCollector` turns a
snapshot of them into metric families, ``kvfabric_<scope>_<counter>``, nodes labelled by
``node`` (id) and ``name``, each with ``# HELP`` and ``# TYPE``. prometheus-client writes
the exposition (escaping, the ``_total`` suffix of counters) and serves it
(:class:`MetricsServer`, behind ``--metrics-port``); ``kvfabric stats --format prometheus``
prints the same text.

Levels are gauges (capacity, used and free bytes, entries, nodes, regions); everything
that only counts up is a counter. The rule is by name: the names in ``_GAUGES`` and every
name ending in ``_bytes`` are levels (``used_bytes``), while totals of bytes moved are named
``bytes_read``/``bytes_written`` and stay counters; a per-shard name (``shardN_entries``)
follows the rule for what comes after its ``shardN_``. A plugin reporting a level should
name it so.

The collector reads the counters at scrape time, through a callable: the controller's own
STATS request (so a scrape sees what ``kvfabric stats`` sees, served in order by the
controller's loop instead of read from another thread mid-update) or a node's ``stats()``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfabric._tools.endpoints import listen_error
from kvfabric._tools.health import Health
from kvfabric._tools.http_server import EndpointServer
from kvfabric.errors import KvfabricError

__all__ = ["MetricsServer", "Scopes", "ScopesCollector", "exposition", "families"]

log = logging.getLogger("kvfabric._tools.metrics")

Scopes = dict[str, dict[str, int]]

_NODE_SCOPE = re.compile(r"^node (\d+) (.*)$")
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
_GAUGES = frozenset(
    {
        "nodes",
        "entries",
        "pending",
        "extents",
        "regions",
        "registered",
        "arenas",
        "shards",
        "replicas",
        "prefault_ms",
        "image_entries",
        "image_spilled",
        "image_buckets",
        "image_prefault_ms",
        "reserving_clients",
        "reserved_grants",
        "reserved_extents",
    }
)
_SHARD = re.compile(r"^shard\d+_")

_HELP: dict[str, str] = {
    # controller
    "controller_rpcs": "Client requests served (node lists, lookups, resolves, exists, "
    "allocates, publishes, aborts, unpublishes, extent leases, publishes of carved records).",
    "controller_node_rpcs": "Requests from data nodes and tools (register, heartbeat, stats).",
    "controller_bad_frames": "Frames the controller could not decode.",
    "controller_refused": "Requests answered with an error reply.",
    "controller_internal_errors": "Requests that failed inside the controller.",
    "controller_upkeep_errors": "Upkeep calls into the index (tick, idle) that raised "
    "(logged at most once a minute per step; the controller goes on serving).",
    "controller_nodes_dropped": "Data nodes dropped after missing heartbeats for --node-timeout.",
    "controller_reserving_clients": "Clients holding grants not yet published or extents.",
    "controller_reserved_bytes": "Bytes clients hold reserved (grants not yet published, "
    "extents leased).",
    "controller_reserved_grants": "Grants made and not yet published, aborted or expired.",
    "controller_reserved_extents": "Extents leased and not yet given back or expired.",
    "controller_reservations_refused": "Keys answered NO_SPACE because their client held "
    "its bound (--max-client-bytes, --max-client-grants).",
    "controller_extent_leases_refused": "Extents not leased because their client held its bound.",
    # index
    "index_lookups": "Prefix lookups (batched_contains calls that reached the controller).",
    "index_lookup_keys": "Keys asked for in prefix lookups.",
    "index_prefix_hits": "Keys found by prefix lookups (each lookup's leading stored run).",
    "index_resolves": "Per-key resolves (batched_get without a prior lookup).",
    "index_resolve_hits": "Keys found by resolves.",
    "index_exists_calls": "batched_exists calls.",
    "index_grants": "Slots granted to writers.",
    "index_dedup_hits": "Keys offered for storage that were stored already (no bytes moved).",
    "index_in_flight": "Keys offered while another writer was storing them.",
    "index_no_space": "Keys refused for lack of space.",
    "index_published": "Records published (readable).",
    "index_publish_rejected": "Publishes refused (lease expired or slot reclaimed).",
    "index_aborted": "Grants given back by writers that failed.",
    "index_unpublished": "Records deleted.",
    "index_evictions": "Records evicted (least recently used) to make room.",
    "index_lease_expiries": "Grants whose writer did not publish within the lease.",
    "index_extents_leased": "Extents leased to writers (who lay their records into them).",
    "index_extents_returned": "Extents writers gave back, their unused part freed.",
    "index_extent_expiries": "Extents whose lease ran out, their unused part freed.",
    "index_carved": "Records published from extents (a put of one round trip).",
    "index_carve_refused": "Records from extents refused (lease over, or outside its unused part).",
    "index_extents": "Extents leased to writers now.",
    "index_extent_bytes": "Bytes of leased extents not used yet (neither free nor used).",
    "index_nodes": "Data nodes registered.",
    "index_entries": "Records stored and readable.",
    "index_pending": "Records granted and not yet published.",
    "index_capacity_bytes": "Bytes of every registered node's regions.",
    "index_free_bytes": "Bytes in free slots.",
    "index_retired_bytes": "Bytes freed and waiting out --grace before reuse.",
    "index_used_bytes": "Bytes in slots holding records (headers and alignment included).",
    "index_stored_payload_bytes": "Payload bytes of the records stored.",
    "index_image_entries": "Records in the lookup image (clients look them up one-sided).",
    "index_image_spilled": "Records with no room in their window of the lookup image (their "
    "lookups go by RPC).",
    "index_image_buckets": "Buckets of the lookup image.",
    "index_image_prefault_ms": "Milliseconds the index took at start to prepare the lookup "
    "image's memory.",
    # node
    "node_capacity_bytes": "Bytes of this node's regions.",
    "node_regions": "Regions this node serves.",
    "node_prefault_ms": "Milliseconds this node took at start to prepare its memory (0: not).",
    "node_huge_page_bytes": "Bytes of this node's regions mapped by huge pages.",
    "node_registered": "1 while the controller knows this node, 0 while it is registering.",
}


def _kind(counter: str) -> str:
    level = _SHARD.sub("", counter)
    return "gauge" if level in _GAUGES or level.endswith("_bytes") else "counter"


def _help(family: str, scope: str, counter: str) -> str:
    known = _HELP.get(family)
    if known:
        return known
    if family.startswith("controller_rpc_"):
        return f"{counter.removeprefix('rpc_').upper()} requests served by the controller."
    transport, _, what = counter.partition("_")
    if scope == "node" and what:
        return f"{transport} transport server of the node: {what.replace('_', ' ')}."
    return f"{counter.replace('_', ' ')} ({scope}), as kvfabric reports it."


class ScopesCollector(Collector):
    """Metric families from ``fetch()`` at each scrape; ``kvfabric_up`` says if it answered."""

    def __init__(self, fetch: Callable[[], Scopes], source: str) -> None:
        self._fetch = fetch
        self._source = source

    def collect(self) -> Iterator[Metric]:
        try:
            scopes = self._fetch()
            up = 1
        except KvfabricError as exc:
            log.warning("metrics: could not read the counters of %s: %s", self._source, exc)
            scopes, up = {}, 0
        yield GaugeMetricFamily(
            "kvfabric_up", f"1 when the counters of {self._source} could be read.", value=up
        )
        yield from families(scopes)


def families(scopes: Scopes) -> list[Metric]:
    """One family per ``kvfabric_<scope>_<counter>``; node scopes share families, by label."""
    found: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for scope, counters in scopes.items():
        node = _NODE_SCOPE.match(scope)
        kind = "node" if node else _UNSAFE.sub("_", scope)
        labels = [node.group(1), node.group(2)] if node else []
        for counter, value in counters.items():
            family = f"{kind}_{_UNSAFE.sub('_', counter)}"
            metric = found.get(family)
            if metric is None:
                name, help_text = f"kvfabric_{family}", _help(family, kind, counter)
                label_names = ["node", "name"] if node else []
                if _kind(counter) == "gauge":
                    metric = GaugeMetricFamily(name, help_text, labels=label_names)
                else:
                    metric = CounterMetricFamily(name, help_text, labels=label_names)
                found[family] = metric
            metric.add_metric(labels, value)
    return list(found.values())


def exposition(scopes: Scopes) -> str:
    """Prometheus text exposition of ``scopes``, as a scrape of the endpoint would return."""
    registry = CollectorRegistry()
    registry.register(ScopesCollector(lambda: scopes, "the controller"))
    return generate_latest(registry).decode()


class MetricsServer:
    """An HTTP endpoint Prometheus scrapes: ``http://HOST:PORT/metrics`` (port 0: any),
    beside ``/healthz`` and ``/readyz`` (``health``'s checks; none given: always ready).
    See :mod:`kvfabric._tools.http_server`."""

    def __init__(
        self, collector: Collector, host: str, port: int, health: Health | None = None
    ) -> None:
        registry = CollectorRegistry()
        registry.register(collector)
        try:
            self._server = EndpointServer(registry, health or Health(), host, port)
        except OSError as exc:
            raise listen_error(
                "the metrics endpoint", f"{host}:{port}", exc.errno, str(exc), "--metrics-port"
            ) from exc
        self.host = host
        self.port = self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.close()
