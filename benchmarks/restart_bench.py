"""What a restart costs: rebuilding the index from the nodes, rescanning a file node, and
the price of keeping records in files instead of memory.

    python benchmarks/restart_bench.py                 # 10k and 100k entries, 256 MiB file
    python benchmarks/restart_bench.py --full          # adds 1M entries and a 1 GiB file

Rows:

- *controller rebuild*: a real controller holding N entries on one real node is killed with
  SIGKILL and started again; time until its index holds all N again (the node notices the
  new epoch, scans its memory, registers and reports its records), and until a client that
  was connected before the crash hits them;
- *index restore*: the same N records handed to a fresh in-process memory index
  (register, restore in frames of 8192, done) — the controller's share of the rebuild;
- *node scan*: a data node's scan of its memory holding N records;
- *file rescan*: a ``file`` node's scan of S bytes of records on restart;
- *sync cost*: back-to-back puts into a ``file`` store with ``file.sync`` off, every second
  and every 100 ms (what a power-loss bound costs writers);
- *put / get file vs dram*: 64 x 4 MiB through embedded stores over ``shm`` (first put into
  fresh files, then a get into the caller's buffers), and the same on ``dram`` in the same
  process: the ratio is what files cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import kvfabric
from kvfabric._node.node import DataNode
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.keys import chain_keys
from kvfabric.spi import BackendConfig, IndexConfig, TransportConfig


def _keys(n: int, salt: str) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=f"{salt}{time.monotonic_ns()}".encode())


def controller_rebuild(count: int) -> tuple[float, float, float]:
    """(seconds until the index holds every entry again, until the old client hits, hit share)."""
    capacity = max(64 << 20, count * 256)
    with LocalCluster(nodes=1, transports=("shm", "tcp"), capacity=f"{capacity}B") as cluster:
        url = cluster.url(retry_interval="100ms", control_timeout="5s", timeout="10s")
        with kvfabric.connect(url) as store:
            keys = _keys(count, "rebuild")
            for start in range(0, count, 10_000):
                chunk = keys[start : start + 10_000]
                store.batched_put(chunk, [k[:16] for k in chunk])
            cluster.kill_controller()
            started = time.monotonic()
            cluster.start_controller()
            while cluster.stats()["index"].get("entries", 0) < count:
                time.sleep(0.02)
            rebuilt = time.monotonic() - started
            while store.batched_contains(keys[:100]) < 100:
                time.sleep(0.02)
            hit = time.monotonic() - started
            hits = sum(
                sum(v is not None for v in store.batched_get(keys[s : s + 10_000]))
                for s in range(0, count, 10_000)
            )
    return rebuilt, hit, hits / count


def index_restore(count: int) -> float:
    node = DataNode.create(
        backend="dram",
        transports=["shm"],
        backend_config=BackendConfig(capacity=max(1 << 20, count * 128), region_size=1 << 40),
        transport_config=TransportConfig(),
    )
    try:
        records = [
            kvfabric.Descriptor(
                key=k, node=0, region=0, offset=i * 128, length=16, rkey=0, version=i + 1, crc=0
            )
            for i, k in enumerate(_keys(count, "restore"))
        ]
        index = MemoryIndex.create(IndexConfig())
        started = time.perf_counter()
        registered = index.register_node(node.info(restoring=True))
        for start in range(0, count, 8192):
            index.restore(registered.id, records[start : start + 8192])
        index.restore_done(registered.id)
        return time.perf_counter() - started
    finally:
        node.close()


def file_scan(size: int, value: int = 256 * 1024) -> tuple[float, int]:
    """(seconds to rescan, records found) for a file node holding ``size`` bytes of records."""
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-") as path:
        url = f"embedded://?backend=file&path={path}&capacity={size + (64 << 20)}B"
        count = size // value
        with kvfabric.connect(url) as store:
            keys = _keys(count, "scan")
            payload = os.urandom(value)
            for start in range(0, count, 64):
                store.batched_put(
                    keys[start : start + 64], [payload] * len(keys[start : start + 64])
                )
        node = DataNode.create(
            backend="file",
            transports=["shm"],
            backend_config=BackendConfig(
                capacity=size + (64 << 20), region_size=1 << 40, path=path
            ),
            transport_config=TransportConfig(),
        )
        try:
            scan = node.scan()
        finally:
            node.close()
    return scan.seconds, len(scan.records)


def put_get(url: str, repeat: int = 3) -> tuple[float, float]:
    """Median seconds of a first put and of a get of 64 x 4 MiB."""
    chunk = np.random.default_rng(0).bytes(4 << 20)
    # Into buffers allocated and touched once, as an engine's are: a get into fresh buffers
    # times the allocator's page faults, which vary widely from run to run, not the store.
    into = [np.ones(4 << 20, dtype=np.uint8) for _ in range(64)]
    puts, gets = [], []
    for _ in range(repeat):
        with (
            tempfile.TemporaryDirectory(prefix="kvfabric-bench-") as path,
            kvfabric.connect(url.format(path=path)) as store,
        ):
            keys = _keys(64, "pg")
            started = time.perf_counter()
            store.batched_put(keys, [chunk] * 64)
            puts.append(time.perf_counter() - started)
            store.batched_contains(keys)
            started = time.perf_counter()
            got = store.batched_get(keys, into=into)
            gets.append(time.perf_counter() - started)
            assert all(value is not None for value in got)
    return statistics.median(puts), statistics.median(gets)


def sustained_puts(url: str, seconds: float = 4.0) -> float:
    """GB/s of back-to-back puts of 64 fresh 1 MiB values into a 512 MiB store (evicting
    once full) for ``seconds``: what a periodic ``file.sync`` flush costs writers."""
    chunk = np.random.default_rng(1).bytes(1 << 20)
    moved = 0
    with (
        tempfile.TemporaryDirectory(prefix="kvfabric-bench-") as path,
        kvfabric.connect(url.format(path=path)) as store,
    ):
        started = time.perf_counter()
        batch = 0
        while time.perf_counter() - started < seconds:
            outcomes = store.batched_put(_keys(64, f"sync{batch}"), [chunk] * 64)
            moved += sum(o is kvfabric.PutOutcome.STORED for o in outcomes) << 20
            batch += 1
        elapsed = time.perf_counter() - started
    return moved / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="add 1M entries and a 1 GiB file")
    args = parser.parse_args()
    counts = [10_000, 100_000] + ([1_000_000] if args.full else [])
    print(
        f"{'entries':>9}  {'rebuilt':>9}  {'old client hits':>15}  {'hit share':>9}  "
        f"{'index restore':>13}"
    )
    for count in counts:
        rebuilt, hit, share = controller_rebuild(count)
        restore = index_restore(count)
        print(f"{count:>9}  {rebuilt:>8.2f}s  {hit:>14.2f}s  {share:>9.4f}  {restore:>12.3f}s")
    print()
    sizes = [256 << 20] + ([1 << 30] if args.full else [])
    print(f"{'file size':>10}  {'records':>8}  {'rescan':>8}  {'GB/s':>6}")
    for size in sizes:
        seconds, found = file_scan(size)
        print(f"{size >> 20:>7} MiB  {found:>8}  {seconds:>7.2f}s  {size / seconds / 1e9:>6.2f}")
    print()
    gib = 64 * 4 / 1024
    dram = put_get("embedded://?capacity=512MiB")
    files = put_get("embedded://?backend=file&path={path}&capacity=512MiB")
    print("64 x 4 MiB over shm   put (GB/s)   get (GB/s)")
    for name, (put, get) in (("dram", dram), ("file", files)):
        print(f"{name:<20} {gib / put:>11.2f}  {gib / get:>11.2f}")
    print(f"{'file / dram':<20} {dram[0] / files[0]:>10.2f}x  {dram[1] / files[1]:>10.2f}x")
    print()
    print("sustained puts of 64 x 1 MiB into a 512 MiB file store   GB/s   of sync=0")
    base = 0.0
    for sync in ("0", "1s", "100ms"):
        rate = sustained_puts(
            f"embedded://?backend=file&path={{path}}&capacity=512MiB&file.sync={sync}"
        )
        base = base or rate
        print(f"  file.sync={sync:<6} {rate:>45.2f}  {rate / base:>8.2f}x")


if __name__ == "__main__":
    main()
