"""Redis in ``kvfabric bench``: a ``redis-server`` started here on 127.0.0.1 with persistence
off, driven by redis-py with the hiredis parser, every phase one pipeline (SET, EXISTS, GET,
SET of the same keys again)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import GET_SAMPLES, LOOKUP_SAMPLES, Phase, median_seconds
from kvfabric._tools.local_cluster import free_port
from kvfabric.errors import ConfigError

__all__ = ["check_redis", "redis_rows"]


def check_redis() -> None:
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
                *("--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", workdir, "--daemonize", "no"),
                *("--protected-mode", "no"),
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


def redis_rows(sizes: tuple[int, ...], count: int, repeat: int) -> list[BenchRow]:
    rows: list[BenchRow] = []
    with _redis_server() as client:
        for size in sizes:
            rows += _rows(client, count, size, repeat)
    return rows


def _rows(client: Any, count: int, size: int, repeat: int) -> list[BenchRow]:
    values = [
        np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
        for i in range(count)
    ]
    batches: list[list[bytes]] = []

    def fresh_keys() -> None:
        client.flushall()
        batches.append([uuid.uuid4().bytes for _ in range(count)])

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for key, value in zip(batches[-1], values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def row(phase: str, seconds: float, n: int = count) -> BenchRow:
        return BenchRow(system="redis", phase=phase, size=size, count=n, seconds=seconds)

    rows = [row(Phase.PUT_FRESH, median_seconds(put, repeat, fresh_keys))]
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

    rows.append(row(Phase.CONTAINS, median_seconds(contains, max(repeat, LOOKUP_SAMPLES))))
    rows.append(row(Phase.GET, median_seconds(get, max(repeat, GET_SAMPLES))))
    rows.append(row(Phase.RE_PUT, median_seconds(put, repeat)))
    return rows
