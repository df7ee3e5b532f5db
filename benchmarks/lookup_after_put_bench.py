"""Lookups right after a put against lookups in a steady state, per transport.

    python benchmarks/lookup_after_put_bench.py [--keys 64] [--rounds 200]
        [--transports tcp,shm,ucx,rpc]

Starts a controller and one data node (real processes; the controller serves its lookup image
on every transport measured), then, per transport, a client that loops: put ``--keys`` new
keys (4 KiB values), then ``batched_contains`` of those keys at once ("after put": what an
engine's next request sees once the previous one stored its blocks), then the same lookup
again at once ("steady": back to back, nothing written since), then once more after an idle
gap as long as the put took ("paused": nothing written, but every process had as long to
fall asleep as it had during the put). ``rpc`` is a tcp client with ``?lookup_image=0``:
every lookup a control RPC.

Prints the medians of each, the ratio of "after put" to "paused" and to "steady", and what
each lookup cost as counted by the client (`image_round_trips`, `control_rpcs` per lookup,
read around each lookup in a pass of 20 rounds apart from the timed one; the put's own image
read left out), so where extra time goes is counted, not guessed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

import kvfabric
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.keys import chain_keys

_KINDS = ("after", "steady", "paused")


class _Sample:
    """One kind of lookup's times and counted costs."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.reads = 0
        self.rpcs = 0
        self.counted = 0


def _cycle(store: kvfabric.Store, keys: int, rounds: int, *, count: bool) -> dict[str, _Sample]:
    """``count``: read the client's counters around each lookup (between them, so the
    lookups are no longer back to back: a pass apart from the timed one)."""
    samples = {kind: _Sample() for kind in _KINDS}
    value = os.urandom(4096)

    def lookup(kind: str, batch: list[bytes]) -> None:
        before = store.stats() if count else {}
        started = time.perf_counter()
        hits = store.batched_contains(batch)
        took = time.perf_counter() - started
        assert hits == keys, (kind, hits)
        sample = samples[kind]
        sample.times.append(took)
        if count:
            after = store.stats()
            sample.reads += after.get("image_round_trips", 0) - before.get("image_round_trips", 0)
            sample.rpcs += after["control_rpcs"] - before["control_rpcs"]
            sample.counted += 1

    for _ in range(rounds):
        batch = chain_keys(list(range(keys)), 1, namespace=uuid.uuid4().bytes)
        started = time.perf_counter()
        store.batched_put(batch, [value] * keys)
        put = time.perf_counter() - started
        lookup("after", batch)
        lookup("steady", batch)
        time.sleep(put)
        lookup("paused", batch)
    return samples


def _url(cluster: LocalCluster, transport: str) -> str:
    if transport == "rpc":
        return cluster.url(transport="tcp", lookup_image="0")
    return cluster.url(transport=transport)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--transports", default="tcp,shm,rpc")
    args = parser.parse_args(argv)
    rows = [t for t in args.transports.split(",") if t]
    transports = sorted({"tcp" if t == "rpc" else t for t in rows})
    median: Callable[[_Sample], float] = lambda s: statistics.median(s.times)  # noqa: E731
    print(
        f"{'transport':<10} {'after put':>10} {'steady':>10} {'paused':>10} "
        f"{'/paused':>8} {'/steady':>8} {'reads after':>12} {'reads steady':>13} "
        f"{'rpcs after':>11}"
    )
    with LocalCluster(
        nodes=1,
        transports=transports,
        capacity="1GiB",
        controller_args=["--transport", ",".join(transports)],
    ) as cluster:
        for row in rows:
            with kvfabric.connect(_url(cluster, row)) as store:
                # Warm-up (connections, mappings, the mirror), then what each lookup costs,
                # then the timed pass.
                _cycle(store, args.keys, 10, count=False)
                counted = _cycle(store, args.keys, 20, count=True)
                samples = _cycle(store, args.keys, args.rounds, count=False)
            a, s, p = (median(samples[kind]) for kind in _KINDS)
            after, steady = counted["after"], counted["steady"]
            print(
                f"{row:<10} {a * 1e6:>8.1f}us {s * 1e6:>8.1f}us {p * 1e6:>8.1f}us "
                f"{a / p:>8.2f} {a / s:>8.2f} {after.reads / after.counted:>12.2f} "
                f"{steady.reads / steady.counted:>13.2f} {after.rpcs / after.counted:>11.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
