"""The redis index against the memory index and raw Redis: ``python benchmarks/index_bench.py``.

Starts its own ``redis-server`` processes on 127.0.0.1 (one server, and a cluster of 3 masters,
``--replicas`` replicas each), registers one data node of ``--arenas`` regions (one arena
each, spread over the masters), stores ``--keys`` keys, then measures from one client thread:

* lookup latency (``lookup_prefix``, all keys hit) against the number of keys per call, beside
  the same number of keys read with one pipelined ``MGET`` on the single server (what any
  Redis client pays for one round trip) and the in-process memory index;
* put throughput (allocate + publish of fresh keys, 16 per call) and re-put latency;
* how evenly the keys and the lookups' round trips spread over the cluster's masters.

Needs redis-server on PATH and redis-py (``pip install 'kvfabric[redis]'``). Timings are
medians over ``--repeat`` calls; on a busy machine they move, the ratios less.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable, Sequence

from kvfabric._tools.redis_cluster import RedisDeployment
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
)

_VALUE = 1000
_SIZES = (1, 8, 64, 256, 1024)


def _median_us(call: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


def _populate(index: IndexPlugin, keys: Sequence[bytes], arenas: int) -> None:
    index.register_node(
        NodeInfo(
            name="bench",
            regions=tuple(RegionInfo(id=i, size=64 << 20, rkey=7 + i) for i in range(arenas)),
            endpoints=(),
        )
    )
    for start in range(0, len(keys), 256):
        _put(index, keys[start : start + 256])


def _put(index: IndexPlugin, keys: Sequence[bytes]) -> None:
    result = index.allocate([AllocationRequest(key=k, length=_VALUE) for k in keys])
    grants = [
        GrantRef.of(a.descriptor, crc=1)
        for a in result.allocations
        if a.kind is AllocationKind.GRANTED and a.descriptor is not None
    ]
    index.publish(grants)


def _measure(
    name: str, index: IndexPlugin, keys: Sequence[bytes], repeat: int, rows: list[list[str]]
) -> dict[int, float]:
    lookups: dict[int, float] = {}
    for n in _SIZES:
        batch = list(keys[:n])
        assert len(index.lookup_prefix(batch)) == n
        lookups[n] = _median_us(
            lambda b=batch: index.lookup_prefix(b), max(5, int(repeat / n**0.5))
        )
    fresh = [fold_key(i, uuid.uuid4().bytes) for i in range(16 * repeat)]
    batches = [fresh[i : i + 16] for i in range(0, len(fresh), 16)]
    started = time.perf_counter()
    for batch in batches:
        _put(index, batch)
    put_s = time.perf_counter() - started
    reput = _median_us(
        lambda: index.allocate([AllocationRequest(key=k, length=_VALUE) for k in keys[:16]]),
        repeat,
    )
    for n, us in lookups.items():
        rows.append([name, f"lookup x{n}", f"{us:9.1f}", f"{n / us * 1e6:12,.0f}"])
    rows.append(
        [name, "put x16", f"{put_s / len(batches) * 1e6:9.1f}", f"{len(fresh) / put_s:12,.0f}"]
    )
    rows.append([name, "re-put x16", f"{reput:9.1f}", f"{16 / reput * 1e6:12,.0f}"])
    return lookups


def _raw_mget(deployment: RedisDeployment, repeat: int, rows: list[list[str]]) -> dict[int, float]:
    client = deployment.client(deployment.servers[0].port)
    names = [f"raw:{i}".encode() for i in range(max(_SIZES))]
    client.mset({name: b"x" * 49 for name in names})  # the size of a packed entry
    out: dict[int, float] = {}
    for n in _SIZES:
        batch = names[:n]

        def mget(b: list[bytes] = batch) -> None:
            pipe = client.pipeline(transaction=False)
            pipe.mget(b)
            pipe.execute()

        out[n] = _median_us(mget, max(5, int(repeat / n**0.5)))
        rows.append(
            ["raw redis MGET", f"lookup x{n}", f"{out[n]:9.1f}", f"{n / out[n] * 1e6:12,.0f}"]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--arenas", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    keys = [fold_key(i, b"index-bench") for i in range(args.keys)]
    rows: list[list[str]] = []
    config = IndexConfig(grace=2.0, headroom=0.05)

    memory = MemoryIndex.create(config)
    _populate(memory, keys, args.arenas)
    base = _measure("memory (in process)", memory, keys, args.repeat, rows)

    spread: dict[str, int] = {}
    trips = ""
    with RedisDeployment.single() as single:
        raw = _raw_mget(single, args.repeat, rows)
        index = RedisIndex.create(
            IndexConfig(grace=2.0, headroom=0.05, options={"url": single.url})
        )
        _populate(index, keys, args.arenas)
        one = _measure("redis, 1 server", index, keys, args.repeat, rows)
        index.close()
    with RedisDeployment.cluster(masters=3, replicas=args.replicas) as cluster:
        index = RedisIndex.create(
            IndexConfig(grace=2.0, headroom=0.05, options={"url": cluster.url})
        )
        _populate(index, keys, args.arenas)
        three = _measure(
            f"redis, 3 masters (+{args.replicas} rep.)", index, keys, args.repeat, rows
        )
        for key in keys:
            master = index.shard_of(key)
            spread[master] = spread.get(master, 0) + 1
        before = index.round_trip_counts()
        index.lookup_prefix(keys[:64])
        after = index.round_trip_counts()
        trips = (
            f"{after['round_trips'] - before['round_trips']} round trips "
            f"in {after['rounds'] - before['rounds']} round"
        )
        index.close()

    print(f"{'system':<28} {'call':<12} {'median us':>9} {'keys/s':>12}")
    for row in rows:
        print(f"{row[0]:<28} {row[1]:<12} {row[2]:>9} {row[3]:>12}")
    print()
    print(
        f"{'keys per lookup':<16} {'redis 1 / MGET':>14} {'cluster / 1':>12} "
        f"{'redis 1 / memory':>16}"
    )
    for n in _SIZES:
        print(
            f"{n:<16} {one[n] / raw[n]:>13.2f}x {three[n] / one[n]:>11.2f}x "
            f"{one[n] / base[n]:>15.1f}x"
        )
    print()
    counts = sorted(spread.values())
    mean = sum(counts) / len(counts)
    print(
        f"{len(keys)} keys over {args.arenas} arenas on {len(counts)} masters: {counts} "
        f"(max/mean {max(counts) / mean:.2f}); a lookup of 64 keys: {trips}"
    )


if __name__ == "__main__":
    main()
