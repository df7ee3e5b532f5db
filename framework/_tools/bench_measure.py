"""What every part of ``kvfabric bench`` measures with: the row it reports, medians, and a busy
pure-Python thread to read beside.

A row is one phase of one system at one chunk size: the median seconds of one batch (or, for
lookups, of one call; for controller CPU, the CPU seconds per lookup). Phases are named by
the constants here so the report finds what the measuring code wrote.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvfabric._tools.busy import BusyProcess, BusyThread

__all__ = [
    "CONTAINS",
    "CONTROLLER_CPU",
    "COPY",
    "GET",
    "GET_SAMPLES",
    "PUT_FRESH",
    "PUT_WARM",
    "READS_ALONE",
    "READS_BUSY",
    "READS_BUSY_PROCESS",
    "RE_PUT",
    "RTT",
    "STREAM",
    "WARM_UP_BYTES",
    "BenchRow",
    "beside_busy",
    "beside_busy_process",
    "median_seconds",
]

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


@attrs.frozen(kw_only=True)
class BenchRow:
    """One measurement: ``seconds`` is the median time of one batch of ``count`` chunks of
    ``size`` bytes (lookups: of one call of ``count`` keys)."""

    system: str
    phase: str
    size: int
    count: int
    seconds: float
    note: str = ""
    # Reads beside a busy thread: the share of its idle counting rate that thread kept.
    kept: float | None = None
    # Reads alone: the CPU they kept busy, in cores (this process and the servers it read
    # from together), and the CPUs this host lets them use.
    cores: float | None = None
    cpus: int | None = None

    @property
    def room(self) -> float | None:
        """Reads alone: the share of their rate a host of ``cpus`` CPUs can leave them beside
        a loop that takes one CPU, if each core's worth of work needs a core
        (``min(1, (cpus - 1) / cores)``): where it is below a goal, the host sets the ratio."""
        if self.cores is None or self.cpus is None or self.cores <= 0:
            return None
        return min(1.0, (self.cpus - 1) / self.cores)

    @property
    def gbps(self) -> float:
        return self.size * self.count / self.seconds / 1e9

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchRow:
        return cls(
            system=str(data["system"]),
            phase=str(data["phase"]),
            size=int(data["size"]),
            count=int(data["count"]),
            seconds=float(data["seconds"]),
            note=str(data.get("note") or ""),
            kept=None if data.get("kept") is None else float(data["kept"]),
            cores=None if data.get("cores") is None else float(data["cores"]),
            cpus=None if data.get("cpus") is None else int(data["cpus"]),
        )


WARM_UP_BYTES = 8 << 20
"""What each system writes before anything is timed (as ``benchmarks/peers``' scripts do):
enough to open every connection a large put uses (kvfabric tcp's write lanes)."""

GET_SAMPLES = 9
"""Every system's get is the median of at least this many (a read repeats at no cost, and the
get / memcpy ratio divides by a floor of as many samples): at 3, one preemption on this
2-core machine moved kvfabric shm's get / memcpy from 0.82 to 0.74 between runs."""


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
