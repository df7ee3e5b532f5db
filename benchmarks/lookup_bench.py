"""Lookups: one-sided from the lookup image against the control RPC, in one process tree.

    python benchmarks/lookup_bench.py [--repeat 201] [--cpu-lookups 2000]

Starts a controller and one data node (real processes, as ``kvfabric controller`` and
``kvfabric node`` run them: the controller serves its lookup image over tcp and shm), stores
1,024 chained keys, then times ``batched_contains`` of 16 / 64 / 256 / 1,024 of them (all
hits) from this process, three ways:

* ``shm`` — the image mapped read-only and probed in place (no system call);
* ``tcp`` — the image read through the controller's tcp server (one data-plane round trip);
* ``rpc`` — ``?lookup_image=0``: the control RPC, as where the index keeps no lookup image.

and again back to back (one row's lookups repeated: caches warm, the best case).

Beside them, the floor: a raw Python socket request/reply over 127.0.0.1 with a child process
(64 bytes each way: the round trip any remote lookup pays), and a reply of the bytes a tcp
lookup of N keys lands (N x 512). Samples are taken round-robin, so load from elsewhere on
the machine hits every row alike; the table prints medians and ratios.

Then the controller's CPU time per lookup: utime + stime from ``/proc/<pid>/stat`` around
``--cpu-lookups`` lookups of 64 keys, minus what the same controller used idle over the same
wall time (its own tick, heartbeats). One-sided lookups over shm cost it nothing; over tcp the
image's server thread does the read (in the controller's process, not its loop).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import kvfabric
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.keys import chain_keys

_SIZES = (16, 64, 256, 1024)
_WINDOW_BYTES = 512  # what a tcp lookup lands per key (8 buckets of 64 bytes)
_REQUEST = struct.Struct("<Q")  # reply size; 0 ends the floor server


def _floor_server() -> None:
    """Child process: per request, reply with the asked number of bytes."""
    payload = memoryview(os.urandom(1 << 20))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(_REQUEST.size)
    while conn.recv_into(request, _REQUEST.size, socket.MSG_WAITALL) == _REQUEST.size:
        (size,) = _REQUEST.unpack(request)
        if size == 0:
            break
        conn.sendall(payload[:size])
    conn.close()


class _Floor:
    """The raw socket round trip, against a child process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--floor-server"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 20)

    def round_trip(self, size: int) -> None:
        self.sock.sendall(_REQUEST.pack(size))
        view = memoryview(self.buf)[:size]
        got = 0
        while got < size:
            got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.sendall(_REQUEST.pack(0))
        self.sock.close()
        self.proc.wait(10)


def _medians(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median seconds of each, sampled round-robin."""
    for fn in fns:
        for _ in range(5):
            fn()  # warm up: mappings, connections, caches
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            samples[i].append(time.perf_counter() - started)
    return [statistics.median(s) for s in samples]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # utime and stime are fields 14 and 15 (1-based) of the whole line; after the
    # command name's ")" they are the 12th and 13th.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _controller_cpu_per_lookup(
    pid: int, lookup: Callable[[], object], count: int
) -> tuple[float, float]:
    """(microseconds of controller CPU per lookup, idle baseline per the same wall time)."""
    started, cpu = time.perf_counter(), _cpu_seconds(pid)
    for _ in range(count):
        lookup()
    busy, wall = _cpu_seconds(pid) - cpu, time.perf_counter() - started
    cpu = _cpu_seconds(pid)
    time.sleep(wall)
    idle = _cpu_seconds(pid) - cpu
    return max(busy - idle, 0.0) / count * 1e6, idle / count * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=201, help="samples per row")
    parser.add_argument("--cpu-lookups", type=int, default=2000, help="lookups per CPU row")
    parser.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        _floor_server()
        return 0

    floor = _Floor()
    with LocalCluster(nodes=1, transports=("tcp", "shm"), capacity="256MiB") as cluster:
        assert cluster.controller is not None
        pid = cluster.controller.popen.pid
        stores = {
            "shm": kvfabric.connect(cluster.url()),
            "tcp": kvfabric.connect(cluster.url(transport="tcp")),
            "rpc": kvfabric.connect(cluster.url(lookup_image="0")),
        }
        try:
            keys = chain_keys(list(range(max(_SIZES))), 1, namespace=uuid.uuid4().bytes)
            stores["rpc"].batched_put(keys, [os.urandom(256) for _ in keys])
            for name, store in stores.items():
                assert store.batched_contains(keys) == len(keys), name
            rows: dict[str, list[float]] = {}
            fns: list[Callable[[], object]] = []
            names: list[str] = []
            for n in _SIZES:
                batch = keys[:n]
                for name, store in stores.items():
                    names.append(f"{name} {n}")
                    fns.append(lambda s=store, b=batch: s.batched_contains(b))
                names.append(f"floor {n}")
                fns.append(lambda n=n: floor.round_trip(n * _WINDOW_BYTES))
            names.append("floor rtt")
            fns.append(lambda: floor.round_trip(64))
            for name, value in zip(names, _medians(fns, args.repeat), strict=True):
                rows.setdefault(name.split()[0], []).append(value)
            rtt = rows["floor"][-1]
            counts = {name: store.stats() for name, store in stores.items()}

            print(
                f"\nbatched_contains, all keys hit: median of {args.repeat} (us); raw socket "
                f"round trip (64 B each way) {rtt * 1e6:.1f} us\n"
            )
            print(f"{'keys':>6}" + "".join(f"{name:>10}" for name in (*stores, "floor")))
            for i, n in enumerate(_SIZES):
                cells = [rows[name][i] * 1e6 for name in (*stores, "floor")]
                print(f"{n:>6}" + "".join(f"{c:>10.1f}" for c in cells))
            print("\nratios")
            for name in stores:
                first, last = rows[name][0], rows[name][len(_SIZES) - 1]
                at64 = rows[name][_SIZES.index(64)]
                print(
                    f"  {name:>4}: 64 keys = {at64 / rtt:.2f}x the raw round trip; "
                    f"1,024 keys = {last / first:.2f}x 16 keys"
                )
            print(
                f"  shm one-sided / rpc at 64 keys: {rows['shm'][1] / rows['rpc'][1]:.3f}; "
                f"tcp one-sided / rpc: {rows['tcp'][1] / rows['rpc'][1]:.3f}"
            )
            print("\nback to back (the same lookup repeated, caches warm), median us")
            for name, store in stores.items():
                cells = []
                for n in _SIZES:
                    batch = keys[:n]
                    (median,) = _medians(
                        [lambda s=store, b=batch: s.batched_contains(b)], args.repeat
                    )
                    cells.append(f"{n} keys {median * 1e6:.1f}")
                print(f"  {name:>4}: " + ", ".join(cells))
            counts = {name: store.stats() for name, store in stores.items()}
            print("\ncounted (this run, every lookup above)")
            for name, c in counts.items():
                print(
                    f"  {name:>4}: lookups {c['lookups']}, control RPCs {c['control_rpcs']}, "
                    f"one-sided {c['onesided_lookups']}, image round trips "
                    f"{c['image_round_trips']}, fallbacks {c['image_fallbacks']}"
                )

            print(f"\ncontroller CPU per lookup of 64 keys ({args.cpu_lookups} lookups each)")
            batch = keys[:64]
            for name, store in stores.items():
                per, idle = _controller_cpu_per_lookup(
                    pid, lambda s=store: s.batched_contains(batch), args.cpu_lookups
                )
                print(f"  {name:>4}: {per:7.1f} us (idle controller: {idle:.1f} us per interval)")
            controller = cluster.stats()["controller"]
            print(
                f"  controller counters: rpc_lookup_prefix {controller.get('rpc_lookup_prefix', 0)}"
                f", touch_rpcs {controller.get('touch_rpcs', 0)}, image tcp requests "
                f"{controller.get('image_tcp_requests', 0)}"
            )
        finally:
            for store in stores.values():
                store.close()
            floor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
