"""kvfabric's counters as Prometheus metric families, named and labelled the usual way.

The controller reports scopes of counters (``controller``, ``index``, ``clients``, one
``node ID NAME`` per data node; see :mod:`kvfabric._tools.stats_format`). :func:`families`
turns them into metrics as Prometheus' naming guide has them:

- one metric per quantity, what varies in a label: the request type (``operation``), the
  outcome of a key (``outcome``), the transport, the Redis shard, the node;
- base units in the name (``_bytes``, ``_seconds``: a ``_ms`` counter becomes seconds);
- counters end in ``_total`` (prometheus-client adds it), levels are gauges: by the rule of
  :func:`is_gauge` where a name is not in the tables here;
- a node is labelled by its configured name, which it keeps across restarts, never by the
  id its controller gave it;
- a sum of other values that are exported is left out (the controller's ``rpcs`` is the
  sum of its requests by ``operation``), so nothing is counted twice; ``kvfabric stats``
  keeps every counter.

Clients' usage reports (scope ``clients``, :mod:`kvfabric._wire.usage`) become the fleet's
key counts by outcome, bytes and latency histograms per operation. A counter a plugin adds
that the tables do not name keeps its scope's prefix, ``kvfabric_<scope>_<name>``, typed by
the rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import attrs
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvfabric._wire.usage import BUCKETS_SECONDS, OPERATIONS, bucket_name, sum_name

__all__ = ["NODE_SCOPE", "Scopes", "families", "is_gauge"]

Scopes = dict[str, dict[str, int]]

NODE_SCOPE = re.compile(r"^node (\d+) (.*)$")
"""A data node's scope, ``node ID NAME``."""
TENANT_SCOPE = re.compile(r"^tenant (.+)$")
"""A tenant's scope, ``tenant NAME`` (docs/tenants.md)."""

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
_SHARD = re.compile(r"^shard(\d+)_(.+)$")
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
        "image_entries",
        "image_spilled",
        "image_buckets",
        "image_endpoints",
        "reserving_clients",
        "reserved_grants",
        "reserved_extents",
        "gc_frozen_objects",
    }
)


def is_gauge(counter: str) -> bool:
    """Levels (they rise and fall) are gauges: the names in ``_GAUGES``, every name ending
    in ``_bytes`` or ``_ms`` (totals of bytes moved are named ``bytes_read``,
    ``bytes_written``) and a per-shard level (``shardN_entries``)."""
    shard = _SHARD.match(counter)
    level = shard.group(2) if shard else counter
    return level in _GAUGES or level.endswith(("_bytes", "_ms"))


@attrs.frozen
class _Spec:
    name: str
    """Without ``_total``: prometheus-client adds it to a counter's samples."""
    help: str
    gauge: bool = False
    labels: tuple[str, ...] = ()


def _c(name: str, help_text: str, *labels: str) -> _Spec:
    return _Spec(f"kvfabric_{name}", help_text, False, labels)


def _g(name: str, help_text: str, *labels: str) -> _Spec:
    return _Spec(f"kvfabric_{name}", help_text, True, labels)


# -- controller --------------------------------------------------------------------------

_REQUESTS = _c(
    "controller_requests",
    "Requests the controller served, by operation (the message type: lookup_prefix, "
    "resolve, allocate, publish, heartbeat, touch, usage, ...).",
    "operation",
)
_CONTROLLER_SUMS = frozenset({"rpcs", "node_rpcs", "touch_rpcs", "usage_rpcs", "auth_refused"})
"""Sums of ``rpc_*`` by kind and of ``auth_refused_*`` by reason: ``kvfabric stats`` shows
them, the metrics sum by label."""
_AUTH_REFUSED = _c(
    "controller_auth_refused",
    "Control connections whose handshake the controller refused, by reason: wrong_secret "
    "(the client's secret differs), no_secret (the client has none), unexpected_secret "
    "(the client has one, the controller none), other.",
    "reason",
)

_CONTROLLER: dict[str, _Spec] = {
    "bad_frames": _c("controller_bad_frames", "Frames the controller could not decode."),
    "refused": _c(
        "controller_refused_requests", "Requests the controller answered with an error reply."
    ),
    "internal_errors": _c(
        "controller_internal_errors", "Requests that failed inside the controller."
    ),
    "upkeep_errors": _c(
        "controller_upkeep_errors",
        "Upkeep calls into the index (tick, idle) that raised; the controller goes on serving.",
    ),
    "nodes_dropped": _c(
        "controller_nodes_dropped",
        "Data nodes dropped with their entries after missing heartbeats for --node-timeout.",
    ),
    "nodes_deregistered": _c(
        "controller_nodes_deregistered", "Data nodes that deregistered as they stopped."
    ),
    "takeovers_refused": _c(
        "controller_takeovers_refused",
        "Registrations refused because a live node holds the name.",
    ),
    "image_endpoints": _g(
        "controller_image_endpoints", "Transports the lookup image is served on (0: none)."
    ),
    "image_server_restarts": _c(
        "controller_image_server_restarts", "Restarts of the lookup image's server process."
    ),
    "reserving_clients": _g(
        "controller_reserving_clients", "Clients holding grants not yet published or extents."
    ),
    "reserved_bytes": _g(
        "controller_reserved_bytes",
        "Bytes clients hold reserved (grants not yet published, extents leased).",
    ),
    "reserved_grants": _g(
        "controller_reserved_grants", "Grants made and not yet published, aborted or expired."
    ),
    "reserved_extents": _g(
        "controller_reserved_extents", "Extents leased and not yet given back or expired."
    ),
    "reservations_refused": _c(
        "controller_reservations_refused",
        "Keys answered NO_SPACE because their client held its bound (--max-client-bytes, "
        "--max-client-grants).",
    ),
    "extent_leases_refused": _c(
        "controller_extent_leases_refused",
        "Extents not leased because their client held its bound.",
    ),
    # --kv-events (docs/kv-events.md)
    "kv_events_published": _c(
        "controller_kv_events_published",
        "KV events sent on --kv-events (each block stored or removed, each clear).",
    ),
    "kv_event_batches": _c(
        "controller_kv_event_batches", "KV event batches sent (one sequence number each)."
    ),
    "kv_events_dropped": _c(
        "controller_kv_events_dropped",
        "KV events dropped before they were sent, because changes came faster than the "
        "publisher sent them (subscribers see a gap replay cannot fill).",
    ),
    "kv_event_gaps": _c(
        "controller_kv_event_gaps", "Sequence numbers skipped for dropped KV events."
    ),
    "kv_events_queued": _g("controller_kv_events_queued", "KV events waiting to be sent."),
    "kv_event_replay_requests": _c(
        "controller_kv_event_replay_requests",
        "Replay requests answered on --kv-events-replay.",
    ),
    "kv_events_replayed": _c(
        "controller_kv_events_replayed", "KV event batches sent again on the replay socket."
    ),
    "gc_frozen_objects": _g(
        "controller_gc_frozen_objects",
        "Objects exempted from the controller's full garbage collections.",
    ),
}

# -- index -------------------------------------------------------------------------------

_LOOKUP_KEYS = _c(
    "index_lookup_keys",
    "Keys asked in prefix lookups that reached the index, by outcome (hit: in the "
    "lookup's leading stored run). Lookups answered from the lookup image are counted "
    "by the clients (kvfabric_client_lookup_keys_total).",
    "outcome",
)
_OFFERED = _c(
    "index_offered_keys",
    "Keys offered for storage through allocations, by outcome (granted: a slot to write; "
    "deduplicated: stored already, no bytes moved; in_flight: another writer is storing "
    "it; no_space; oversize).",
    "outcome",
)
_OFFER_OUTCOMES = {
    "grants": "granted",
    "dedup_hits": "deduplicated",
    "in_flight": "in_flight",
    "no_space": "no_space",
    "oversize": "oversize",
}
_SECONDS = {"image_prefault_ms": "image_prefault", "prefault_ms": "prefault"}

_INDEX: dict[str, _Spec] = {
    "lookups": _c(
        "index_lookups", "Prefix lookups (batched_contains calls) that reached the index."
    ),
    "resolves": _c("index_resolves", "Resolves: reads whose keys the index located."),
    "resolve_hits": _c("index_resolve_hits", "Keys found by resolves."),
    "exists_calls": _c("index_exists_calls", "batched_exists calls that reached the index."),
    "published": _c("index_published", "Records published (readable)."),
    "publish_rejected": _c(
        "index_publish_rejected", "Publishes refused (lease expired or slot reclaimed)."
    ),
    "aborted": _c("index_aborted", "Grants given back by writers that failed."),
    "unpublished": _c("index_unpublished", "Records deleted."),
    "evictions": _c("index_evictions", "Records evicted (least recently used) to make room."),
    "lease_expiries": _c(
        "index_lease_expiries", "Grants whose writer did not publish within the lease."
    ),
    "extents_leased": _c("index_extents_leased", "Extents leased to writers."),
    "extents_returned": _c(
        "index_extents_returned", "Extents writers gave back, their unused part freed."
    ),
    "extent_expiries": _c(
        "index_extent_expiries", "Extents whose lease ran out, their unused part freed."
    ),
    "carved": _c("index_carved", "Records published from extents (a put of one round trip)."),
    "carve_refused": _c(
        "index_carve_refused",
        "Records from extents refused (lease over, or outside its unused part).",
    ),
    "touches": _c("index_touches", "Use reports of clients' lookups from the lookup image."),
    "touched_keys": _c("index_touched_keys", "Keys in clients' use reports."),
    "extents": _g("index_extents", "Extents leased to writers now."),
    "extent_bytes": _g(
        "index_extent_bytes", "Bytes of leased extents not used yet (neither free nor used)."
    ),
    "nodes": _g("index_nodes", "Data nodes registered in the index."),
    "entries": _g("index_entries", "Records stored and readable."),
    "pending": _g("index_pending", "Records granted and not yet published."),
    "capacity_bytes": _g("index_capacity_bytes", "Bytes of every registered node's regions."),
    "free_bytes": _g("index_free_bytes", "Bytes in free slots."),
    "retired_bytes": _g("index_retired_bytes", "Bytes freed and waiting out --grace before reuse."),
    "used_bytes": _g(
        "index_used_bytes", "Bytes in slots holding records (headers and alignment included)."
    ),
    "stored_payload_bytes": _g(
        "index_stored_payload_bytes", "Payload bytes of the records stored."
    ),
    "image_entries": _g(
        "index_image_entries", "Records in the lookup image (clients look them up one-sided)."
    ),
    "image_spilled": _g(
        "index_image_spilled",
        "Records with no room in their window of the lookup image (their lookups go by RPC).",
    ),
    "image_buckets": _g("index_image_buckets", "Buckets of the lookup image."),
    "image_prefault_ms": _g(
        "index_image_prefault_seconds",
        "Seconds the index took at start to prepare the lookup image's memory.",
    ),
    "early_reuse": _c(
        "index_early_reuse", "Retired slots reused before --grace ran out, for lack of room."
    ),
    "invalid_reports": _c(
        "index_invalid_reports", "Records clients reported invalid (unpublished then)."
    ),
    "restored": _c("index_restored", "Records restored from data nodes' reports after a restart."),
    "restore_duplicates": _c(
        "index_restore_duplicates", "Records reported in a restore that were known already."
    ),
    "restore_overlaps": _c(
        "index_restore_overlaps", "Records reported in a restore that overlapped others (dropped)."
    ),
    "replica_grants": _c("index_replica_grants", "Slots granted for copies beyond a key's first."),
    "replica_shortfall": _c(
        "index_replica_shortfall", "Copies not granted for lack of distinct nodes with room."
    ),
    "replica_repairs": _c(
        "index_replica_repairs", "Copies granted to repair a stored key's lost ones."
    ),
    "replicas_published": _c("index_replicas_published", "Copies beyond a key's first published."),
    "replicas_dropped": _c("index_replicas_dropped", "Copies dropped with their node."),
    "promotions": _c(
        "index_promotions", "Keys whose first copy was lost and another took its place."
    ),
    "hosted_drops": _c("index_hosted_drops", "Records dropped with an arena whose node left."),
    "shards": _g("index_shards", "Redis masters the index's arenas are spread over."),
    "arenas": _g("index_arenas", "Arenas of the index (one per data node region set)."),
}
_SHARDED: dict[str, _Spec] = {
    "entries": _g("index_shard_entries", "Records stored, per Redis master.", "shard"),
    "used_bytes": _g(
        "index_shard_used_bytes", "Bytes in slots holding records, per Redis master.", "shard"
    ),
    "round_trips": _c(
        "index_shard_round_trips", "This process's round trips to each Redis master.", "shard"
    ),
}

# -- clients -----------------------------------------------------------------------------

_CLIENT_KEYS: dict[str, tuple[_Spec, str]] = {}
_CLIENT_LOOKUP = _c(
    "client_lookup_keys",
    "Keys clients looked up (batched_contains, batched_exists), by outcome (hit: stored); "
    "counted by the clients, so lookups answered from the lookup image are in.",
    "outcome",
)
_CLIENT_GET = _c(
    "client_get_keys",
    "Keys clients read, by outcome (hit: landed and valid; miss: not stored; failed: "
    "stored, or the index could not be asked, and the read did not land a valid record).",
    "outcome",
)
_CLIENT_PUT = _c(
    "client_put_keys",
    "Keys clients offered for storage, by outcome (stored; deduplicated: stored already, "
    "no bytes moved; in_flight: another writer was storing it; no_space; failed).",
    "outcome",
)
for _name, _outcome in (("get_hits", "hit"), ("get_misses", "miss"), ("get_failures", "failed")):
    _CLIENT_KEYS[_name] = (_CLIENT_GET, _outcome)
for _name, _outcome in (
    ("put_stored", "stored"),
    ("put_deduplicated", "deduplicated"),
    ("put_in_flight", "in_flight"),
    ("put_no_space", "no_space"),
    ("put_failures", "failed"),
):
    _CLIENT_KEYS[_name] = (_CLIENT_PUT, _outcome)
_CLIENT_BYTES = {
    "bytes_read": _c(
        "client_read_bytes", "Payload bytes clients read (records landed and validated)."
    ),
    "bytes_written": _c("client_written_bytes", "Payload bytes clients wrote."),
}
_CLIENT_SECONDS = (
    "kvfabric_client_operation_duration_seconds",
    "Duration of clients' calls, by operation (lookup: batched_contains and "
    "batched_exists; get: batched_get; put: batched_put), as the client measured it.",
)

# -- nodes -------------------------------------------------------------------------------

_NODE: dict[str, _Spec] = {
    "capacity_bytes": _g("node_capacity_bytes", "Bytes of this node's regions.", "node"),
    "regions": _g("node_regions", "Regions this node serves.", "node"),
    "prefault_ms": _g(
        "node_prefault_seconds",
        "Seconds this node took at start to prepare its memory (0: not prepared).",
        "node",
    ),
    "huge_page_bytes": _g(
        "node_huge_page_bytes", "Bytes of this node's regions mapped by huge pages.", "node"
    ),
    "registered": _g(
        "node_registered",
        "1 while this node is registered and its controller (or shared index) answers its "
        "heartbeats, else 0.",
        "node",
    ),
    "heartbeat_failures": _c(
        "node_heartbeat_failures",
        "Heartbeats and registrations of this node that its controller (or shared index) did "
        "not answer.",
        "node",
    ),
}
_TRANSPORT_HELP = {
    "connections": "Connections accepted",
    "handshakes": "Handshakes completed (connections authenticated)",
    "handshake_timeouts": "Connections closed for not completing the handshake in time",
    "pending_evicted": "Pending handshakes closed to make room for newer ones",
    "auth_failures": "Connections refused for a wrong or missing secret",
    "bad_frames": "Frames refused as malformed",
    "tls_failures": "TLS handshakes that failed",
    "connections_refused": "Authenticated connections refused (the server was at its limit)",
    "frames": "Request frames served",
    "requests": "Read and write requests served",
    "segments_read": "Segments clients read",
    "segments_written": "Segments clients wrote",
    "bytes_read": "Bytes clients read from this server",
    "bytes_written": "Bytes clients wrote to this server",
    "refused_segments": "Segments refused (bad rkey or out of bounds)",
    "stalled_frames": "Frames whose peer stalled mid-frame",
    "idle_timeouts": "Connections closed after being idle",
    "idle_evicted": "Idle connections closed to make room for new ones",
    "restarts": "Restarts of the server process",
    "progress_wakeups": "Wake-ups of the progress thread",
    "progress_events": "Events the progress thread handled",
    "regions": "Regions registered with the transport",
}
_UNIT_LAST = {"bytes_read": "read_bytes", "bytes_written": "written_bytes"}


# -- tenants -----------------------------------------------------------------------------

_TENANT: dict[str, _Spec] = {
    "quota_bytes": _g("tenant_quota_bytes", "Bytes this tenant may hold (its quota).", "tenant"),
    "used_bytes": _g("tenant_used_bytes", "Bytes of values this tenant holds.", "tenant"),
    "reserved_bytes": _g(
        "tenant_reserved_bytes", "Bytes reserved by this tenant's puts not yet published.", "tenant"
    ),
    "entries": _g("tenant_entries", "Values this tenant holds.", "tenant"),
    "ttl_seconds": _g(
        "tenant_ttl_seconds", "Seconds a value of this tenant lives (0: no limit).", "tenant"
    ),
    "quota_evictions": _c(
        "tenant_quota_evictions",
        "Values of this tenant evicted to keep it within its quota.",
        "tenant",
    ),
    "quota_refusals": _c(
        "tenant_quota_refusals",
        "Puts of this tenant refused because its quota could not make room.",
        "tenant",
    ),
    "ttl_expirations": _c(
        "tenant_ttl_expirations", "Values of this tenant removed at the end of their TTL.", "tenant"
    ),
}


def _tenant(out: _Families, name: str, counters: dict[str, int]) -> None:
    for counter, value in counters.items():
        spec = _TENANT.get(counter) or _fallback(
            "tenant", counter, f"{counter.replace('_', ' ')} (tenant).", "tenant"
        )
        out.add(spec, [name], value)


class _Families:
    """Metric families being filled, by name, in the order first seen."""

    def __init__(self) -> None:
        self._found: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, spec: _Spec, labels: Iterable[str], value: float) -> None:
        metric = self._found.get(spec.name)
        if metric is None:
            kind = GaugeMetricFamily if spec.gauge else CounterMetricFamily
            metric = kind(spec.name, spec.help, labels=list(spec.labels))
            self._found[spec.name] = metric
        metric.add_metric(list(labels), value)

    def values(self) -> list[Metric]:
        return list(self._found.values())


def _fallback(prefix: str, counter: str, help_text: str, *labels: str) -> _Spec:
    """A counter no table names: ``kvfabric_<prefix>_<counter>``, typed by the rule."""
    name = _UNSAFE.sub("_", counter)
    if name.endswith("_ms"):
        name = name.removesuffix("_ms") + "_seconds"
    return _Spec(
        f"kvfabric_{prefix}_{_UNIT_LAST.get(name, name)}", help_text, is_gauge(counter), labels
    )


def _scaled(counter: str, value: int) -> float:
    return value / 1000 if counter.endswith("_ms") else value


def _transport(
    out: _Families, prefix: str, transport: str, what: str, value: int, node: str | None = None
) -> None:
    """One transport server's counter, labelled by transport (and node, on a node)."""
    help_text = _TRANSPORT_HELP.get(what, what.replace("_", " ").capitalize())
    where = "the lookup image's servers" if node is None else "the node's servers"
    labels = ("transport",) if node is None else ("node", "transport")
    spec = _fallback(f"{prefix}_transport", what, f"{help_text}, by {where}.", *labels)
    out.add(spec, [transport] if node is None else [node, transport], _scaled(what, value))


def _controller(out: _Families, counters: dict[str, int], image: bool) -> None:
    # Every named counter from the start, 0 until it counts (the controller adds some only
    # when they first happen): a query of one finds a series at once.
    for counter, value in {**dict.fromkeys(_CONTROLLER, 0), **counters}.items():
        if counter in _CONTROLLER_SUMS:
            continue
        if counter.startswith("rpc_"):
            out.add(_REQUESTS, [counter.removeprefix("rpc_")], value)
        elif counter.startswith("auth_refused_"):
            out.add(_AUTH_REFUSED, [counter.removeprefix("auth_refused_")], value)
        elif counter in _CONTROLLER:
            out.add(_CONTROLLER[counter], [], value)
        elif counter.startswith("image_"):
            if image:
                transport, _, what = counter.removeprefix("image_").partition("_")
                _transport(out, "image", transport, what, value)
        else:
            spec = _fallback("controller", counter, f"{counter.replace('_', ' ')} (controller).")
            out.add(spec, [], _scaled(counter, value))


def _index(out: _Families, counters: dict[str, int]) -> None:
    if "lookup_keys" in counters:
        hits = counters.get("prefix_hits", 0)
        out.add(_LOOKUP_KEYS, ["hit"], hits)
        out.add(_LOOKUP_KEYS, ["miss"], max(counters["lookup_keys"] - hits, 0))
    for counter, value in counters.items():
        if counter in ("lookup_keys", "prefix_hits"):
            continue
        shard = _SHARD.match(counter)
        if counter in _OFFER_OUTCOMES:
            out.add(_OFFERED, [_OFFER_OUTCOMES[counter]], value)
        elif counter in _INDEX:
            out.add(_INDEX[counter], [], _scaled(counter, value))
        elif shard and shard.group(2) in _SHARDED:
            out.add(_SHARDED[shard.group(2)], [shard.group(1)], value)
        else:
            spec = _fallback("index", counter, f"{counter.replace('_', ' ')} (index).")
            out.add(spec, [], _scaled(counter, value))


def _clients(out: _Families, counters: dict[str, int]) -> None:
    if "lookup_keys" in counters:
        hits = counters.get("lookup_hits", 0)
        out.add(_CLIENT_LOOKUP, ["hit"], hits)
        out.add(_CLIENT_LOOKUP, ["miss"], max(counters["lookup_keys"] - hits, 0))
    for counter, (spec, outcome) in _CLIENT_KEYS.items():
        if counter in counters:
            out.add(spec, [outcome], counters[counter])
    for counter, spec in _CLIENT_BYTES.items():
        if counter in counters:
            out.add(spec, [], counters[counter])


def _client_latency(counters: dict[str, int]) -> Iterator[Metric]:
    if sum_name(OPERATIONS[0]) not in counters:
        return
    histogram = HistogramMetricFamily(*_CLIENT_SECONDS, labels=["operation"])
    for operation in OPERATIONS:
        cumulative, buckets = 0, []
        for i, bound in enumerate((*BUCKETS_SECONDS, float("inf"))):
            cumulative += counters.get(bucket_name(operation, i), 0)
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        seconds = counters.get(sum_name(operation), 0) / 1e9
        histogram.add_metric([operation], buckets, seconds)
    yield histogram


def _node(out: _Families, name: str, counters: dict[str, int]) -> None:
    for counter, value in counters.items():
        if counter in _NODE:
            out.add(_NODE[counter], [name], _scaled(counter, value))
        else:
            transport, _, what = counter.partition("_")
            if what:
                _transport(out, "node", transport, what, value, name)
            else:
                spec = _fallback("node", counter, f"{counter.replace('_', ' ')} (node).", "node")
                out.add(spec, [name], _scaled(counter, value))


def families(scopes: Scopes, *, nodes: bool = True, image: bool = True) -> list[Metric]:
    """Metric families of ``scopes``. ``nodes=False`` leaves the node scopes out and
    ``image=False`` the lookup image's servers (a process exports what it owns; see
    :mod:`kvfabric._tools.metrics`)."""
    out = _Families()
    latency: list[Metric] = []
    for scope, counters in scopes.items():
        node = NODE_SCOPE.match(scope)
        if node:
            if nodes:
                _node(out, node.group(2), counters)
        elif tenant := TENANT_SCOPE.match(scope):
            _tenant(out, tenant.group(1), counters)
        elif scope == "controller":
            _controller(out, counters, image)
        elif scope == "index":
            _index(out, counters)
        elif scope == "clients":
            _clients(out, counters)
            latency += _client_latency(counters)
        else:
            prefix = _UNSAFE.sub("_", scope)
            for counter, value in counters.items():
                spec = _fallback(prefix, counter, f"{counter.replace('_', ' ')} ({scope}).")
                out.add(spec, [], _scaled(counter, value))
    return [*out.values(), *latency]
