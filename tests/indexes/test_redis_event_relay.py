"""The redis index's KV-event relay where it cannot know what it missed: entries trimmed
from an arena's stream before it read them, and a namespace's registry made afresh. It
tells ``cleared`` and goes on with what follows (one real redis-server; the relay's rounds
are run by the test)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from redis_servers import RedisDeployment

from kvfabric import EngineBlock
from kvfabric.indexes.redis import RedisIndex
from kvfabric.indexes.redis_events import EventRelay
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    IndexEvents,
    NodeInfo,
    RegionInfo,
)

pytestmark = pytest.mark.slow


class Told(IndexEvents):
    def __init__(self) -> None:
        self.told: list[tuple[str, object]] = []

    def stored(self, key: bytes, block: EngineBlock | None) -> None:
        self.told.append(("stored", block.hash if block is not None else key))

    def removed(self, key: bytes, engine_hash: bytes | int | None) -> None:
        self.told.append(("removed", engine_hash if engine_hash is not None else key))

    def cleared(self) -> None:
        self.told.append(("cleared", None))


@pytest.fixture
def index(redis_single: RedisDeployment) -> Iterator[RedisIndex]:
    namespace = f"r{uuid.uuid4().hex[:10]}"
    index = RedisIndex.create(
        IndexConfig(options={"url": redis_single.url, "namespace": namespace})
    )
    _register(index)
    try:
        yield index
    finally:
        index.purge()
        index.close()


def _register(index: RedisIndex) -> None:
    region = RegionInfo(id=0, size=64 << 20, rkey=7)
    index.register_node(NodeInfo(name="relay-test", regions=(region,), endpoints=()))


def _put(index: RedisIndex, key: bytes, block: EngineBlock | None = None) -> None:
    result = index.allocate([AllocationRequest(key=key, length=4096)])
    grants = [
        GrantRef.of(a.descriptor, 0)
        for a in result.allocations
        if a.kind is AllocationKind.GRANTED and a.descriptor is not None
    ]
    assert grants
    if block is None:
        assert index.publish(grants) == [True]
    else:
        assert index.publish_described(grants, {key: block}) == [True]


def _stream(index: RedisIndex, redis_single: RedisDeployment) -> bytes:
    client = redis_single.client(redis_single.servers[0].port)
    try:
        (stream,) = client.scan_iter(match=f"*{index.namespace}:a*:v")
        return bytes(stream)
    finally:
        client.close()


def test_entries_trimmed_before_the_relay_read_them_are_told_as_a_clear(
    index: RedisIndex, redis_single: RedisDeployment
) -> None:
    told = Told()
    relay = EventRelay(index._calls, index._view, told)
    a, b, c = (fold_key(i, b"relay") for i in range(3))
    _put(index, fold_key(9, b"relay"))  # before the relay asked: never told
    relay.round()  # asks every arena, and starts at its stream's end
    block = EngineBlock(hash=b"engine-a", token_ids=range(16), block_size=16)
    _put(index, a, block)
    relay.round()
    assert told.told == [("stored", b"engine-a")]
    # The removal of a block stored with an engine hash names that hash.
    assert index.unpublish([a]) == 1
    relay.round()
    assert told.told[1:] == [("removed", b"engine-a")]
    _put(index, b)
    _put(index, c)
    client = redis_single.client(redis_single.servers[0].port)
    try:
        # b's entry goes unread.
        client.xtrim(_stream(index, redis_single), maxlen=1, approximate=False)
    finally:
        client.close()
    relay.round()
    assert told.told[2:] == [("cleared", None), ("stored", c)]


def test_a_registry_made_afresh_is_told_as_a_clear(
    index: RedisIndex, redis_single: RedisDeployment
) -> None:
    told = Told()
    relay = EventRelay(index._calls, index._view, told)
    relay.round()
    # Every key of the namespace is lost (as when Redis restarts empty), then the node
    # registers again: a registry made afresh.
    client = redis_single.client(redis_single.servers[0].port)
    try:
        lost = list(client.scan_iter(match=f"*{index.namespace}*"))
        assert lost
        client.delete(*lost)
    finally:
        client.close()
    index._view.forget()
    _register(index)
    key = fold_key(1, b"afresh")
    _put(index, key)
    relay.round()  # the new registry: a clear, and its arenas read from their end
    _put(index, fold_key(2, b"afresh"))
    relay.round()
    assert told.told == [("cleared", None), ("stored", fold_key(2, b"afresh"))]
