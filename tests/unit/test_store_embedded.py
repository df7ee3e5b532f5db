"""Store behaviour specific to embedded mode, and the exact counters."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric._plugins import PluginManager
from kvfabric._runtime.record import HEADER_SIZE, record_size
from kvfabric.errors import ConfigError
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.keys import chain_keys
from kvfabric.spi import AllocateResult, AllocationRequest, Extent, hookimpl
from kvfabric.testing import corrupt_payload


def _name() -> str:
    return "t" + uuid.uuid4().hex[:10]


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def test_slot_reused_after_eviction_never_serves_its_old_key() -> None:
    size = 8192
    capacity = 8 * record_size(size)
    url = f"embedded://{_name()}?capacity={capacity}&grace=0&headroom=0"
    with kvfabric.connect(url) as reader, kvfabric.connect(url) as writer:
        old = _keys(1)
        reader.batched_put(old, [b"A" * size])
        assert reader.batched_contains(old) == 1  # reader holds old's descriptor
        newer = _keys(8)
        outcomes = writer.batched_put(newer, [bytes([n]) * size for n in range(8)])
        assert outcomes == [PutOutcome.STORED] * 8
        assert writer.stats()["evictions"] >= 1
        assert writer.batched_contains(old) == 0  # evicted
        before = reader.stats()["validation_failures"]
        assert reader.batched_get(old) == [None]  # its slot now holds another key
        assert reader.stats()["validation_failures"] - before == 1
        got = writer.batched_get(newer)
        assert [bytes(g) if g is not None else None for g in got] == [
            bytes([n]) * size for n in range(8)
        ]


def test_value_larger_than_the_store_is_no_space_not_an_error() -> None:
    with kvfabric.connect("embedded://?capacity=64KiB") as store:
        assert store.batched_put(_keys(1), [b"x" * 100_000]) == [PutOutcome.NO_SPACE]
        assert store.stats()["no_space"] == 1


def test_byte_counters_are_exact() -> None:
    with kvfabric.connect("embedded://") as store:
        keys = _keys(10)
        values = [b"v" * (100 * (i + 1)) for i in range(10)]
        store.batched_put(keys, values)
        store.batched_contains(keys)
        store.batched_get(keys)
        stats = store.stats()
        total = sum(len(v) for v in values)
        assert stats["payload_bytes_written"] == total
        assert stats["payload_bytes_read"] == total
        assert stats["stored"] == 10
        assert stats["prefix_hits"] == 10
        assert stats["get_hits"] == 10


def test_clients_sharing_a_name_must_agree_on_the_store() -> None:
    name = _name()
    with kvfabric.connect(f"embedded://{name}?capacity=1MiB"):
        with pytest.raises(ConfigError, match="already open"):
            kvfabric.connect(f"embedded://{name}?capacity=2MiB")
        # Client-side options may differ.
        with kvfabric.connect(f"embedded://{name}?capacity=1MiB&timeout=1s") as other:
            assert other.batched_contains(_keys(1)) == 0


def test_a_shared_store_lives_until_its_last_client_closes() -> None:
    name = _name()
    first = kvfabric.connect(f"embedded://{name}")
    second = kvfabric.connect(f"embedded://{name}")
    keys = _keys(2)
    first.batched_put(keys, [b"a", b"b"])
    first.close()
    assert second.batched_contains(keys) == 2
    second.close()
    with kvfabric.connect(f"embedded://{name}") as fresh:
        assert fresh.batched_contains(keys) == 0


def test_into_must_match_keys() -> None:
    with kvfabric.connect() as store, pytest.raises(ValueError, match="buffers for"):
        store.batched_get(_keys(2), into=[bytearray(1)])


class _Observer:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.configs: list[Mapping[str, Any]] = []
        self.seen = threading.Event()

    @hookimpl
    def kvfabric_lookup_done(self, keys: Sequence[bytes], hits: int) -> None:
        self.calls.append((len(keys), hits))
        self.seen.set()

    @hookimpl
    def kvfabric_configure(self, config: Mapping[str, Any]) -> None:
        self.configs.append(config)


def test_plugins_observe_lookups_and_configuration() -> None:
    plugins = PluginManager()
    observer = _Observer()
    plugins.register(observer, name="observer")
    with kvfabric.connect("embedded://?capacity=1MiB", plugins=plugins) as store:
        keys = _keys(3)
        store.batched_put(keys[:2], [b"a", b"b"])
        assert store.batched_contains(keys) == 2
        assert observer.seen.wait(5)
    assert observer.calls == [(3, 2)]
    assert observer.configs[0]["capacity"] == 1 << 20


def test_locate_is_one_counted_rpc_and_leaves_the_prefetch_cache_alone() -> None:
    with kvfabric.connect("embedded://?capacity=1MiB") as store:
        keys = _keys(3)
        store.batched_put(keys[:2], [b"a" * 10, b"b" * 20])
        before = store.stats()["control_rpcs"]
        located = store.locate(keys)
        assert store.stats()["control_rpcs"] - before == 1
        assert [d.length if d else None for d in located] == [10, 20, None]
        assert store.prefetched(keys) == [None, None, None]


def test_raw_slot_access_stays_inside_the_record() -> None:
    with kvfabric.connect("embedded://?capacity=1MiB") as store:
        keys = _keys(1)
        store.batched_put(keys, [b"payload!"])
        (d,) = store.locate(keys)
        assert d is not None
        raw = bytearray(HEADER_SIZE + 8)
        store.records.read_slot(d, 0, raw)
        assert raw[HEADER_SIZE:] == b"payload!"
        with pytest.raises(ValueError, match="outside a record"):
            store.records.read_slot(d, 1, bytearray(HEADER_SIZE + 8))
        with pytest.raises(ValueError, match="outside a record"):
            store.records.write_slot(d, -1, b"x")


def test_a_corrupt_record_in_a_pipelined_batch_is_the_only_miss() -> None:
    # 48 x 1 MiB is read in two groups (32 MiB each), validated while the next one lands.
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys = _keys(48)
        values = [os.urandom(1 << 20) for _ in keys]
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 48
        corrupt_payload(store, keys[40], at=12345)
        assert store.batched_contains(keys) == 48
        before = store.stats()
        got = store.batched_get(keys, into=[bytearray(1 << 20) for _ in keys])
        after = store.stats()
        assert [bytes(g) if g is not None else None for g in got] == [
            *values[:40],
            None,
            *values[41:],
        ]
        assert after["validation_failures"] - before["validation_failures"] == 1
        assert after["payload_bytes_read"] - before["payload_bytes_read"] == 48 << 20


class _PausedWriterIndex(MemoryIndex):
    """The memory index, answering allocate only after most of the lease has gone by.

    Stands in for a writer held up between its allocate and its writes (paused, swapped
    out): the store must then give the grants up rather than write into slots whose lease
    may have run out.
    """

    name = "paused"

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        result = super().allocate(requests)
        time.sleep(result.lease * 0.6)  # the pause under test: most of the lease gone by
        return result

    def lease_extents(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int] = (),
        returned: Sequence[int] = (),
    ) -> list[Extent]:
        extents = super().lease_extents(need, want, count, exclude, returned)
        if extents:
            time.sleep(extents[0].lease * 0.6)  # the pause under test, as in allocate
        return extents


class _PausedWriterPlugin:
    @hookimpl
    def kvfabric_register_indexes(self, registry: Any) -> None:
        registry.add("paused", _PausedWriterIndex)


@pytest.mark.parametrize("extents", [True, False], ids=["extent", "allocate"])
def test_a_writer_held_up_past_half_its_lease_writes_nothing(extents: bool) -> None:
    plugins = PluginManager()
    plugins.register(_PausedWriterPlugin(), name="paused-writer")
    url = f"embedded://{uuid.uuid4().hex}?index=paused&lease=500ms&extents={int(extents)}"
    with kvfabric.connect(url, plugins=plugins) as store:
        keys = chain_keys(list(range(4)), 1, namespace=b"late")
        assert store.batched_put(keys, [b"late bytes"] * 4) == [PutOutcome.FAILED] * 4
        stats = store.stats()
        assert stats["late_writes_avoided"] == 4
        assert stats["payload_bytes_written"] == 0
        assert store.batched_contains(keys) == 0
