"""How ``kvfabric bench`` times every system: phase names, sample counts, medians, and loops
alone and beside a busy pure-Python thread or process.

Standard library only: the peer scripts (``benchmarks/peers``) run under the peers' own
interpreter, which has no kvfabric, and load this file by its path, so Mooncake Store and
InfiniStore are timed by the very code that times kvfabric.

:class:`BusyThread` stands in for an engine's scheduler or event loop: each time kvfabric takes
the GIL back while it counts, kvfabric waits out about one switch interval, so what a batch
costs beside it shows how often the batch needs the GIL. :class:`BusyProcess` runs the same
loop in a process of its own: the CPU it takes, without the GIL. What a batch loses beside it
is CPU contention alone, so beside the thread against beside the process is the GIL's share.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "GET_SAMPLES",
    "LOOKUP_SAMPLES",
    "ROW_MARKER",
    "UNAVAILABLE_MARKER",
    "WARM_UP_BYTES",
    "BusyProcess",
    "BusyThread",
    "Phase",
    "beside_busy",
    "beside_busy_process",
    "median_seconds",
]


class Phase:
    """The phase names rows carry, so the report finds what the measuring code wrote."""

    COPY = "copy"
    STREAM = "stream"
    RTT = "small RTT"
    PUT_FRESH = "put fresh"  # into memory no put wrote before (a server just started)
    PUT_WARM = "put warm"  # into slots written before
    RE_PUT = "re-put"  # the same keys again: kvfabric and Redis only
    GET = "get"
    CONTAINS = "contains"  # count = keys per call
    READS_ALONE = "reads alone"  # contains + get of one batch, in a loop
    READS_BUSY = "reads beside busy"  # the same beside a busy pure-Python thread
    # The same beside that loop in a process of its own: CPU contention without the GIL.
    READS_BUSY_PROCESS = "reads beside busy process"
    CONTROLLER_CPU = "controller cpu"  # seconds of controller CPU per lookup of count keys


# A peer script prints each row as this marker and the row as JSON, or this one and why it
# cannot run.
ROW_MARKER = "KVFABRIC_BENCH_ROW "
UNAVAILABLE_MARKER = "KVFABRIC_BENCH_UNAVAILABLE "

WARM_UP_BYTES = 8 << 20
"""What each system writes before anything is timed: enough to open every connection a large
put uses (kvfabric tcp's write lanes)."""

GET_SAMPLES = 9
"""Every system's get is the median of at least this many: a read repeats at no cost, and the
get / memcpy ratio divides by a floor of as many samples, so one preemption does not move
it."""

LOOKUP_SAMPLES = 300
"""Lookups are short: every system's is the median of at least this many calls."""


def median_seconds(
    fn: Callable[[], object],
    repeat: int,
    setup: Callable[[], object] | None = None,
    *,
    warm_up: bool = True,
) -> float:
    """The median time of ``repeat`` calls of ``fn`` (``setup`` before each, untimed).

    ``warm_up`` adds one untimed first call (caches, connections, page tables); phases that
    must see untouched memory turn it off.
    """
    samples = []
    for n in range(repeat + int(warm_up)):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if n or not warm_up:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _loop(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``fn``, called in a loop for about ``seconds`` (at least twice)."""
    calls = 0
    started = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 2:
            return elapsed / calls


def beside_busy(fn: Callable[[], object], seconds: float) -> tuple[float, float, float]:
    """``fn`` in a loop alone, then beside a busy thread (:class:`BusyThread`): (seconds
    per call alone, beside it, and the share of its idle counting rate the thread kept)."""
    fn()  # warm up
    alone = _loop(fn, seconds)
    with BusyThread() as busy:
        start, t0 = busy.count, time.perf_counter()
        time.sleep(min(seconds, 0.3))
        idle = (busy.count - start) / (time.perf_counter() - t0)
    with BusyThread() as busy:
        start, t0 = busy.count, time.perf_counter()
        beside = _loop(fn, seconds)
        kept = (busy.count - start) / (time.perf_counter() - t0) / idle
    return alone, beside, kept


def beside_busy_process(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``fn`` in a loop beside a busy process (:class:`BusyProcess`)."""
    with BusyProcess():
        return _loop(fn, seconds)


class BusyThread:
    """A counting loop on its own thread, for the span of a ``with`` block; ``count`` says
    how far it got."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvfabric-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        while self.count == 0:  # running before the caller measures anything
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


class BusyProcess:
    """The same counting loop in a process of its own, for the span of a ``with`` block."""

    def __enter__(self) -> BusyProcess:
        self._child = subprocess.Popen(
            [sys.executable, "-c", "print(flush=True)\nn = 0\nwhile True:\n    n += 1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._child.stdout is not None
        self._child.stdout.readline()  # running before the caller measures anything
        return self

    def __exit__(self, *exc: object) -> None:
        self._child.kill()
        self._child.wait()
        if self._child.stdout is not None:
            self._child.stdout.close()
