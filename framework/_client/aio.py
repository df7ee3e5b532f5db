"""``AsyncStore``: the store for asyncio engines, never blocking their event loop.

Every call that may wait (an index round trip, a transfer, a CRC pass) runs the synchronous
store on a small thread pool; those release the GIL while they wait or move bytes, so the
event loop keeps running while a large batch lands. Calls that only touch local memory
(``prefetched``, ``remember``, ``stats``) are plain methods.

Cancellation (a ``task.cancel()``, ``asyncio.timeout``, ``wait_for``): a call whose work has
not started yet is dropped at once. A call whose work is running is not abandoned: the
await returns only once the worker is done with the caller's buffers, then the cancellation
is raised as usual. So after any await returns — normally, by error or by cancellation —
kvfabric never reads or writes the buffers passed to it again: a refilled put buffer can
never be stored under the old key, and a get never lands in a buffer the caller reused.
The wait is bounded, because every step of a call is (``control_timeout`` per index round
trip, ``timeout`` per node transfer). Copying values before returning control would make
puts safe too, but would double the memory traffic of every put, and cannot protect a get
that lands in the caller's buffers without giving up zero-copy reads.

After ``os.fork()`` the child's first call makes a pool of its own (the inherited one's
threads stayed in the parent), and ``store`` builds its own parts (see ``Store``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvfabric._client.record_io import RecordIO
from kvfabric._client.store import PutOutcome, Store
from kvfabric._runtime import forks
from kvfabric.descriptor import Descriptor
from kvfabric.spi.events import EngineBlock

__all__ = ["AsyncStore"]

T = TypeVar("T")


class AsyncStore:
    """Awaitable twin of :class:`~kvfabric.Store`; create it with ``connect_async``.

    Same methods, same contract (see ``Store``); ``store`` is the synchronous store it runs.
    """

    def __init__(self, store: Store, *, workers: int = 4) -> None:
        self.store = store
        self._workers = workers
        self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        self._generation = forks.generation()
        return ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvfabric-aio")

    def _executor(self) -> ThreadPoolExecutor:
        """The pool of this process: one inherited through a fork has no threads left (and
        work submitted to it would never run), so a child gets its own."""
        if self._generation != forks.generation():
            with forks.rebuild_lock():
                if self._generation != forks.generation():
                    forks.abandon(self._pool)
                    self._pool = self._new_pool()
        return self._pool

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the pool; on cancellation, wait until it stopped touching buffers."""
        work = self._executor().submit(fn, *args)
        waiter = asyncio.wrap_future(work)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            if not work.cancel():  # already running: let it finish with the buffers
                await _settle(waiter)
            raise

    # -- lookups -----------------------------------------------------------------------

    async def batched_contains(self, keys: Sequence[bytes]) -> int:
        return await self._run(self.store.batched_contains, keys)

    async def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(self.store.batched_exists, keys)

    async def locate(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return await self._run(self.store.locate, keys)

    def prefetched(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return self.store.prefetched(keys)

    def remember(self, descriptors: Sequence[Descriptor]) -> None:
        self.store.remember(descriptors)

    # -- reads and writes --------------------------------------------------------------

    async def batched_get(
        self, keys: Sequence[bytes], into: Sequence[Any] | None = None
    ) -> list[memoryview | None]:
        return await self._run(self.store.batched_get, keys, into)

    async def batched_get_scattered(
        self, keys: Sequence[bytes], into: Sequence[Sequence[Any]]
    ) -> list[bool]:
        return await self._run(self.store.batched_get_scattered, keys, into)

    async def batched_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        blocks: Sequence[EngineBlock | None] | None = None,
    ) -> list[PutOutcome]:
        put = functools.partial(self.store.batched_put, blocks=blocks)
        return await self._run(put, keys, values)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(self.store.delete, keys)

    # -- the rest ----------------------------------------------------------------------

    async def ping(self) -> bool:
        return await self._run(self.store.ping)

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    @property
    def records(self) -> RecordIO:
        return self.store.records

    @property
    def learned_nodes(self) -> frozenset[tuple[int, int]] | None:
        return self.store.learned_nodes

    def controller_restarted(self, epoch: int) -> None:
        self.store.controller_restarted(epoch)

    def membership_changed(self, generation: int) -> None:
        self.store.membership_changed(generation)

    async def close(self) -> None:
        """Close the store once the calls in flight are done (off the event loop)."""
        await asyncio.to_thread(self._executor().shutdown, wait=True)
        await asyncio.to_thread(self.store.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _settle(waiter: asyncio.Future[Any]) -> None:
    """Wait until ``waiter`` is done, whatever cancellations arrive meanwhile."""
    while not waiter.done():
        try:
            await asyncio.wait({waiter})
        except asyncio.CancelledError:
            continue
    if not waiter.cancelled():
        waiter.exception()  # retrieved: the caller gets the cancellation instead
