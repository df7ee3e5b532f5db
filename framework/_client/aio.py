"""``AsyncStore``: the store for asyncio engines, never blocking their event loop.

Every call runs the synchronous store on a small thread pool: index round trips, transfers
and CRC checks release the GIL while they wait or move bytes, so the event loop keeps
running while a large batch lands.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvfabric._client.store import PutOutcome, Store

__all__ = ["AsyncStore"]

T = TypeVar("T")


class AsyncStore:
    """Awaitable twin of :class:`~kvfabric.store.Store`; create it with ``connect_async``."""

    def __init__(self, store: Store, *, workers: int = 4) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvfabric-aio")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def batched_contains(self, keys: Sequence[bytes]) -> int:
        return await self._run(self.store.batched_contains, keys)

    async def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._run(self.store.batched_exists, keys)

    async def batched_get(
        self, keys: Sequence[bytes], into: Sequence[Any] | None = None
    ) -> list[memoryview | None]:
        return await self._run(self.store.batched_get, keys, into)

    async def batched_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[PutOutcome]:
        return await self._run(self.store.batched_put, keys, values)

    async def delete(self, keys: Sequence[bytes]) -> int:
        return await self._run(self.store.delete, keys)

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    async def close(self) -> None:
        await self._run(self.store.close)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
