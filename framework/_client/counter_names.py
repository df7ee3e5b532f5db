"""The counters every client keeps (``Store.stats()``).

Failures are counted, not raised, on the read path: ``controller_unavailable`` (no answer in
time), ``controller_errors`` (an error reply or a malformed reply), ``transport_failures``
(a data node that could not be used for a batch), ``validation_failures`` (a landed record
that did not match), ``put_failures`` and ``delete_failures``.
"""

from __future__ import annotations

__all__ = ["CLIENT_COUNTERS"]

CLIENT_COUNTERS = (
    "control_rpcs",
    "lookups",
    "prefix_hits",
    "exists_calls",
    "gets",
    "get_hits",
    "get_misses",
    "prefetch_hits",
    "payload_bytes_read",
    "puts",
    "stored",
    "payload_bytes_written",
    "dedup_hits",
    "in_flight_skips",
    "no_space",
    "put_failures",
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
