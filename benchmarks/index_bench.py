"""The redis index against the memory index, a controller and raw Redis:
``python benchmarks/index_bench.py [--parts latency,throughput,shards,memory]``.

Starts its own ``redis-server`` processes on 127.0.0.1 (one server, and clusters of masters
with ``--replicas`` replicas each) and, for the throughput part, a ``kvfabric controller``
and data-node processes. The parts:

* ``latency`` — one client thread, one data node of ``--arenas`` regions (one arena each,
  spread over the masters), ``--keys`` keys stored: lookup latency (``lookup_prefix``, all
  keys hit) against the number of keys per call, beside the same number of keys read with
  one pipelined ``MGET`` on the single server (what any Redis client pays for one round
  trip) and the in-process memory index; put throughput (allocate + publish of fresh keys,
  16 per call) and re-put latency; how evenly keys and round trips spread over 3 masters.
* ``throughput`` — ``--clients`` client processes (4) against one controller (its index by
  RPC: the lookup image is off, so every lookup reaches it), one Redis server and a 3-master
  cluster, each with a data-node process of ``--arenas`` regions registered with it:
  lookups of 64 keys per second, puts (allocate + publish) of 16 fresh keys per second, all
  processes at once for ``--seconds``; and for Redis, the function calls each master ran per
  second (``INFO commandstats``).
* ``shards`` — lookup latency (1 and 64 keys) against the number of masters: 1 (a single
  server), 3 and 6, from one client, with how many round trips a lookup of 64 keys took.
* ``memory`` — bytes per entry on a Redis master (``used_memory`` before and after storing
  ``--keys`` entries, with 1 and 2 copies per value).

Needs redis-server on PATH, redis-py (``pip install 'kvfabric[redis]'``) and the test extra
(``'kvfabric[test]'``: the Redis deployments are the test suite's own, ``kvfabric.testing``'s
``Cluster`` and ``tests/redis_servers.py``). Timings are
medians over ``--repeat`` calls; on a busy machine they move, the ratios less.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    Index,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
)
from kvfabric.testing import Cluster

# The test suite's redis-server processes (tests/redis_servers.py): started the same way here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_servers import RedisDeployment

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


def _put(index: Index, keys: Sequence[bytes]) -> None:
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


def _latency(args: argparse.Namespace) -> None:
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


# -- many client processes ------------------------------------------------------------------

_LOOKUP_KEYS = 64
_PUT_KEYS = 16


def _open(target: dict[str, str]) -> Index:
    """An index client in this process: a controller's by RPC, or the redis index."""
    if target["kind"] == "controller":
        return RemoteIndex(ControlClient(target["endpoint"], timeout=10.0))
    return RedisIndex.create(
        IndexConfig(options={"url": target["url"], "namespace": target["namespace"]})
    )


def _client(
    target: dict[str, str], stored: int, seconds: float, start_at: float, results: Any
) -> None:
    """One client process: lookups of 64 stored keys for ``seconds``, then puts of 16 fresh
    keys for ``seconds``, both starting at wall-clock ``start_at`` (all clients at once)."""
    index = _open(target)
    keys = [fold_key(i, b"index-bench-shared") for i in range(stored)]
    salt = os.urandom(8)
    out: dict[str, float] = {}
    for mode in ("lookup", "put"):
        while time.time() < start_at:
            time.sleep(0.001)
        calls, fresh, latencies = 0, 0, []
        deadline = time.perf_counter() + seconds
        while (now := time.perf_counter()) < deadline:
            if mode == "lookup":
                first = (calls * 7919) % (stored - _LOOKUP_KEYS)
                assert len(index.lookup_prefix(keys[first : first + _LOOKUP_KEYS])) == 64
            else:
                batch = [fold_key(fresh + i, salt) for i in range(_PUT_KEYS)]
                fresh += _PUT_KEYS
                _put(index, batch)
            latencies.append(time.perf_counter() - now)
            calls += 1
        out[f"{mode}_calls"] = calls / seconds
        out[f"{mode}_ms"] = statistics.median(latencies) * 1e3
        start_at += seconds + 1.0
    results.put(out)


@contextmanager
def _deployment(kind: str, arenas: int, replicas: int) -> Iterator[tuple[dict[str, str], Any]]:
    """A deployment with one data node of ``arenas`` regions: (target, redis or None)."""
    node = ["--region-size", "64MiB", "--backend-opt", "dram.prefault=false"]
    capacity = f"{64 * arenas}MiB"
    if kind == "controller":
        with Cluster(
            nodes=1,
            transports=("tcp",),
            capacity=capacity,
            node_args=node,
            controller_args=["--transport", "none"],
        ) as cluster:
            yield {"kind": kind, "endpoint": cluster.endpoint}, None
        return
    redis = (
        RedisDeployment.single()
        if kind == "redis1"
        else RedisDeployment.cluster(masters=3, replicas=replicas)
    )
    with (
        redis,
        Cluster(
            nodes=1,
            transports=("tcp",),
            capacity=capacity,
            node_args=node,
            redis=redis.url,
            node_ttl="60s",
        ) as cluster,
    ):
        yield {"kind": kind, "url": redis.url, "namespace": cluster.namespace}, redis


def _fcalls(redis: Any) -> dict[int, int]:
    """Function calls each live master ran so far (FCALL and FCALL_RO)."""
    out: dict[int, int] = {}
    ports = list(redis.masters()) if redis.is_cluster else [redis.servers[0].port]
    for port in ports:
        stats = redis.client(port).info("commandstats")
        out[port] = sum(
            int(stats.get(name, {}).get("calls", 0))
            for name in ("cmdstat_fcall", "cmdstat_fcall_ro")
        )
    return out


def _throughput(args: argparse.Namespace) -> None:
    names = {
        "controller": "one controller (RPC)",
        "redis1": "redis, 1 server",
        "redis3": f"redis, 3 masters (+{args.replicas} rep.)",
    }
    context = multiprocessing.get_context("spawn")
    rows = []
    for kind, name in names.items():
        with _deployment(kind, args.arenas, args.replicas) as (target, redis):
            loader = _open(target)
            stored = [fold_key(i, b"index-bench-shared") for i in range(args.keys)]
            for start in range(0, len(stored), 256):
                _put(loader, stored[start : start + 256])
            results = context.Queue()
            start_at = time.time() + 3.0  # the processes start meanwhile
            calls_before = _fcalls(redis) if redis is not None else {}
            processes = [
                context.Process(
                    target=_client, args=(target, args.keys, args.seconds, start_at, results)
                )
                for _ in range(args.clients)
            ]
            for process in processes:
                process.start()
            outs = [results.get(timeout=120 + 4 * args.seconds) for _ in processes]
            for process in processes:
                process.join()
            per_shard = ""
            if redis is not None:
                after = _fcalls(redis)
                rates = sorted(
                    (after[p] - calls_before.get(p, 0)) / (2 * args.seconds) for p in after
                )
                per_shard = " / ".join(f"{r:,.0f}" for r in rates)
            if hasattr(loader, "close"):
                loader.close()
        lookups = sum(o["lookup_calls"] for o in outs)
        puts = sum(o["put_calls"] for o in outs)
        rows.append(
            (
                name,
                lookups,
                statistics.median(o["lookup_ms"] for o in outs),
                puts,
                statistics.median(o["put_ms"] for o in outs),
                per_shard,
            )
        )
    print(
        f"{args.clients} client processes at once, {args.seconds:g} s each; lookups of "
        f"{_LOOKUP_KEYS} stored keys, puts of {_PUT_KEYS} fresh keys (allocate + publish)"
    )
    print(
        f"{'system':<30} {'lookups/s':>10} {'keys/s':>10} {'ms':>6} {'puts/s':>8} "
        f"{'keys/s':>9} {'ms':>6}  function calls/s per master"
    )
    base = rows[0]
    for name, lookups, lookup_ms, puts, put_ms, per_shard in rows:
        print(
            f"{name:<30} {lookups:>10,.0f} {lookups * _LOOKUP_KEYS:>10,.0f} "
            f"{lookup_ms:>6.2f} {puts:>8,.0f} {puts * _PUT_KEYS:>9,.0f} {put_ms:>6.2f}  "
            f"{per_shard}"
        )
    print(f"{'(ratio to the controller)':<30}", end="")
    for _, lookups, _, puts, _, _ in rows[1:]:
        print(f"  lookups {lookups / base[1]:.2f}x, puts {puts / base[3]:.2f}x;", end="")
    print()


def _shards(args: argparse.Namespace) -> None:
    keys = [fold_key(i, b"index-bench") for i in range(args.keys)]
    print(f"lookup latency against shard count ({args.arenas} arenas, one client thread)")
    print(f"{'masters':>7} {'1 key us':>9} {'64 keys us':>11} {'round trips/64':>15} spread")
    for masters in (1, 3, 6):
        redis = (
            RedisDeployment.single()
            if masters == 1
            else RedisDeployment.cluster(masters=masters, replicas=0)
        )
        with redis:
            index = RedisIndex.create(
                IndexConfig(grace=2.0, headroom=0.05, options={"url": redis.url})
            )
            _populate(index, keys, args.arenas)
            one = _median_us(functools.partial(index.lookup_prefix, keys[:1]), args.repeat)
            many = _median_us(functools.partial(index.lookup_prefix, keys[:64]), args.repeat)
            before = index.round_trip_counts()["round_trips"]
            index.lookup_prefix(keys[:64])
            trips = index.round_trip_counts()["round_trips"] - before
            spread: dict[str, int] = {}
            for key in keys:
                shard = index.shard_of(key)
                spread[shard] = spread.get(shard, 0) + 1
            index.close()
        print(f"{masters:>7} {one:>9.0f} {many:>11.0f} {trips:>15} {sorted(spread.values())}")


def _memory(args: argparse.Namespace) -> None:
    print("bytes per entry on a Redis master (used_memory before and after)")
    for replicas in (1, 2):
        with RedisDeployment.single() as single:
            index = RedisIndex.create(IndexConfig(replicas=replicas, options={"url": single.url}))
            for n in range(max(replicas, 2)):
                index.register_node(
                    NodeInfo(
                        name=f"bench{n}",
                        regions=tuple(
                            RegionInfo(id=i, size=256 << 20, rkey=7 + i) for i in range(args.arenas)
                        ),
                        endpoints=(),
                    )
                )
            client = single.client(single.servers[0].port)
            before = int(client.info("memory")["used_memory"])
            keys = [fold_key(i, b"index-bench-memory") for i in range(args.keys)]
            for start in range(0, len(keys), 256):
                result = index.allocate(
                    [AllocationRequest(key=k, length=_VALUE) for k in keys[start : start + 256]]
                )
                index.publish(
                    [
                        GrantRef.of(d, crc=1)
                        for a in result.allocations
                        if a.descriptor is not None
                        for d in (a.descriptor, *a.replicas)
                    ]
                )
            after = int(client.info("memory")["used_memory"])
            entries = index.stats()["entries"]
            index.close()
        print(
            f"  {replicas} cop{'y' if replicas == 1 else 'ies'} per value: "
            f"{(after - before) / len(keys):,.0f} bytes per key ({entries} entries, "
            f"{(after - before) / entries:,.0f} per entry)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="latency,throughput,shards,memory")
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--arenas", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=1, help="Redis replicas per master")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    parts = {"latency": _latency, "throughput": _throughput, "shards": _shards, "memory": _memory}
    for name in args.parts.split(","):
        print(f"== {name} " + "=" * 70)
        parts[name](args)
        print()


if __name__ == "__main__":
    main()
