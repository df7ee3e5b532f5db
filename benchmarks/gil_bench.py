"""The data path's loops alone and beside a busy Python thread: per-piece Python vs native batches.

    python benchmarks/gil_bench.py [--count 64] [--size 4MiB] [--seconds 0.5] [--rounds 5]

A batch is ``count`` values of ``size`` bytes. Each row runs one way of moving or checking
a batch in a loop for ``--seconds``, first alone, then beside a thread running a pure-Python
counting loop (an engine's scheduler or event loop, standing in). Every re-acquisition of
the GIL beside that thread waits out the switch interval (5 ms by default), so a loop that
takes the GIL back per piece slows down with the number of pieces; kvfabric._runtime.native
takes it back once per batch. Rows:

- crc: the ``crc32c`` package once per value vs ``native.crc32c_many``;
- copy: numpy ``copyto`` per value (the memcpy baseline), ``ctypes.memmove`` per value (as
  ``buffers.copy_into`` does) vs ``native.copy_many``; and copy then CRC per value vs
  the fused ``copy_many(crc_spans=...)``, reading the CRC back from the destination (what
  ``shm`` reads do) or taking it from the source (``crc_of_source``: what ``shm`` puts do);
- recv over 127.0.0.1 from a sender process: a Python ``recvmsg_into`` loop (the plain
  socket baseline) vs ``native.recv_into_all``; and with a CRC per value after landing vs
  the fused ``recv_into_all(crc_spans=...)``.

Rows are sampled in rounds, each row in turn, and medians printed: GB/s alone, beside the
busy thread, and beside the same loop in a busy *process* (the CPU it takes, without the
GIL); then their ratios. ``thread/alone`` is what an engine sees; ``thread/process`` is the
GIL's share of it, apart from CPU contention, which on a machine with fewer idle cores
than the threads need lowers both "beside" columns alike. Then each row alone against its
group's baseline (its first row), the share of its idle counting rate the busy thread kept,
and how many times a batch took the GIL back (native rows: counted by the module; Python
rows: their GIL-releasing calls), which does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import ctypes
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np

from kvfabric._runtime import native
from kvfabric._tools.bench_timing import BusyProcess, BusyThread
from kvfabric.spi import parse_size

_REQUEST = struct.Struct("<QQ")  # count, size; (0, 0) ends the sender
# One way of handling a batch; returns how many times it took the GIL back.
Row = Callable[[], int]


def _loop(fn: Row, seconds: float) -> tuple[int, float, int]:
    """Run ``fn`` repeatedly for about ``seconds``: (batches, elapsed, GIL returns per batch)."""
    batches = returns = 0
    started = time.perf_counter()
    while True:
        returns += fn()
        batches += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return batches, elapsed, returns // batches


def _idle_rate(seconds: float) -> float:
    with BusyThread() as busy:
        start, t0 = busy.count, time.perf_counter()
        time.sleep(seconds)
        return (busy.count - start) / (time.perf_counter() - t0)


def sample(fn: Row, batch_bytes: int, seconds: float, idle: float) -> tuple[float, ...]:
    """GB/s alone, beside the busy thread and beside the busy process; the share of its idle
    rate the busy thread kept; the GIL returns per batch."""
    batches, elapsed, returns = _loop(fn, seconds)
    alone = batches * batch_bytes / elapsed / 1e9
    with BusyThread() as busy:
        start = busy.count
        t0 = time.perf_counter()
        batches, elapsed, _ = _loop(fn, seconds)
        kept = (busy.count - start) / (time.perf_counter() - t0) / idle
    thread = batches * batch_bytes / elapsed / 1e9
    with BusyProcess():
        batches, elapsed, _ = _loop(fn, seconds)
    process = batches * batch_bytes / elapsed / 1e9
    return alone, thread, process, kept, returns


# -- the rows -----------------------------------------------------------------------------


def _native_call(fn: Callable[[], object], extra: int = 0) -> Callable[[], int]:
    """``fn`` as a row: returns the GIL returns it took (counted by the module, + ``extra``)."""

    def row() -> int:
        before = native.gil_reacquisitions()
        fn()
        return native.gil_reacquisitions() - before + extra

    return row


def crc_rows(values: list[memoryview]) -> list[tuple[str, Row]]:
    def package_per_value() -> int:
        for v in values:
            crc32c.crc32c(v)  # releases the GIL for 32 KiB and more
        return len(values)

    return [
        ("crc: crc32c package, one call per value", package_per_value),
        ("crc: native.crc32c_many", _native_call(lambda: native.crc32c_many(values))),
    ]


def copy_rows(
    sources: list[memoryview], dests: list[np.ndarray[Any, Any]]
) -> list[tuple[str, Row]]:
    src_arrays = [np.frombuffer(s, dtype=np.uint8) for s in sources]
    src_addr = [int(a.ctypes.data) for a in src_arrays]
    dest_addr = [int(d.ctypes.data) for d in dests]
    sizes = [s.nbytes for s in sources]
    pairs = list(zip(dests, sources, strict=True))
    spans = [(i, i + 1) for i in range(len(pairs))]

    def numpy_per_value() -> int:
        for d, s in zip(dests, src_arrays, strict=True):
            np.copyto(d, s)  # releases the GIL around a plain copy
        return len(dests)

    def memmove_per_value() -> int:
        for d, s, n in zip(dest_addr, src_addr, sizes, strict=True):
            ctypes.memmove(d, s, n)  # a foreign call: ctypes releases the GIL
        return len(dests)

    def memmove_then_crc() -> int:
        for d in dests:
            crc32c.crc32c(d.data)
        return memmove_per_value() + len(dests)

    return [
        ("copy: numpy copyto per value (memcpy)", numpy_per_value),
        ("copy: ctypes.memmove per value", memmove_per_value),
        ("copy: native.copy_many", _native_call(lambda: native.copy_many(pairs))),
        ("copy+crc: memmove, then crc32c, per value", memmove_then_crc),
        (
            "copy+crc: native.copy_many(crc_spans) fused",
            _native_call(lambda: native.copy_many(pairs, spans)),
        ),
        (
            "copy+crc: fused, CRC of the source (a put)",
            _native_call(lambda: native.copy_many(pairs, spans, crc_of_source=True)),
        ),
    ]


def _sender(size_total: int) -> None:
    """Child process: per request, send ``count * size`` bytes of touched memory."""
    source = memoryview(np.random.default_rng(1).bytes(size_total))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = bytearray(_REQUEST.size)
    while conn.recv_into(request, _REQUEST.size, socket.MSG_WAITALL) == _REQUEST.size:
        count, size = _REQUEST.unpack(request)
        if count == 0:
            break
        native.send_all(conn, [source[i * size : (i + 1) * size] for i in range(count)], None)
    conn.close()


def recv_rows(
    sock: socket.socket, dests: list[np.ndarray[Any, Any]], size: int
) -> list[tuple[str, Row]]:
    views = [d.data for d in dests]
    ask = _REQUEST.pack(len(dests), size)
    spans = [(i, i + 1) for i in range(len(dests))]
    iov_max = native.IOV_MAX

    def python_loop() -> int:
        # The loop kvfabric's tcp transport ran: recvmsg_into, up to IOV_MAX views a call.
        sock.sendall(ask)
        calls = 1
        pending = list(views)
        while pending:
            calls += 1
            n = sock.recvmsg_into(pending[:iov_max])[0]
            if n == 0:
                raise ConnectionError("sender went away")
            done = 0
            while n and n >= pending[done].nbytes:
                n -= pending[done].nbytes
                done += 1
            del pending[:done]
            if n:
                pending[0] = pending[0][n:]
        return calls

    def python_loop_then_crc() -> int:
        calls = python_loop()
        for v in views:
            crc32c.crc32c(v)
        return calls + len(views)

    def native_recv() -> object:
        sock.sendall(ask)  # the request: one more GIL return, counted below
        return native.recv_into_all(sock, views, time.monotonic() + 60)

    def native_recv_crc() -> object:
        sock.sendall(ask)
        return native.recv_into_all(sock, views, time.monotonic() + 60, crc_spans=spans)

    return [
        ("recv: Python recvmsg_into loop (socket)", python_loop),
        ("recv: native.recv_into_all", _native_call(native_recv, extra=1)),
        ("recv+crc: Python loop, then crc32c per value", python_loop_then_crc),
        ("recv+crc: native.recv_into_all(crc_spans) fused", _native_call(native_recv_crc, 1)),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--seconds", type=float, default=0.5, help="per cell and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sender", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sender is not None:
        _sender(args.sender)
        return
    count, size = args.count, args.size
    batch = count * size

    rng = np.random.default_rng(7)
    region = np.frombuffer(rng.bytes(batch), dtype=np.uint8)
    sources = [region[i * size : (i + 1) * size].data for i in range(count)]
    dests = [np.ones(size, dtype=np.uint8) for _ in range(count)]  # touched: no page faults

    child = subprocess.Popen(
        [sys.executable, __file__, "--sender", str(batch)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        groups = [
            crc_rows(sources),
            copy_rows(sources, dests),
            recv_rows(sock, dests, size),
        ]
        rows = [row for group in groups for row in group]
        for _, fn in rows:
            fn()  # warm up: page faults, socket windows
        # Rounds of every row in turn, medians reported: load from elsewhere on the machine
        # hits every row alike.
        samples: list[list[tuple[float, ...]]] = [[] for _ in rows]
        for _ in range(args.rounds):
            idle = _idle_rate(0.2)
            for (_, fn), taken in zip(rows, samples, strict=True):
                taken.append(sample(fn, batch, args.seconds, idle))
        print(
            f"batch: {count} x {size >> 10} KiB; medians of {args.rounds} rounds of "
            f"{args.seconds:g} s per cell; switch interval {sys.getswitchinterval() * 1e3:g} ms; "
            f"CRC32C pass: {native.CRC32C_PASS}"
        )
        heads = ("alone", "thread", "process", "thread/", "process/", "thread/", "vs")
        heads2 = ("GB/s", "GB/s", "GB/s", "alone", "alone", "process", "baseline")
        print(f"{'path':48}" + "".join(f"{h:>9}" for h in heads) + f"{'busy':>7}{'GIL':>6}")
        print(f"{'':48}" + "".join(f"{h:>9}" for h in heads2) + f"{'kept':>7}{'rets':>6}")
        at = 0
        for group in groups:
            baseline: float | None = None
            for name, _ in group:
                alone, thread, process, kept, returns = (
                    statistics.median(column) for column in zip(*samples[at], strict=True)
                )
                at += 1
                baseline = baseline or alone
                cells = (
                    alone,
                    thread,
                    process,
                    thread / alone,
                    process / alone,
                    thread / process,
                    alone / baseline,
                )
                print(
                    f"{name:48}"
                    + "".join(f"{c:9.2f}" for c in cells)
                    + f"{kept:7.2f}{returns:6.0f}",
                    flush=True,
                )
        sock.sendall(_REQUEST.pack(0, 0))
        sock.close()
    finally:
        child.wait(timeout=30)


if __name__ == "__main__":
    main()
