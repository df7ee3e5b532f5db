"""The floors ``kvfabric bench`` holds every system against, measured in the same process tree.

- memcpy: numpy copies of the batch's chunks (distinct sources and destinations, touched);
- a raw socket: a child process streams the batch's bytes over 127.0.0.1 into one
  preallocated buffer here;
- a raw small round trip (2 KiB out, 64 bytes back) to that child, and the same through
  ZeroMQ (DEALER to ROUTER): the floors of a lookup.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import Phase, median_seconds

__all__ = ["floor_rows", "round_trip_rows"]

# Round trips are short and noisy: at least this many samples.
_RTT_SAMPLES = 50
# Floors are cheap, and every ratio divides by one: at least this many samples, so one
# preemption on a busy machine does not move them.
_FLOOR_SAMPLES = 9

_FLOOR_SERVER = textwrap.dedent(
    """
    import socket, struct, sys
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(listener.getsockname()[1], flush=True)
    payload = memoryview(bytearray(int(sys.argv[1])))
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(16)
    while True:
        view, got = memoryview(head), 0
        while got < 16:
            n = conn.recv_into(view[got:])
            if not n:
                sys.exit(0)
            got += n
        reply, follows = struct.unpack("<QQ", head)
        while follows:
            follows -= len(conn.recv(min(follows, 1 << 20)))
        while reply:
            n = min(reply, len(payload))
            conn.sendall(payload[:n])
            reply -= n
    """
)

_ZMQ_ECHO = textwrap.dedent(
    """
    import zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    while True:
        ident, message = sock.recv_multipart()
        sock.send_multipart([ident, message[:64]])
    """
)


@contextmanager
def _floor_server(size: int) -> Iterator[socket.socket]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOOR_SERVER, str(size)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield conn
        conn.close()
    finally:
        proc.kill()
        proc.wait()


def floor_rows(count: int, size: int, repeat: int) -> list[BenchRow]:
    """memcpy and a raw socket stream of ``count`` chunks of ``size`` bytes."""
    sources = [
        np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)
    ]
    dests = [np.ones(size, dtype=np.uint8) for _ in range(count)]

    def memcpy() -> None:
        for src, dst in zip(sources, dests, strict=True):
            np.copyto(dst, src)

    seconds = median_seconds(memcpy, max(repeat, _FLOOR_SAMPLES))
    rows = [BenchRow(system="memcpy", phase=Phase.COPY, size=size, count=count, seconds=seconds)]
    target = np.ones(size * count, dtype=np.uint8).data
    with _floor_server(size) as conn:

        def stream() -> None:
            conn.sendall(struct.pack("<QQ", size * count, 0))
            got = 0
            while got < len(target):
                got += conn.recv_into(target[got:])

        seconds = median_seconds(stream, max(repeat, _FLOOR_SAMPLES))
    rows.append(
        BenchRow(system="raw socket", phase=Phase.STREAM, size=size, count=count, seconds=seconds)
    )
    return rows


def round_trip_rows() -> list[BenchRow]:
    """A raw socket's and ZeroMQ's small round trip (2 KiB out, 64 bytes back)."""
    request = struct.pack("<QQ", 64, 2048) + bytes(2048)
    reply = bytearray(64)
    with _floor_server(64) as conn:

        def round_trip() -> None:
            conn.sendall(request)
            got = 0
            while got < 64:
                got += conn.recv_into(memoryview(reply)[got:])

        raw = median_seconds(round_trip, _RTT_SAMPLES)
    note = "2 KiB out, 64 B back"
    return [
        BenchRow(system="raw socket", phase=Phase.RTT, size=2048, count=1, seconds=raw, note=note),
        BenchRow(
            system="zeromq", phase=Phase.RTT, size=2048, count=1, seconds=_zmq_rtt(), note=note
        ),
    ]


def _zmq_rtt() -> float:
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", _ZMQ_ECHO], stdout=subprocess.PIPE, text=True)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        assert proc.stdout is not None
        sock.connect(f"tcp://127.0.0.1:{int(proc.stdout.readline())}")
        message = bytes(2048)

        def round_trip() -> None:
            sock.send(message)
            sock.recv()

        return median_seconds(round_trip, _RTT_SAMPLES)
    finally:
        sock.close(linger=0)
        proc.kill()
        proc.wait()
