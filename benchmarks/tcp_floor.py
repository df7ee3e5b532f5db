"""The tcp transport against a raw Python socket floor, over 127.0.0.1, in one process tree.

    python benchmarks/tcp_floor.py [--repeat 21]

For 64 chunks of 4 MiB and of 256 KiB: the floor is a child process that ``sendall``s the
bytes on a plain socket to this process, which ``recv_into``s one preallocated buffer. The
transport rows run a real tcp data node process (and its controller) and time one client's
batched read (one segment per chunk; and as records: a 64-byte header segment plus the
payload segment at the adjacent offset; and those records checksummed, as a store reads
them) and write of the same bytes. Samples are taken round-robin, so load from elsewhere
on the machine hits every row alike. Prints medians, GB/s, the ratio to the floor measured
in the same run, and the most times one call took the GIL back (counted by kvfabric's
native module in this thread: a plain tcp frame is one native call).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfabric._runtime import native
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportClient, TransportConfig
from kvfabric.transports.tcp import TcpTransport

_REQUEST = struct.Struct("<QQ")  # count, size; (0, 0) ends the floor server
_HEADER = 64


def _raw_server(capacity: int) -> None:
    """Child process: per request, ``sendall`` ``count`` distinct chunks of ``size`` bytes.

    Distinct chunks of touched memory, like a region's: resending one small buffer would
    serve the floor from the CPU cache and flatter it.
    """
    source = memoryview(np.random.default_rng(1).bytes(capacity))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(_REQUEST.size)
    while conn.recv_into(request, _REQUEST.size, socket.MSG_WAITALL) == _REQUEST.size:
        count, size = _REQUEST.unpack(request)
        if count == 0:
            break
        for i in range(count):
            conn.sendall(source[i * size : (i + 1) * size])
    conn.close()


def _medians(fns: list[Callable[[], object]], repeat: int) -> list[tuple[float, int]]:
    """Median time of each and the most GIL returns of one call, sampled round-robin so
    load from elsewhere hits all alike."""
    for fn in fns:
        fn()  # warm up: page faults, socket windows, the connection pool
    samples: list[list[float]] = [[] for _ in fns]
    returns = [0] * len(fns)
    for _ in range(repeat):
        for i, (fn, times) in enumerate(zip(fns, samples, strict=True)):
            before = native.gil_reacquisitions()
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            returns[i] = max(returns[i], native.gil_reacquisitions() - before)
    return [(statistics.median(t), n) for t, n in zip(samples, returns, strict=True)]


def _floor(sock: socket.socket, count: int, size: int) -> Callable[[], None]:
    dest = memoryview(bytearray(count * size))

    def receive() -> None:
        sock.sendall(_REQUEST.pack(count, size))
        got = 0
        while got < dest.nbytes:
            n = sock.recv_into(dest[got:])
            if n == 0:
                raise ConnectionError("floor server went away")
            got += n

    return receive


def _batch(client: TransportClient, op: str, segments: list[Segment]) -> Callable[[], None]:
    call = client.read if op == "read" else client.write

    def run() -> None:
        assert call(1, segments) == [None] * len(segments)

    return run


def _checksummed(
    client: TransportClient, segments: list[Segment], spans: list[tuple[int, int]]
) -> Callable[[], None]:
    def run() -> None:
        errors, crcs = client.read_checksummed(1, segments, spans)
        assert errors == [None] * len(segments)
        assert len(crcs) == len(spans)

    return run


def _table(
    sock: socket.socket, endpoint: NodeEndpoint, count: int, size: int, repeat: int
) -> list[tuple[str, float, int]]:
    handle = endpoint.regions[0]
    stride = _HEADER + size

    def at(i: int, buf: Any, header: bool = False) -> Segment:
        offset = i * stride + (0 if header else _HEADER)
        return Segment(handle.region, handle.rkey, offset, memoryview(buf).cast("B"))

    payloads = [np.random.default_rng(i).bytes(size) for i in range(count)]
    dests = [np.empty(size, dtype=np.uint8) for _ in range(count)]
    heads = [bytearray(_HEADER) for _ in range(count)]
    records = [seg for i in range(count) for seg in (at(i, heads[i], True), at(i, dests[i]))]
    client = TcpTransport.create_client(TransportConfig(timeout=60.0))
    client.connect(endpoint)
    try:
        _batch(client, "write", [at(i, p) for i, p in enumerate(payloads)])()
        rows = {
            "raw socket recv_into (floor)": _floor(sock, count, size),
            "tcp read": _batch(client, "read", [at(i, d) for i, d in enumerate(dests)]),
            "tcp read as records (64 B header + payload)": _batch(client, "read", records),
            "tcp read as records, checksummed": _checksummed(
                client, records, [(2 * i + 1, 2 * i + 2) for i in range(count)]
            ),
            "tcp write": _batch(client, "write", [at(i, p) for i, p in enumerate(payloads)]),
        }
        measured = _medians(list(rows.values()), repeat)
        assert all(d.tobytes() == p for d, p in zip(dests, payloads, strict=True))
        return [(name, t, n) for name, (t, n) in zip(rows, measured, strict=True)]
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tcp transport vs a raw socket floor")
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--raw-server", type=int, metavar="CAPACITY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_server:
        _raw_server(args.raw_server)
        return 0

    shapes = [(64, 4 << 20), (64, 256 << 10)]
    capacity = max(count * (_HEADER + size) for count, size in shapes)
    # A real node process (and its controller), as clients meet it; no test dependencies.
    cluster = LocalCluster(nodes=1, transports=("tcp",), capacity=str(capacity))
    info = cluster.node_infos()[0]
    endpoint = next(e for e in info.endpoints if e.transport == "tcp")
    raw = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", str(capacity)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert raw.stdout is not None
        with socket.create_connection(("127.0.0.1", int(raw.stdout.readline()))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for count, size in shapes:
                total = count * size
                rows = _table(sock, endpoint, count, size, args.repeat)
                floor = rows[0][1]
                print(f"\n{count} x {size >> 10} KiB ({total >> 20} MiB), median of {args.repeat}")
                print(f"{'path':<46} {'median ms':>10} {'GB/s':>8} {'x floor':>8} {'GIL':>5}")
                for name, seconds, returns in rows:
                    gil = "-" if name.startswith("raw") else str(returns)
                    print(
                        f"{name:<46} {seconds * 1e3:>10.2f} {total / seconds / 1e9:>8.2f} "
                        f"{floor / seconds:>8.2f} {gil:>5}"
                    )
            sock.sendall(_REQUEST.pack(0, 0))
    finally:
        raw.wait(timeout=10)
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
