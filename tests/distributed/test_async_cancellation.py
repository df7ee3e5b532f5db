"""A cancelled or timed-out AsyncStore call never touches the caller's buffers afterwards.

The controller process is frozen (SIGSTOP) so that the call is certainly in flight, blocked
in its index round trip, when it is cancelled; it is resumed (SIGCONT) only after the
cancellation was delivered. Whatever the call does once resumed must be over before the
await returns: afterwards the test reuses the buffer, and the store must never see the new
bytes, nor the buffer the landing of a read.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable, Iterator

import pytest

import kvfabric
from kvfabric import AsyncStore, PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_for


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm")) as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


async def _until(what: str, check: Callable[[], bool]) -> None:
    """:func:`wait_for` off the loop's thread: the loop runs the call awaited meanwhile."""
    await asyncio.to_thread(wait_for, what, check)


def _done(astore: AsyncStore, *counters: str) -> int:
    stats = astore.stats()
    return sum(stats[c] for c in counters)


def test_a_cancelled_get_never_writes_the_buffer_after_the_await_returned(
    cluster: Cluster,
) -> None:
    keys = _keys(1)
    value = os.urandom(1 << 20)
    with kvfabric.connect(cluster.url()) as writer:  # this client holds no descriptor
        assert writer.batched_put(keys, [value]) == [PutOutcome.STORED]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with await kvfabric.connect_async(cluster.url(control_timeout="30s")) as astore:
            buffer = bytearray(len(value))
            cluster.signal_controller(signal.SIGSTOP)
            try:
                task = asyncio.create_task(astore.batched_get(keys, into=[buffer]))
                await _until("the get in its resolve call", lambda: astore.stats()["gets"] == 1)
                task.cancel()
                # The controller answers a while after the cancel: the call stays in
                # flight meanwhile, which is what the await must outlast.
                loop.call_later(0.2, cluster.signal_controller, signal.SIGCONT)
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                cluster.signal_controller(signal.SIGCONT)
            # The await returned only after the read was over: it landed, and is done.
            assert _done(astore, "get_hits", "get_misses") == 1
            assert bytes(buffer) == value
            buffer[:] = bytes(len(buffer))  # the caller reuses its buffer
            await _until("the get done", lambda: _done(astore, "get_hits", "get_misses") == 1)
            await astore.batched_contains([])  # a full round through the worker pool
        assert bytes(buffer) == bytes(len(buffer))

    asyncio.run(scenario())


def test_a_timed_out_put_never_stores_bytes_written_after_the_await_returned(
    cluster: Cluster,
) -> None:
    keys = _keys(1)
    original = os.urandom(1 << 20)
    refill = os.urandom(1 << 20)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with await kvfabric.connect_async(cluster.url(control_timeout="30s")) as astore:
            buffer = bytearray(original)
            armed: asyncio.Future[asyncio.Timeout] = loop.create_future()

            async def put() -> list[PutOutcome]:
                async with asyncio.timeout(None) as deadline:
                    armed.set_result(deadline)
                    return await astore.batched_put(keys, [buffer])

            cluster.signal_controller(signal.SIGSTOP)
            try:
                task = asyncio.create_task(put())
                deadline = await armed
                await _until("the put in its allocate call", lambda: astore.stats()["puts"] == 1)
                deadline.reschedule(loop.time())  # time out now
                # As above: in flight a while after the timeout.
                loop.call_later(0.2, cluster.signal_controller, signal.SIGCONT)
                with pytest.raises(TimeoutError):
                    await task
            finally:
                cluster.signal_controller(signal.SIGCONT)
            assert _done(astore, "stored", "put_failures") == 1
            buffer[:] = refill  # the caller reuses its buffer at once
            await astore.batched_contains([])
        with kvfabric.connect(cluster.url()) as reader:
            (got,) = reader.batched_get(keys)
        assert got is not None
        assert bytes(got) == original

    asyncio.run(scenario())
