"""Embedded-store reads against a plain memcpy of the same bytes, in one process.

    python benchmarks/embedded_bench.py [--repeat 5]

For 64 chunks of 256 KiB and of 4 MiB: a memcpy floor (numpy copy from a source as large as
the stored data into the same destination buffers), CRC32C alone, and kvfabric's
contains+get (one control call, shm copy, validation) into fresh buffers and into the
caller's buffers. Prints medians, GB/s and the ratio to memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np

import kvfabric
from kvfabric._runtime.record import checksum
from kvfabric.keys import chain_keys


def _median(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up (page faults, caches)
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run(count: int, size: int, repeat: int) -> list[tuple[str, float, float]]:
    total = count * size
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
    dests = [np.empty(size, dtype=np.uint8) for _ in range(count)]
    keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
    rows: list[tuple[str, float, float]] = []

    def memcpy() -> None:
        for src, dst in zip(values, dests, strict=True):
            np.copyto(dst, src)

    def crc() -> None:
        for v in values:
            checksum(v)

    with kvfabric.connect(f"embedded://?capacity={2 * total + (64 << 20)}") as store:
        store.batched_put(keys, values)

        def get_fresh() -> None:
            store.batched_contains(keys)
            got = store.batched_get(keys)
            assert all(g is not None for g in got)

        def get_into() -> None:
            store.batched_contains(keys)
            got = store.batched_get(keys, into=dests)
            assert all(g is not None for g in got)

        floor = _median(memcpy, repeat)
        for name, fn in [
            ("memcpy (floor)", memcpy),
            ("crc32c only", crc),
            ("kvfabric contains+get, fresh buffers", get_fresh),
            ("kvfabric contains+get, into caller buffers", get_into),
        ]:
            seconds = floor if fn is memcpy else _median(fn, repeat)
            rows.append((name, seconds, floor / seconds))
        stats = store.stats()
        assert stats["validation_failures"] == 0
    print(f"\n{count} x {size // 1024} KiB ({total / 2**20:.0f} MiB), median of {repeat}")
    print(f"{'path':<44} {'median ms':>10} {'GB/s':>8} {'x memcpy':>9}")
    for name, seconds, ratio in rows:
        print(f"{name:<44} {seconds * 1e3:>10.2f} {total / seconds / 1e9:>8.2f} {ratio:>9.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for size in (256 * 1024, 4 << 20):
        run(64, size, args.repeat)


if __name__ == "__main__":
    main()
