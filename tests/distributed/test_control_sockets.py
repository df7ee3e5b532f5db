"""Resources a client holds: control sockets of finished threads, and stores once closed."""

from __future__ import annotations

import gc
import os
import threading
import uuid
import weakref
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric._control.client import IDLE_SOCKETS
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_for


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm")) as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_short_lived_threads_leave_no_control_sockets_behind(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(4)
        store.batched_put(keys, [b"x" * 100] * 4)
        assert store.batched_contains(keys) == 4
        before = _fds()
        found: list[int] = []
        threads = [
            threading.Thread(target=lambda: found.append(store.batched_contains(keys)))
            for _ in range(200)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert found == [4] * 200
        # Each idle socket holds two fds (its mailbox and its TCP connection).
        limit = 2 * IDLE_SOCKETS + 2
        # ZeroMQ closes sockets on its own thread: a moment after the threads end.
        extra = wait_for(
            "the extra fds closed", lambda: _fds() - before, until=lambda n: n <= limit
        )
        print(f"\n200 threads, one lookup each: {extra} extra fds (limit {limit})")
        assert extra <= limit


@pytest.mark.parametrize("deployment", ["remote", "embedded"])
def test_closed_stores_leave_nothing_behind(cluster: Cluster, deployment: str) -> None:
    # Small: each of the 30 embedded stores below makes (and prefaults) its own memory.
    embedded = f"embedded://{uuid.uuid4().hex[:8]}?capacity=16MiB"
    url = cluster.url() if deployment == "remote" else embedded
    keys = _keys(2)
    for _ in range(3):  # warm up: plugins loaded, ZeroMQ context started
        with kvfabric.connect(url) as store:
            store.batched_put(keys, [b"a", b"b"])
            store.batched_get(keys)
    gc.collect()
    fds, threads = _fds(), threading.active_count()
    refs = []
    for _ in range(30):
        store = kvfabric.connect(url)
        store.batched_put(keys, [b"a", b"b"])
        store.batched_contains(keys)
        store.batched_get(keys)
        store.close()
        refs.append(weakref.ref(store))
        del store
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    wait_for("the threads ended", threading.active_count, until=lambda n: n <= threads)
    wait_for("the fds closed", _fds, until=lambda n: n <= fds + 2)
