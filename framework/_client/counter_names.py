"""The counters every client keeps (``Store.stats()``), by group, and the one place they are made.

Failures are counted, not raised, on the read path: ``controller_unavailable`` (no answer in
time), ``controller_errors`` (an error reply or a malformed reply), ``transport_failures``
(a data node that could not be used for a batch), ``validation_failures`` (a landed record
that did not match), ``put_failures`` and ``delete_failures``. ``outcomes_unknown`` counts
records whose publish the index never confirmed nor denied (reported ``FAILED``), and
``records_wiped`` those of them whose headers this client wiped so no scan restores them.

Lookups answered from the lookup image are ``onesided_lookups`` (no control RPC;
``image_round_trips`` data-plane reads of it), those it could not fully answer
``image_fallbacks`` (one control RPC each, in ``control_rpcs``); ``image_unavailable``
counts the lookups and puts that found the image unusable (a read of it failed, or its owner
stopped beating) and asked the index instead; ``touch_rpcs`` counts the background use
reports, which are not in ``control_rpcs``.

Keys are counted as engines count blocks: ``lookup_keys`` asked by ``batched_contains``
(``prefix_hits`` found), ``exists_keys`` asked by ``batched_exists`` (``exists_hits``
found); ``get_hits`` and ``get_misses`` add up to the keys read, and ``get_failures`` are
the misses of keys the index holds (or could not be asked about) whose read failed.

A data node that failed as a whole is held off for a while (the URL option
``node_backoff``): ``nodes_backed_off`` counts the failures that began or lengthened such a
period, ``backoff_skips`` the records a read or write did not attempt because their node was
held off, and ``backoff_misses`` the keys a lookup counted as misses for that reason.
"""

from __future__ import annotations

from kvfabric.spi.counters import Counters

__all__ = [
    "BACKOFF_COUNTERS",
    "CLIENT_COUNTERS",
    "EXTENT_COUNTERS",
    "IMAGE_COUNTERS",
    "REPLICA_COUNTERS",
    "REPORT_COUNTERS",
    "client_counters",
]

CLIENT_COUNTERS = (
    "control_rpcs",
    "lookups",
    "lookup_keys",
    "prefix_hits",
    "exists_calls",
    "exists_keys",
    "exists_hits",
    "gets",
    "get_hits",
    "get_misses",
    "get_failures",
    "prefetch_hits",
    "payload_bytes_read",
    "puts",
    "stored",
    "payload_bytes_written",
    "dedup_hits",
    "in_flight_skips",
    "no_space",
    "put_failures",
    "outcomes_unknown",
    "records_wiped",
    "late_writes_avoided",
    "deletes",
    "delete_failures",
    "validation_failures",
    "invalid_reported",
    "refused_reads",
    "transport_failures",
    "controller_unavailable",
    "controller_errors",
    "evictions",
)

IMAGE_COUNTERS = (
    "onesided_lookups",
    "image_fallbacks",
    "image_round_trips",
    "image_unavailable",
    "touch_rpcs",
    "touch_failures",
    "touches_dropped",
)
"""Lookups answered from the lookup image, counted apart from control RPCs, and the
background use reports that tell the index of their hits."""

REPLICA_COUNTERS = (
    "replica_writes",
    "replica_repairs",
    "replica_reads",
    "replica_hits",
)
"""Values kept on several nodes: copies written beyond each key's first (repairs of a
stored key's lost copies among them), and reads that fell over to another copy."""

REPORT_COUNTERS = ("usage_reports", "usage_reports_dropped")
"""This client's usage reports to its controller (:mod:`~kvfabric._client.usage`): sent,
and dropped because the controller did not take them."""

BACKOFF_COUNTERS = ("nodes_backed_off", "backoff_skips", "backoff_misses")
"""Data nodes held off after failing as a whole (:mod:`~kvfabric._client.node_breaker`)."""

EXTENT_COUNTERS = ("extent_leases", "carved_writes")
"""Puts into extents leased from the index: leases, and records written into them."""


def client_counters() -> Counters:
    """A fresh set of every counter a store keeps, each at 0."""
    return Counters(
        (
            *CLIENT_COUNTERS,
            *IMAGE_COUNTERS,
            *REPLICA_COUNTERS,
            *EXTENT_COUNTERS,
            *REPORT_COUNTERS,
            *BACKOFF_COUNTERS,
        )
    )
