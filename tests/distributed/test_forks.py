"""A ``kvfabric://`` store opened before a fork, used by the child: it works there, and the
parent keeps every record and keeps working.

Engines fork with a store open (vLLM's workers, gunicorn/uvicorn with preloading,
``multiprocessing``'s fork start method, a forking server). The child's first call makes its
own control sockets, transport connections and thread pools; it never uses the parent's, so
it never hangs on them and never interleaves with the parent's calls. Real processes: a
controller, two data nodes, and children forked four ways (``fork_children``); each child
is bounded, and one that hangs fails the test.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Iterator

import pytest
from fork_children import (
    MECHANISMS,
    ChildReport,
    check_child,
    holding_locks,
    in_children,
    parent_still_whole,
    round_trip,
)

import kvfabric
from kvfabric import AsyncStore, PutOutcome, Store
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits

# Generous: they bound a hang on a busy machine; each child has its own bound besides.
_TIMEOUTS = {"timeout": "30s", "control_timeout": "30s"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp", "shm")) as c:
        yield c


def _stored(store: Store, count: int = 256) -> tuple[list[bytes], list[bytes]]:
    keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
    values = [f"parent {i} ".encode().ljust(4096, b"p") for i in range(count)]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * count
    assert store.batched_contains(keys) == count
    assert exact_hits(store, keys, values) == count
    return keys, values


def _children_visible_to_parent(store: Store, reports: list[ChildReport]) -> None:
    """What the children stored in the shared store, the parent reads exactly."""
    for report in reports:
        keys = chain_keys(list(range(len(report.expected))), 1, namespace=report.namespace)
        assert exact_hits(store, keys, report.expected) == len(keys)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_store_forked_any_way_works_in_the_children_and_the_parent_loses_nothing(
    cluster: Cluster, transport: str, mechanism: str
) -> None:
    with kvfabric.connect(cluster.url(transport=transport, **_TIMEOUTS)) as store:
        keys, values = _stored(store)
        control = store._topology._calls.index
        assert isinstance(control, RemoteIndex)
        idle_before = set(map(id, control.client._idle))
        assert idle_before

        reports = in_children(mechanism, lambda: round_trip(store, keys), count=2)

        assert len({r.pid for r in reports}) == 2
        for report in reports:
            check_child(report, values)
            assert report.transports == [transport]
        parent_still_whole(store, keys, values)
        _children_visible_to_parent(store, reports)
        # The parent's control sockets are the ones it had: the children used their own.
        assert idle_before <= set(map(id, control.client._idle))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_fork_while_a_parent_thread_holds_the_stores_locks_does_not_deadlock_the_child(
    cluster: Cluster, transport: str
) -> None:
    with kvfabric.connect(cluster.url(transport=transport, **_TIMEOUTS)) as store:
        keys, values = _stored(store)
        with holding_locks(store) as held:
            # The store's, its prefetch cache's, counters', record I/O's, routes', transport
            # clients', control client's...: every one a call may be inside at the fork.
            assert held >= 8
            reports = in_children("os.fork", lambda: round_trip(store, keys), count=2)
        for report in reports:
            check_child(report, values)
        parent_still_whole(store, keys, values)


def test_forks_while_parent_threads_keep_calling_the_store(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp", **_TIMEOUTS)) as store:
        keys, values = _stored(store)
        stop = threading.Event()
        wrong: list[int] = []
        calls = [0, 0]

        def busy(worker: int) -> None:
            own = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
            mine = [f"busy {worker} {i}".encode() for i in range(16)]
            while not stop.is_set():
                store.batched_put(own, mine)
                store.batched_contains(own)
                for got, want in zip(store.batched_get(own), mine, strict=True):
                    if got is not None and bytes(got) != want:
                        wrong.append(worker)
                calls[worker] += 1

        threads = [threading.Thread(target=busy, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(5):
                for report in in_children("os.fork", lambda: round_trip(store, keys), count=2):
                    check_child(report, values)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert wrong == []
        assert min(calls) > 0
        parent_still_whole(store, keys, values)


def test_an_async_store_forked_runs_its_calls_on_a_pool_of_the_childs_own(
    cluster: Cluster,
) -> None:
    url = cluster.url(transport="tcp", **_TIMEOUTS)

    async def parent_puts() -> tuple[AsyncStore, list[bytes], list[bytes]]:
        astore = await kvfabric.connect_async(url)
        keys = chain_keys(list(range(64)), 1, namespace=uuid.uuid4().bytes)
        values = [b"async parent %d" % i for i in range(64)]
        assert await astore.batched_put(keys, values) == [PutOutcome.STORED] * 64
        assert await astore.batched_contains(keys) == 64
        return astore, keys, values

    astore, keys, values = asyncio.run(parent_puts())

    async def child() -> tuple[list[bytes | None], list[bytes | None], int]:
        own = chain_keys(list(range(8)), 1, namespace=uuid.uuid4().bytes)
        mine = [b"async child %d %d" % (os.getpid(), i) for i in range(8)]
        assert await astore.batched_put(own, mine) == [PutOutcome.STORED] * 8
        got = [None if g is None else bytes(g) for g in await astore.batched_get(own)]
        theirs = [None if g is None else bytes(g) for g in await astore.batched_get(keys)]
        assert got == mine
        return got, theirs, await astore.batched_contains(own)

    for mechanism in ("os.fork", "multiprocessing"):
        for _, theirs, found in in_children(mechanism, lambda: asyncio.run(child()), count=2):
            assert theirs == values
            assert found == 8

    async def parent_after() -> None:
        got = await astore.batched_get(keys)
        assert [None if g is None else bytes(g) for g in got] == values
        assert await astore.batched_put(keys[:1], values[:1]) == [PutOutcome.DEDUPLICATED]
        await astore.close()

    asyncio.run(parent_after())


def test_a_control_client_used_in_a_child_makes_its_own_sockets(cluster: Cluster) -> None:
    client = ControlClient(cluster.endpoint, timeout=30.0)
    index = RemoteIndex(client)
    try:
        before = {n.id for n in index.nodes()}
        assert len(before) == 2
        idle = list(client._idle)

        def child() -> set[int]:
            found = {n.id for n in index.nodes()}
            assert not set(map(id, idle)) & set(map(id, client._idle))
            return found

        for mechanism in ("os.fork", "forking-server"):
            assert in_children(mechanism, child, count=2) == [before, before]
        assert {n.id for n in index.nodes()} == before
        assert set(map(id, idle)) <= set(map(id, client._idle))
    finally:
        client.close()


def test_a_store_closed_in_a_child_leaves_the_parents_untouched(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp", **_TIMEOUTS)) as store:
        keys, values = _stored(store)

        def child() -> str:
            store.close()
            try:
                store.batched_get(keys[:1])
            except kvfabric.ControllerUnavailableError as exc:
                return str(exc)
            return "no error"

        assert in_children("os.fork", child, count=1) == ["this store is closed"]
        parent_still_whole(store, keys, values)
