"""Reads and puts beside one busy pure-Python thread, over real controller and node processes.

    python benchmarks/busy_thread_bench.py [--transports shm,tcp,ucx] [--count 64]
        [--size 4MiB] [--seconds 3] [--rounds 3] [--switch-interval-ms 5]

Per transport, a controller and one data node (``LocalCluster``: the same processes an
operator runs) and a client in this process. Each phase
runs in a loop for ``--seconds`` alone, then beside a thread running a pure-Python counting
loop (an engine's scheduler or event loop, standing in), then beside the same loop in a
process of its own (the CPU it takes, without the GIL):

- ``contains+get``: ``batched_contains`` then ``batched_get(into=...)`` of ``count`` values of
  ``size`` bytes (one control round trip, then the data path);
- ``get``: ``batched_get(into=...)`` with the descriptors already known (``remember``): the
  data path alone;
- ``put warm``: ``batched_put`` of new keys into slots written before (the node's memory was
  filled once first; the previous batch is deleted, untimed, so its slots come back);
- ``put fresh``: ``batched_put`` into slots never written, on a node started for it (one per
  side and round), from a client connected after it started.

Rounds run every phase in turn and medians are printed: GB/s alone, beside the thread and
beside the process; ``thread/alone`` (what an engine sees) and ``thread/process`` (the GIL's
share of it: on a machine with fewer idle cores than the threads need, CPU contention lowers
both "beside" columns alike); the share of its idle counting rate the busy thread kept; the
GIL returns per batch kvfabric's native module counted in the calling thread (returns by
other libraries — ctypes, pyzmq, the crc32c package — are not in that count); and the GIL
waits per batch the thread costs beyond the process, (time per batch beside the thread -
beside the process) / switch interval, since each return beside a busy thread waits out
about one switch interval. ``ucx`` runs with ``UCX_TLS=sm`` (``ucx-tcp``: ``UCX_TLS=tcp``)
where UCX is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from gil_bench import BusyProcess

import kvfabric
from kvfabric import PutOutcome, Store, chain_keys
from kvfabric._plugins import plugin_manager
from kvfabric._runtime import native
from kvfabric._tools.bench_kvfabric import scoped_environ
from kvfabric._tools.bench_timing import BusyThread
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.errors import PluginError
from kvfabric.spi import parse_size

# Per transport spec: the transport's name and the environment its node and client need.
_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "shm": ("shm", {}),
    "tcp": ("tcp", {}),
    "ucx": ("ucx", {"UCX_TLS": "sm"}),
    "ucx-tcp": ("ucx", {"UCX_TLS": "tcp"}),
}
_SIDES = ("alone", "thread", "process")
# Puts on a fresh node: this many batches per node (one node per side and round).
_FRESH_SAMPLES = 2

Values = list[np.ndarray[Any, Any]]


@contextlib.contextmanager
def _beside(side: str) -> Iterator[BusyThread | None]:
    """Nothing, a busy thread, or a busy process, for the length of the block."""
    if side == "thread":
        with BusyThread() as busy:
            yield busy
    elif side == "process":
        with BusyProcess():
            yield None
    else:
        yield None


class Phase:
    """One phase's samples: seconds per batch per side, what the thread kept, GIL returns."""

    def __init__(self, name: str, batch_bytes: int) -> None:
        self.name = name
        self.batch_bytes = batch_bytes
        self.seconds: dict[str, list[float]] = {side: [] for side in _SIDES}
        self.kept: list[float] = []
        self.gil: list[int] = []
        self.not_stored = 0
        """Records a put did not store (a busy machine can hold a writer past its lease)."""

    def row(self, interval: float) -> str:
        per = {side: statistics.median(v) for side, v in self.seconds.items()}
        gbps = {side: self.batch_bytes / s / 1e9 for side, s in per.items()}
        waits = max(0.0, (per["thread"] - per["process"]) / interval)
        cells = (
            gbps["alone"],
            gbps["thread"],
            gbps["process"],
            gbps["thread"] / gbps["alone"],
            gbps["thread"] / gbps["process"],
            statistics.median(self.kept),
        )
        note = f"  ({self.not_stored} records not stored)" if self.not_stored else ""
        return (
            f"{self.name:14}"
            + "".join(f"{c:9.2f}" for c in cells)
            + f"{statistics.median(self.gil):8.0f}{waits:8.1f}{note}"
        )


def _timed(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds one call took, and the native module's GIL returns in this thread."""
    before = native.gil_reacquisitions()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started, native.gil_reacquisitions() - before


def _idle_rate(seconds: float = 0.3) -> float:
    with BusyThread() as busy:
        start, t0 = busy.count, time.perf_counter()
        time.sleep(seconds)
        return (busy.count - start) / (time.perf_counter() - t0)


def _sample(
    phase: Phase,
    fn: Callable[[], object],
    seconds: float,
    idle: float,
    between: Callable[[], object] | None = None,
) -> None:
    """``fn`` in a loop for about ``seconds`` on each side (``between`` before each, untimed)."""
    for side in _SIDES:
        times: list[float] = []
        returns: list[int] = []
        with _beside(side) as busy:
            start = busy.count if busy else 0
            t0 = time.perf_counter()
            while sum(times) < seconds or not times:
                if between is not None:
                    between()
                took, gil = _timed(fn)
                times.append(took)
                returns.append(gil)
            if busy is not None:
                phase.kept.append((busy.count - start) / (time.perf_counter() - t0) / idle)
        phase.seconds[side].append(statistics.median(times))
        if side == "alone":
            phase.gil.append(int(statistics.median(returns)))


def _keys(count: int) -> list[bytes]:
    return chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)


@contextlib.contextmanager
def _store(transport: str, env: dict[str, str], capacity: int) -> Iterator[Store]:
    with (
        scoped_environ(env),
        LocalCluster(
            nodes=1,
            transports=(transport,),
            capacity=str(capacity),
            controller_args=["--grace", "0s"],
            env=env,
        ) as cluster,
        kvfabric.connect(cluster.url(transport=transport, timeout="60s")) as store,
    ):
        yield store


def _warm_phases(
    store: Store, phases: dict[str, Phase], values: Values, seconds: float, idle: float
) -> None:
    count = len(values)
    dests = [np.ones(v.nbytes, dtype=np.uint8) for v in values]  # touched: no faults here
    keys = _keys(count)
    store.batched_put(keys, values)
    descriptors = [d for d in store.locate(keys) if d is not None]
    assert len(descriptors) == count, "the read set was not stored"

    def contains_get() -> None:
        assert store.batched_contains(keys) == count
        got = store.batched_get(keys, into=dests)
        assert all(g is not None for g in got)

    def get() -> None:
        store.remember(descriptors)
        got = store.batched_get(keys, into=dests)
        assert all(g is not None for g in got)

    _sample(phases["contains+get"], contains_get, seconds, idle)
    _sample(phases["get"], get, seconds, idle)
    written: list[list[bytes]] = []

    def next_keys() -> None:
        if written:
            store.delete(written[-1])
        written.append(_keys(count))

    def put() -> None:
        outcomes = store.batched_put(written[-1], values)
        phases["put warm"].not_stored += sum(o is not PutOutcome.STORED for o in outcomes)

    _sample(phases["put warm"], put, seconds, idle, next_keys)
    store.delete(written[-1])
    if store.stats()["validation_failures"]:
        raise RuntimeError("validation failures during the benchmark")


def _fresh_puts(
    transport: str, env: dict[str, str], phase: Phase, values: Values, idle: float
) -> None:
    """Puts into never-written slots: a node per side, with room for every sample."""
    batch = phase.batch_bytes
    for side in _SIDES:
        with _store(transport, env, (_FRESH_SAMPLES + 1) * batch + (64 << 20)) as store:
            # One small put first: the control connection and the routes are then warm, and
            # the samples time only the data's first landing.
            store.batched_put(_keys(1), [values[0][:4096]])
            times: list[float] = []
            returns: list[int] = []
            with _beside(side) as busy:
                start, t0 = (busy.count if busy else 0), time.perf_counter()
                for _ in range(_FRESH_SAMPLES):
                    keys = _keys(len(values))
                    outcomes: list[PutOutcome] = []
                    took, gil = _timed(
                        lambda k=keys, out=outcomes: out.extend(store.batched_put(k, values))
                    )
                    times.append(took)
                    returns.append(gil)
                    phase.not_stored += sum(o is not PutOutcome.STORED for o in outcomes)
                if busy is not None:
                    phase.kept.append((busy.count - start) / (time.perf_counter() - t0) / idle)
            phase.seconds[side].append(statistics.median(times))
            if side == "alone":
                phase.gil.append(int(statistics.median(returns)))


def _available(spec: str) -> bool:
    name, _ = _SPECS[spec]
    try:
        plugin_manager().transport(name)
    except PluginError:
        return False
    return True


def run(spec: str, count: int, size: int, seconds: float, rounds: int) -> list[Phase]:
    transport, env = _SPECS[spec]
    batch = count * size
    values = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]
    names = ("contains+get", "get", "put warm", "put fresh")
    phases = {name: Phase(name, batch) for name in names}
    capacity = 4 * batch + (64 << 20)
    with _store(transport, env, capacity) as store:
        # Every slot written once (the oldest records are evicted as the node fills).
        for _ in range(capacity // batch + 2):
            store.batched_put(_keys(count), values)
        for _ in range(rounds):
            idle = _idle_rate()
            _warm_phases(store, phases, values, seconds, idle)
            _fresh_puts(transport, env, phases["put fresh"], values, idle)
    return list(phases.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="shm,tcp,ucx")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--seconds", type=float, default=3.0, help="per phase, side and round")
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    parser.add_argument("--switch-interval-ms", type=float, default=None)
    args = parser.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    interval = sys.getswitchinterval()
    specs = [s.strip() for s in args.transports.split(",") if s.strip()]
    unknown = [s for s in specs if s not in _SPECS]
    if unknown:
        parser.error(f"unknown transports {unknown}; choose from {sorted(_SPECS)}")
    print(
        f"batch: {args.count} x {args.size >> 10} KiB; {args.seconds:g} s per phase, side and "
        f"round; medians of {args.rounds} rounds; switch interval {interval * 1e3:g} ms; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    heads = ("alone", "thread", "process", "thread/", "thread/", "busy", "GIL", "GIL")
    subs = ("GB/s", "GB/s", "GB/s", "alone", "process", "kept", "counted", "waits")
    widths = (9, 9, 9, 9, 9, 9, 8, 8)
    for spec in specs:
        if not _available(spec):
            print(f"\n{spec}: not installed, skipped", flush=True)
            continue
        phases = run(spec, args.count, args.size, args.seconds, args.rounds)
        env = _SPECS[spec][1]
        print(f"\n{spec}" + (f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else ""))
        print(f"{'phase':14}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True)))
        print(f"{'':14}" + "".join(f"{h:>{w}}" for h, w in zip(subs, widths, strict=True)))
        for phase in phases:
            print(phase.row(interval), flush=True)


if __name__ == "__main__":
    main()
