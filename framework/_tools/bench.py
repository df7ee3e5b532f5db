"""``kvfabric bench``: kvfabric against the floors and against Redis, in one process tree.

For chunks of 256 KiB and of 4 MiB (64 per batch) it times, as medians of several runs:

- floors: a memcpy of the same bytes (numpy, distinct sources), a raw Python socket
  streaming the same bytes from another process into a preallocated buffer, and a raw small
  round trip (2 KiB request, 64-byte reply) to that process;
- kvfabric over ``tcp`` and over ``shm`` (and over ``ucx``, as ``UCX_TLS`` says, where its
  library is installed) against a real controller and data node: put, contains, get
  (descriptors prefetched by the contains), naive per-key exists+get, re-put;
- Redis (a ``redis-server`` started here, persistence off, redis-py with hiredis,
  pipelined): SET, EXISTS, GET, per-key EXISTS+GET, SET again.

It prints one table of medians, GB/s and ratios, then the targets with the measured ratios.
Nothing here is asserted: timings belong in a table, not in a test.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import numpy as np

import kvfabric
from kvfabric._tools.cluster import Cluster, free_port
from kvfabric.errors import ConfigError, PluginError
from kvfabric.keys import chain_keys
from kvfabric.spi.plugins import plugin_manager
from kvfabric.spi.units import format_size

__all__ = ["BenchRow", "run_bench"]

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


@attrs.frozen
class BenchRow:
    system: str
    phase: str
    size: int
    count: int
    seconds: float
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.size * self.count / self.seconds / 1e9


def _median(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    samples = []
    for n in range(repeat + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if n:  # the first run warms caches, connections and page tables
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


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


def _floors(count: int, size: int, repeat: int) -> list[BenchRow]:
    rows = []
    sources = [
        np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)
    ]
    dests = [np.empty(size, dtype=np.uint8) for _ in range(count)]

    def memcpy() -> None:
        for src, dst in zip(sources, dests, strict=True):
            np.copyto(dst, src)

    rows.append(BenchRow("memcpy", "copy", size, count, _median(memcpy, repeat)))
    target = np.empty(size * count, dtype=np.uint8).data
    with _floor_server(size) as conn:
        import struct

        def stream() -> None:
            conn.sendall(struct.pack("<QQ", size * count, 0))
            got = 0
            while got < len(target):
                got += conn.recv_into(target[got:])

        request = struct.pack("<QQ", 64, 2048) + bytes(2048)
        reply = bytearray(64)

        def round_trip() -> None:
            conn.sendall(request)
            got = 0
            while got < 64:
                got += conn.recv_into(memoryview(reply)[got:])

        rows.append(BenchRow("raw socket", "stream", size, count, _median(stream, repeat)))
        rtt = _median(round_trip, max(repeat, 50))
        rows.append(BenchRow("raw socket", "small RTT", 2048, 1, rtt, "2 KiB out, 64 B back"))
    rows.append(_zmq_round_trip(max(repeat, 50)))
    return rows


def _zmq_round_trip(repeat: int) -> BenchRow:
    """The same small round trip through ZeroMQ (DEALER to ROUTER): the control plane's floor."""
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

        seconds = _median(round_trip, repeat)
    finally:
        sock.close(linger=0)
        proc.kill()
        proc.wait()
    return BenchRow("zeromq", "small RTT", 2048, 1, seconds, "2 KiB out, 64 B back")


def _kvfabric(
    cluster: Cluster, transport: str, count: int, size: int, repeat: int
) -> list[BenchRow]:
    system = f"kvfabric {transport}"
    values = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]
    dests = [np.empty(size, dtype=np.uint8) for _ in range(count)]
    rows = []
    with (
        kvfabric.connect(cluster.url(transport=transport)) as store,
        kvfabric.connect(cluster.url(transport=transport, prefetch_entries="0")) as naive_store,
    ):
        batches: list[list[bytes]] = []

        def fresh_keys() -> None:
            # Each timed put stores new keys; the previous batch is deleted (untimed) so
            # the node never fills up (the bench's controller reuses slots at once).
            if batches:
                store.delete(batches[-1])
            batches.append(chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes))

        def put() -> None:
            store.batched_put(batches[-1], values)

        rows.append(BenchRow(system, "put", size, count, _median(put, repeat, fresh_keys)))
        keys = batches[-1]
        rows.append(
            BenchRow(
                system,
                "contains",
                size,
                count,
                _median(lambda: store.batched_contains(keys), max(repeat, 50)),
            )
        )

        def get() -> None:
            got = store.batched_get(keys, into=dests)
            assert all(g is not None for g in got)

        rows.append(
            BenchRow(
                system,
                "get",
                size,
                count,
                _median(get, repeat, lambda: store.batched_contains(keys)),
            )
        )

        def naive() -> None:
            for key, dest in zip(keys, dests, strict=True):
                if naive_store.batched_exists([key])[0]:
                    naive_store.batched_get([key], into=[dest])

        rows.append(BenchRow(system, "naive exists+get", size, count, _median(naive, repeat)))
        rows.append(
            BenchRow(
                system,
                "re-put",
                size,
                count,
                _median(lambda: store.batched_put(keys, values), repeat),
            )
        )
        if store.stats()["validation_failures"]:
            raise RuntimeError("validation failures during the benchmark")
    return rows


def _check_redis() -> None:
    """Refuse at once, before minutes of measuring, if the Redis rows cannot run."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError(
            "the Redis rows need redis-py: pip install 'kvfabric[bench]' (from a clone: "
            "pip install '.[bench]'), or skip them with --no-redis"
        ) from None
    if shutil.which("redis-server") is None:
        raise ConfigError(
            "the Redis rows need redis-server on PATH (e.g. apt-get install redis-server), "
            "or skip them with --no-redis"
        )


@contextmanager
def _redis_server() -> Iterator[Any]:
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield client
            client.close()
        finally:
            proc.terminate()
            proc.wait()


def _redis(client: Any, count: int, size: int, repeat: int) -> list[BenchRow]:
    values = [
        np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
        for i in range(count)
    ]
    rows = []
    batches: list[list[bytes]] = []

    def fresh_keys() -> None:
        client.flushall()
        batches.append([uuid.uuid4().bytes for _ in range(count)])

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in zip(batches[-1], values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    rows.append(BenchRow("redis", "put", size, count, _median(put, repeat, fresh_keys)))
    keys = batches[-1]

    def contains() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        pipe.execute()

    def get() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        got = pipe.execute()
        assert all(g is not None for g in got)

    def naive() -> None:
        for key in keys:
            if client.exists(key):
                client.get(key)

    rows.append(BenchRow("redis", "contains", size, count, _median(contains, max(repeat, 50))))
    rows.append(BenchRow("redis", "get", size, count, _median(get, repeat)))
    rows.append(BenchRow("redis", "naive exists+get", size, count, _median(naive, repeat)))
    rows.append(BenchRow("redis", "re-put", size, count, _median(put, repeat)))
    return rows


def _bench_transports() -> tuple[str, ...]:
    """tcp and shm, plus ucx where its library loads (its rows follow UCX_TLS)."""
    try:
        plugin_manager().transport("ucx")
    except PluginError:
        return ("tcp", "shm")
    return ("tcp", "shm", "ucx")


def run_bench(
    sizes: tuple[int, ...] = (256 * 1024, 4 << 20),
    count: int = 64,
    repeat: int = 5,
    redis: bool = True,
    out: Any = sys.stdout,
) -> list[BenchRow]:
    if redis:
        _check_redis()
    rows: list[BenchRow] = []
    capacity = 4 * count * max(sizes) + (64 << 20)
    transports = _bench_transports()
    with Cluster(
        nodes=1,
        transports=transports,
        capacity=f"{capacity}",
        controller_args=["--grace", "0s"],
    ) as cluster:
        for size in sizes:
            rows += _floors(count, size, repeat)
            for transport in transports:
                rows += _kvfabric(cluster, transport, count, size, repeat)
    if redis:
        with _redis_server() as client:
            for size in sizes:
                rows += _redis(client, count, size, repeat)
    for size in sizes:
        _print_table(
            [r for r in rows if r.size == size or (r.phase == "small RTT")],
            size,
            count,
            repeat,
            out,
        )
    return rows


def _ucx_tls() -> str:
    return os.environ.get("UCX_TLS", "default")


def _find(rows: list[BenchRow], system: str, phase: str, size: int) -> BenchRow | None:
    for row in rows:
        if (
            row.system == system
            and row.phase == phase
            and (row.size == size or phase == "small RTT")
        ):
            return row
    return None


def _print_table(rows: list[BenchRow], size: int, count: int, repeat: int, out: Any) -> None:
    w = out.write
    w(f"\nkvfabric bench: {count} x {format_size(size)} per batch, median of {repeat} runs\n")
    w(f"{'system':<14} {'phase':<17} {'median ms':>10} {'GB/s':>7}  vs baseline\n")
    memcpy = _find(rows, "memcpy", "copy", size)
    stream = _find(rows, "raw socket", "stream", size)
    rtt = _find(rows, "raw socket", "small RTT", size)
    zrtt = _find(rows, "zeromq", "small RTT", size)
    redis_get = _find(rows, "redis", "get", size)
    tcp_get = _find(rows, "kvfabric tcp", "get", size)
    for row in rows:
        if row.phase == "small RTT" and row is not rtt and row is not zrtt:
            continue
        vs = ""
        if row.phase == "get" and row.system == "kvfabric tcp" and stream:
            vs = f"{stream.seconds / row.seconds:.2f}x raw socket"
            if redis_get:
                vs += f", {redis_get.seconds / row.seconds:.1f}x redis"
        elif row.phase == "get" and row.system == "kvfabric ucx" and memcpy and tcp_get:
            vs = (
                f"{memcpy.seconds / row.seconds:.2f}x memcpy, "
                f"{tcp_get.seconds / row.seconds:.2f}x kvfabric tcp (UCX_TLS={_ucx_tls()})"
            )
        elif row.phase == "get" and row.system == "kvfabric shm" and memcpy:
            vs = f"{memcpy.seconds / row.seconds:.2f}x memcpy (incl. validation)"
            if redis_get:
                vs += f", {redis_get.seconds / row.seconds:.1f}x redis"
        elif row.phase == "contains" and rtt:
            vs = f"{row.seconds / rtt.seconds:.2f}x a raw small round trip"
            if zrtt:
                vs += f", {row.seconds / zrtt.seconds:.2f}x a zeromq one"
        elif row.phase == "re-put":
            put = _find(rows, row.system, "put", size)
            if put:
                vs = f"{put.seconds / row.seconds:.1f}x faster than the first put"
        elif row.phase in ("naive exists+get",):
            get = _find(rows, row.system, "get", size)
            if get:
                vs = f"{row.seconds / get.seconds:.1f}x slower than batched get"
        elif row.note:
            vs = row.note
        gbps = (
            f"{row.gbps:7.2f}"
            if row.phase in ("copy", "stream", "put", "get", "re-put", "naive exists+get")
            else " " * 7
        )
        w(f"{row.system:<14} {row.phase:<17} {row.seconds * 1e3:>10.3f} {gbps}  {vs}\n")
    _print_targets(rows, size, out)


def _print_targets(rows: list[BenchRow], size: int, out: Any) -> None:
    def speedup(fast: BenchRow | None, slow: BenchRow | None) -> float | None:
        return None if fast is None or slow is None else slow.seconds / fast.seconds

    tcp_get = _find(rows, "kvfabric tcp", "get", size)
    shm_get = _find(rows, "kvfabric shm", "get", size)
    rtt = _find(rows, "raw socket", "small RTT", size)
    # (label, measured, goal, whether the measured value must be at least or at most the goal)
    checks: list[tuple[str, float | None, float, bool]] = [
        (
            "tcp get / raw socket",
            speedup(tcp_get, _find(rows, "raw socket", "stream", size)),
            0.8,
            True,
        ),
        ("tcp get / redis get", speedup(tcp_get, _find(rows, "redis", "get", size)), 2.0, True),
        ("shm get / memcpy", speedup(shm_get, _find(rows, "memcpy", "copy", size)), 0.6, True),
    ]
    ucx_get = _find(rows, "kvfabric ucx", "get", size)
    if ucx_get is not None:
        # One-sided over CMA (sm) the floor is memcpy; emulated over tcp it is our tcp.
        tls = _ucx_tls()
        if tls == "tcp":
            checks.append(("ucx(tcp) get / tcp get", speedup(ucx_get, tcp_get), 1.0, True))
        else:
            memcpy = _find(rows, "memcpy", "copy", size)
            checks.append((f"ucx({tls}) get / memcpy", speedup(ucx_get, memcpy), 0.6, True))
    for transport in ("tcp", "shm", "ucx"):
        if _find(rows, f"kvfabric {transport}", "get", size) is None:
            continue
        contains = _find(rows, f"kvfabric {transport}", "contains", size)
        checks.append((f"{transport} contains / raw RTT", speedup(rtt, contains), 2.0, False))
        put = _find(rows, f"kvfabric {transport}", "put", size)
        reput = _find(rows, f"kvfabric {transport}", "re-put", size)
        checks.append((f"{transport} re-put speed-up over put", speedup(reput, put), 50.0, True))
    out.write("targets:\n")
    for label, value, goal, at_least in checks:
        if value is None:
            out.write(f"  {label:<32} n/a\n")
            continue
        met = value >= goal if at_least else value <= goal
        sign = ">=" if at_least else "<="
        out.write(
            f"  {label:<32} {value:7.2f}  (goal {sign} {goal:g})  {'met' if met else 'BELOW'}\n"
        )
