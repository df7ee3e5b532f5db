"""``AsyncStore`` mirrors ``Store``: every public method, awaitable where it may wait."""

from __future__ import annotations

import asyncio
import inspect
import uuid

import kvfabric
from kvfabric import AsyncStore, PutOutcome, Store
from kvfabric.keys import chain_keys

# Methods that only touch local memory stay plain calls; everything else is awaited.
_LOCAL = {
    "prefetched",
    "remember",
    "stats",
    "records",
    "learned_nodes",
    "controller_restarted",
    "membership_changed",
}


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def test_async_store_has_every_public_method_of_store() -> None:
    public = {name for name in dir(Store) if not name.startswith("_")}
    assert public - set(dir(AsyncStore)) == set()
    for name in public - _LOCAL:
        assert inspect.iscoroutinefunction(getattr(AsyncStore, name)), name
    for name in _LOCAL - {"records", "learned_nodes"}:
        assert not inspect.iscoroutinefunction(getattr(AsyncStore, name)), name


def test_every_async_method_does_what_the_store_does() -> None:
    async def scenario() -> None:
        async with await kvfabric.connect_async("embedded://?capacity=4MiB") as astore:
            keys = _keys(3)
            values = [b"a" * 4096, b"b" * 4096, b"c" * 4096]
            assert await astore.batched_put(keys, values) == [PutOutcome.STORED] * 3
            assert await astore.ping() is True
            located = await astore.locate(keys)
            assert all(d is not None for d in located)
            assert await astore.batched_contains(keys) == 3
            handed = [d for d in astore.prefetched(keys) if d is not None]
            assert handed == located
            astore.remember(handed)
            pages = [[bytearray(1024) for _ in range(4)] for _ in keys]
            assert await astore.batched_get_scattered(keys, pages) == [True] * 3
            assert [b"".join(p) for p in pages] == values
            assert await astore.batched_exists(keys) == [True] * 3
            assert await astore.delete(keys[:1]) == 1
            got = await astore.batched_get(keys)
            assert [bytes(g) if g is not None else None for g in got] == [None, *values[1:]]
            assert astore.stats()["get_hits"] == 3 + 2
            assert astore.records.transport_of(handed[0].node) == "shm"

    asyncio.run(scenario())
