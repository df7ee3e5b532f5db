"""Puts through leased extents against puts that allocate per key, in one process tree.

    python benchmarks/put_path_bench.py [--transport tcp] [--value-kib 256] [--puts 60]

Starts a controller and one data node (real processes, as ``kvfabric bench`` starts them)
and connects two clients from this process: one writing through extents (the default: a
put is one control round trip, the publish) and one with ``?extents=0`` (allocate, then
publish). They put batches of 64 fresh values in turn, so load from elsewhere on the
machine hits both alike; the table prints each path's median and the median of the
allocate/extents ratio over adjacent pairs, with the control round trips each path took.
``kvfabric bench`` measures the same put against the peers and the floors.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kvfabric
from kvfabric import PutOutcome
from kvfabric._tools.bench_kvfabric import _cluster, _keys, _values
from kvfabric._tools.bench_timing import WARM_UP_BYTES

_BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm", "ucx"])
    parser.add_argument("--value-kib", type=int, default=256)
    parser.add_argument("--puts", type=int, default=60, help="puts per path")
    parser.add_argument("--capacity-gib", type=int, default=8)
    args = parser.parse_args()
    size = args.value_kib << 10
    values = _values(_BATCH, size)
    transport = args.transport
    with _cluster(transport, args.capacity_gib << 30, {}) as cluster:
        url = cluster.url(transport=transport, timeout="60s")
        with (
            kvfabric.connect(url + "&extents=1") as extents,
            kvfabric.connect(url + "&extents=0") as allocating,
        ):
            stores = {"extents": extents, "allocate": allocating}
            for store in stores.values():
                half = WARM_UP_BYTES // 2
                store.batched_put(_keys(2), [np.ones(half, dtype=np.uint8) for _ in range(2)])
            rpcs_before = {name: s.stats()["control_rpcs"] for name, s in stores.items()}
            seconds: dict[str, list[float]] = {name: [] for name in stores}
            for _ in range(args.puts):
                for name, store in stores.items():
                    keys = _keys(_BATCH)
                    started = time.perf_counter()
                    outcomes = store.batched_put(keys, values)
                    seconds[name].append(time.perf_counter() - started)
                    if outcomes != [PutOutcome.STORED] * _BATCH:
                        raise RuntimeError(f"{name}: a put was not stored: {set(outcomes)}")
            rpcs = {
                name: s.stats()["control_rpcs"] - rpcs_before[name] for name, s in stores.items()
            }
    print(f"{_BATCH} x {args.value_kib} KiB over {transport}, {args.puts} puts per path")
    for name, taken in seconds.items():
        median = statistics.median(taken)
        print(
            f"  {name:9s} {median * 1e3:7.2f} ms  {_BATCH * size / median / 1e9:5.2f} GB/s"
            f"  control round trips per put {rpcs[name] / args.puts:.2f}"
        )
    ratios = sorted(a / e for e, a in zip(seconds["extents"], seconds["allocate"], strict=True))
    quarter = len(ratios) // 4
    print(
        f"  allocate / extents, adjacent pairs: median {ratios[len(ratios) // 2]:.2f}"
        f" (quartiles {ratios[quarter]:.2f}-{ratios[-quarter - 1]:.2f})"
    )


if __name__ == "__main__":
    main()
