"""Render the controller's counters: a table for people, Prometheus text or JSON for machines.

The controller reports scopes of counters: ``controller`` (its RPCs and refusals), ``index``
(capacity, entries, hits, dedup, evictions, ...), ``clients`` (what its clients reported
they looked up, read and wrote, and how long their calls took: :mod:`kvfabric._wire.usage`)
and one ``node ID NAME`` scope per data node (capacity and each transport server's counters,
as of its last heartbeat). The summary's hit rate is the clients' where they reported any.
The Prometheus form is written by :mod:`kvfabric._tools.metrics`, the collector the
``--metrics-port`` endpoints serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from kvfabric._tools.metrics import Scopes, exposition
from kvfabric.spi.units import format_size

__all__ = ["FORMATS", "format_json", "format_prometheus", "format_table"]

_SUMMARY = (
    ("capacity", "capacity_bytes"),
    ("used", "used_bytes"),
    ("entries", "entries"),
    ("hits", "prefix_hits"),
    ("lookup keys", "lookup_keys"),
    ("dedup", "dedup_hits"),
    ("evictions", "evictions"),
    ("rpcs", "rpcs"),
)


def format_table(scopes: Scopes) -> str:
    """A summary line, then every counter of every scope."""
    index, controller = scopes.get("index", {}), scopes.get("controller", {})
    merged = {**index, **controller}
    summary = ", ".join(
        f"{label} {format_size(merged[key]) if key.endswith('_bytes') else merged[key]}"
        for label, key in _SUMMARY
        if key in merged
    )
    # The clients' own counts where they report them: lookups from the lookup image never
    # reach the index.
    clients = scopes.get("clients", {})
    if clients.get("lookup_keys"):
        hits, asked = clients.get("lookup_hits", 0), clients["lookup_keys"]
    else:
        hits, asked = index.get("prefix_hits", 0), index.get("lookup_keys", 0)
    if asked:
        summary += f", hit rate {hits / asked:.0%} of {asked} keys looked up"
    rows = [("scope", "counter", "value")]
    for scope, counters in scopes.items():
        for name, value in counters.items():
            shown = format_size(value) if name.endswith("_bytes") else str(value)
            rows.append((scope, name, shown))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["kvfabric: " + summary]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def format_prometheus(scopes: Scopes) -> str:
    """Prometheus text exposition with ``# HELP``/``# TYPE``: what ``--metrics-port`` serves."""
    return exposition(scopes).rstrip("\n")


def format_json(scopes: Scopes) -> str:
    return json.dumps(scopes, indent=2, sort_keys=True)


FORMATS: dict[str, Callable[[Scopes], str]] = {
    "table": format_table,
    "prometheus": format_prometheus,
    "json": format_json,
}
