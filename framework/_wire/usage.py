"""Clients' usage reports: what each client counted, sent to the controller as deltas.

Lookups answered from the lookup image never reach the controller, so its own counters
cannot show the fleet's hit rate. Each client therefore counts, per key as engines count,
what its lookups, reads and writes did and how long each call took, and sends the
difference since its last report in one ``USAGE`` message every few seconds. The report is
a fixed set of named counters (:data:`USAGE_COUNTERS`, :func:`histogram_names`): its size
does not grow with the traffic, and a controller adds only the names it knows.

Latency is a histogram per operation (:data:`OPERATIONS`) over fixed buckets
(:data:`BUCKETS_SECONDS`), so the controller adds clients' histograms bucket by bucket and
Prometheus computes quantiles over the fleet.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfabric._runtime.codec import Reader
from kvfabric._wire.protocol import read_counters, write_counters

__all__ = [
    "BUCKETS_NS",
    "BUCKETS_SECONDS",
    "OPERATIONS",
    "USAGE_COUNTERS",
    "USAGE_NAMES",
    "bucket_name",
    "histogram_names",
    "read_usage",
    "sum_name",
    "write_usage",
]

USAGE_COUNTERS = (
    "lookup_keys",
    "lookup_hits",
    "get_keys",
    "get_hits",
    "get_misses",
    "get_failures",
    "put_keys",
    "put_stored",
    "put_deduplicated",
    "put_in_flight",
    "put_no_space",
    "put_failures",
    "bytes_read",
    "bytes_written",
)
"""Keys looked up (``batched_contains`` and ``batched_exists``) and found; keys read and
what became of each (hit: landed and valid; miss: not stored; failure: stored but its read
failed, or the index could not be asked); keys offered for storage by outcome; payload
bytes read and written."""

OPERATIONS = ("lookup", "get", "put")
"""The calls whose duration is a histogram: lookups (``batched_contains``,
``batched_exists``), reads (``batched_get``, ``batched_get_scattered``) and puts."""

BUCKETS_SECONDS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds of the latency buckets; a last bucket (+Inf) takes the rest."""

BUCKETS_NS = tuple(round(bound * 1e9) for bound in BUCKETS_SECONDS)
"""The same bounds in nanoseconds, as the client measures."""


def bucket_name(operation: str, bucket: int) -> str:
    """The counter of one latency bucket (not cumulative); ``len(BUCKETS_SECONDS)`` is +Inf."""
    return f"{operation}_bucket_{bucket}"


def sum_name(operation: str) -> str:
    """The counter of one operation's summed durations, in nanoseconds."""
    return f"{operation}_duration_ns"


def histogram_names(operation: str) -> tuple[str, ...]:
    return (
        *(bucket_name(operation, i) for i in range(len(BUCKETS_SECONDS) + 1)),
        sum_name(operation),
    )


USAGE_NAMES = (*USAGE_COUNTERS, *(n for op in OPERATIONS for n in histogram_names(op)))
"""Every name a report may carry, in the order a controller reports them."""
_KNOWN = frozenset(USAGE_NAMES)


def write_usage(usage: Mapping[str, int]) -> bytes:
    """A ``USAGE`` body: the report's non-zero counters."""
    return write_counters({name: value for name, value in usage.items() if value}).getvalue()


def read_usage(r: Reader) -> dict[str, int]:
    """A ``USAGE`` body, names this side does not know left out."""
    counters = read_counters(r)
    return {name: value for name, value in counters.items() if name in _KNOWN}
