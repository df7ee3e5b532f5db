"""What the peer scripts share: arguments, timing, a busy Python thread, and the row format.

The peer scripts run under the peers' own interpreter (a separate virtual environment that
holds Mooncake Store or InfiniStore, never kvfabric), inside a private network namespace
that ``kvfabric bench`` made for them. They measure the workload kvfabric's rows measure, the
same way (kvfabric._tools.bench_measure, which they cannot import), and print one line per
row: ``ROW_MARKER`` and the row as JSON. A peer that cannot run prints ``UNAVAILABLE_MARKER``
and why, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROW_MARKER = "KVFABRIC_BENCH_ROW "
UNAVAILABLE_MARKER = "KVFABRIC_BENCH_UNAVAILABLE "
# The phase names kvfabric's report looks for (kvfabric._tools.bench_measure).
PUT_FRESH = "put fresh"
GET = "get"
CONTAINS = "contains"
READS_ALONE = "reads alone"
READS_BUSY = "reads beside busy"
LOOKUP_SAMPLES = 300
GET_SAMPLES = 9  # as kvfabric bench's (kvfabric._tools.bench_measure.GET_SAMPLES)
WARM_UP_BYTES = 8 << 20  # each system's first write, untimed (bench_measure.WARM_UP_BYTES)


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="262144,4194304", help="chunk sizes in bytes")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy-seconds", type=float, default=1.0)
    parser.add_argument("--capacity", type=int, default=2 << 30, help="server memory, bytes")
    args = parser.parse_args()
    args.sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    return args


def unavailable(reason: str) -> None:
    print(UNAVAILABLE_MARKER + reason, flush=True)
    sys.exit(0)


def emit(
    system: str,
    phase: str,
    size: int,
    count: int,
    seconds: float,
    note: str = "",
    kept: float | None = None,
) -> None:
    row: dict[str, Any] = {
        "system": system,
        "phase": phase,
        "size": size,
        "count": count,
        "seconds": seconds,
        "note": note,
        "kept": kept,
    }
    print(ROW_MARKER + json.dumps(row), flush=True)


def median_seconds(
    fn: Callable[[], object],
    repeat: int,
    setup: Callable[[], object] | None = None,
    *,
    warm_up: bool = True,
) -> float:
    samples = []
    for n in range(repeat + int(warm_up)):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if n or not warm_up:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


class Busy:
    """A pure-Python counting loop on its own thread."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> Busy:
        self._thread.start()
        while self.count == 0:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def _loop(fn: Callable[[], object], seconds: float) -> float:
    calls = 0
    started = time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 2:
            return elapsed / calls


def beside_busy(fn: Callable[[], object], seconds: float) -> tuple[float, float, float]:
    """Seconds per call alone, beside a busy thread, and the share of its rate it kept."""
    fn()
    alone = _loop(fn, seconds)
    with Busy() as busy:
        start, t0 = busy.count, time.perf_counter()
        time.sleep(min(seconds, 0.3))
        idle = (busy.count - start) / (time.perf_counter() - t0)
    with Busy() as busy:
        start, t0 = busy.count, time.perf_counter()
        beside = _loop(fn, seconds)
        kept = (busy.count - start) / (time.perf_counter() - t0) / idle
    return alone, beside, kept
