"""What this client's calls did, timed and reported to the controller in the background.

:class:`CallTimes` keeps a latency histogram per operation (lookup, get, put) over the fixed
buckets of :mod:`kvfabric._wire.usage`. Each thread adds to its own array of integers (a
bisect and two additions per call, no lock, nothing per key); a report sums the arrays.

:class:`UsageReporter` sends, every ``interval`` seconds on a thread of its own, the
difference since its last report of the store's key counts (read from its counters, which
the calls add to anyway) and of the histograms: one ``USAGE`` message of bounded size. A
report that fails is dropped, never retried nor queued, so a dead controller costs nothing
but the dropped counts (``usage_reports_dropped``) and nothing is ever counted twice. Both
are made with the rest of a store's parts, so a child forked from a client starts from zero
and never sends its parent's counts.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Mapping

from kvfabric._wire.usage import (
    BUCKETS_NS,
    OPERATIONS,
    USAGE_COUNTERS,
    bucket_name,
    sum_name,
)
from kvfabric.errors import KvfabricError
from kvfabric.spi.counters import Counters

__all__ = ["GET", "LOOKUP", "PUT", "CallTimes", "UsageReporter", "usage_of"]

log = logging.getLogger("kvfabric")

LOOKUP, GET, PUT = range(len(OPERATIONS))
_SLOTS = len(BUCKETS_NS) + 2  # the buckets, +Inf, the sum of durations
_BUCKETS = list(BUCKETS_NS)


class CallTimes:
    """Per-operation latency histograms, added to by each thread in an array of its own."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._arrays: list[list[int]] = []

    def observe(self, operation: int, nanoseconds: int) -> None:
        """One call of ``operation`` (:data:`LOOKUP`, :data:`GET`, :data:`PUT`) took this long."""
        try:
            counts: list[int] = self._local.counts
        except AttributeError:
            counts = self._local.counts = self._new_array()
        base = operation * _SLOTS
        counts[base + bisect.bisect_left(_BUCKETS, nanoseconds)] += 1
        counts[base + _SLOTS - 1] += nanoseconds

    def snapshot(self) -> dict[str, int]:
        """Every bucket's and sum's total so far, by report name."""
        with self._lock:
            arrays = list(self._arrays)
        totals = [sum(column) for column in zip(*arrays, strict=True)] if arrays else None
        out: dict[str, int] = {}
        for op, name in enumerate(OPERATIONS):
            base = op * _SLOTS
            for i in range(_SLOTS - 1):
                out[bucket_name(name, i)] = totals[base + i] if totals else 0
            out[sum_name(name)] = totals[base + _SLOTS - 1] if totals else 0
        return out

    def _new_array(self) -> list[int]:
        # A thread's array outlives it (its counts stay in the totals); threads that call a
        # store are an engine's pools, few and long-lived.
        counts = [0] * (_SLOTS * len(OPERATIONS))
        with self._lock:
            self._arrays.append(counts)
        return counts


def usage_of(counters: Mapping[str, int]) -> dict[str, int]:
    """The report's key counts from a store's counters (see
    :mod:`~kvfabric._client.counter_names`)."""
    get_failures = counters["get_failures"]
    put = {
        "put_stored": counters["stored"],
        "put_deduplicated": counters["dedup_hits"],
        "put_in_flight": counters["in_flight_skips"],
        "put_no_space": counters["no_space"],
        "put_failures": counters["put_failures"],
    }
    usage = {
        "lookup_keys": counters["lookup_keys"] + counters["exists_keys"],
        "lookup_hits": counters["prefix_hits"] + counters["exists_hits"],
        "get_keys": counters["get_hits"] + counters["get_misses"],
        "get_hits": counters["get_hits"],
        "get_misses": counters["get_misses"] - get_failures,
        "get_failures": get_failures,
        "put_keys": sum(put.values()),
        **put,
        "bytes_read": counters["payload_bytes_read"],
        "bytes_written": counters["payload_bytes_written"],
    }
    assert usage.keys() == set(USAGE_COUNTERS)
    return usage


class UsageReporter:
    """Sends a store's usage deltas to its controller every ``interval`` seconds."""

    def __init__(
        self,
        send: Callable[[dict[str, int]], bool],
        counters: Counters,
        times: CallTimes,
        *,
        interval: float,
    ) -> None:
        """``send`` delivers one report: True if delivered, False if the controller takes
        none (it predates reports: reporting stops); raises :class:`KvfabricError` if it
        failed. ``interval`` 0 reports only when asked (:meth:`report`)."""
        self._send = send
        self._counters = counters
        self._times = times
        self._interval = interval
        self._lock = threading.Lock()
        self._sent = dict.fromkeys(self._totals(), 0)
        self._refused = False
        self._last_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0:
            self._thread = threading.Thread(target=self._run, name="kvfabric-usage", daemon=True)
            self._thread.start()

    def report(self) -> None:
        """Send what was counted since the last report, now, on the caller's thread; a
        failed report is dropped."""
        with self._lock:
            if self._refused:
                return
            totals = self._totals()
            delta = {name: value - self._sent[name] for name, value in totals.items()}
            # Dropped if it fails: a report that timed out may still have been added.
            self._sent = totals
            if not any(delta.values()):
                return
            try:
                self._refused = not self._send(delta)
            except KvfabricError as exc:
                self._last_failed = True
                self._counters.add("usage_reports_dropped")
                log.debug("kvfabric: usage report dropped: %s", exc)
                return
            self._last_failed = False
            self._counters.add("usage_reports")

    def close(self) -> None:
        """Stop the thread and send what is left, unless the last report failed (the
        controller is likely gone: closing must not wait for it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._last_failed:
            self.report()

    def _totals(self) -> dict[str, int]:
        return {**usage_of(self._counters.snapshot()), **self._times.snapshot()}

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.report()
