"""Lookups right after a put against lookups in a steady state, per transport.

    python benchmarks/lookup_after_put_bench.py [--keys 64] [--rounds 200] [--transports tcp,shm]

Starts a controller and one data node (real processes), then, per transport, a client that
loops: put ``--keys`` new keys (4 KiB values), then ``batched_contains`` of those keys at once
("after put": what an engine's next request sees once the previous one stored its blocks),
then the same lookup again ("steady": nothing written since). The cycle is the one a
KV-cache tier's peers are measured on (put, then contains). Prints the medians of each and
their ratio, and the lookup's data-plane round trips per call from the client's counters
(`image_round_trips`), so where the extra time goes is counted, not guessed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import kvfabric
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.keys import chain_keys


def _cycle(store: kvfabric.Store, keys: int, rounds: int) -> tuple[list[float], list[float], float]:
    after: list[float] = []
    steady: list[float] = []
    value = os.urandom(4096)
    trips_before = store.stats().get("image_round_trips", 0)
    for r in range(rounds):
        batch = chain_keys(list(range(keys)), 1, namespace=uuid.uuid4().bytes)
        store.batched_put(batch, [value] * keys)
        started = time.perf_counter()
        hits = store.batched_contains(batch)
        after.append(time.perf_counter() - started)
        started = time.perf_counter()
        again = store.batched_contains(batch)
        steady.append(time.perf_counter() - started)
        assert hits == again == keys, (r, hits, again)
    trips = (store.stats().get("image_round_trips", 0) - trips_before) / (2 * rounds)
    return after, steady, trips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--transports", default="tcp,shm")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    print(f"{'transport':<10} {'after put':>12} {'steady':>12} {'ratio':>7} {'image reads':>12}")
    with LocalCluster(nodes=1, transports=transports, capacity="1GiB") as cluster:
        for transport in transports:
            with kvfabric.connect(cluster.url(transport=transport)) as store:
                _cycle(store, args.keys, 10)  # warm-up: connections, mappings, the mirror
                after, steady, trips = _cycle(store, args.keys, args.rounds)
            a, s = statistics.median(after), statistics.median(steady)
            print(
                f"{transport:<10} {a * 1e6:>10.1f}us {s * 1e6:>10.1f}us {a / s:>7.2f} "
                f"{trips:>12.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
