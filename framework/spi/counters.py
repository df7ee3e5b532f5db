"""Thread-safe named counters for a client's ``stats()``.

Failures are counted, not raised, on the read path: ``controller_unavailable`` (no answer in
time), ``controller_errors`` (an error reply or a malformed reply), ``transport_failures``
(a data node that could not be used for a batch), ``validation_failures`` (a landed record
that did not match), ``put_failures`` and ``delete_failures``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["CLIENT_COUNTERS", "Counters"]

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


class Counters:
    def __init__(self, names: Iterable[str] = CLIENT_COUNTERS) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def update(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
