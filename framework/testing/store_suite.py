"""Conformance tests every store deployment must pass, whatever its transport or backend."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric.errors import InvalidKeyError, ValueTooLargeError
from kvfabric.keys import chain_keys
from kvfabric.testing.hooks import corrupt_payload

__all__ = ["StoreConformance"]

MakeStore = Callable[[], Store]


def _values(keys: list[bytes], size: int) -> list[bytes]:
    """Distinct payloads derived from the keys (so a wrong key's bytes can never pass)."""
    return [np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size) for k in keys]


def _as_bytes(values: list[memoryview | None]) -> list[bytes | None]:
    return [bytes(v) if v is not None else None for v in values]


def _keys(n: int, salt: str = "") -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=(salt + uuid.uuid4().hex).encode())


class StoreConformance:
    """Mixin: override ``store_url`` with a URL several clients can share."""

    value_size = 4096

    @pytest.fixture
    def unique_name(self) -> str:
        return "t" + uuid.uuid4().hex[:12]

    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        pytest.fail("StoreConformance needs a store_url fixture that clients can share")

    @pytest.fixture
    def make_store(self, store_url: str) -> Iterator[MakeStore]:
        opened: list[Store] = []

        def make() -> Store:
            store = kvfabric.connect(store_url)
            opened.append(store)
            return store

        yield make
        for store in reversed(opened):
            store.close()

    @pytest.fixture
    def store(self, make_store: MakeStore) -> Store:
        return make_store()

    @pytest.fixture
    def corrupt(self) -> Callable[..., Any]:
        """Flip a stored payload byte; override for deployments whose nodes are elsewhere."""
        return corrupt_payload

    # -- round trips --------------------------------------------------------------------

    def test_put_then_get_round_trips(self, store: Store) -> None:
        keys = _keys(16)
        values = _values(keys, self.value_size)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 16
        got = store.batched_get(keys)
        assert _as_bytes(got) == values

    def test_values_of_many_sizes_round_trip(self, store: Store) -> None:
        sizes = [0, 1, 63, 64, 65, 4095, 100_000, 1 << 20]
        keys = _keys(len(sizes))
        values = [os.urandom(n) for n in sizes]
        store.batched_put(keys, values)
        got = store.batched_get(keys)
        assert _as_bytes(got) == values

    def test_absent_keys_read_as_none(self, store: Store) -> None:
        keys = _keys(4)
        store.batched_put(keys[:2], _values(keys[:2], 100))
        got = store.batched_get(keys)
        assert [g is not None for g in got] == [True, True, False, False]

    def test_get_into_caller_buffers_fills_them_in_place(self, store: Store) -> None:
        keys = _keys(8)
        values = _values(keys, self.value_size)
        store.batched_put(keys, values)
        buffers = [np.zeros(self.value_size, dtype=np.uint8) for _ in keys]
        got = store.batched_get(keys, into=buffers)
        for buf, view, value in zip(buffers, got, values, strict=True):
            assert buf.tobytes() == value
            assert view is not None
            assert bytes(view) == value

    def test_scattered_get_lands_a_value_across_several_buffers(self, store: Store) -> None:
        keys = _keys(3)
        values = _values(keys, 3 * 4096)
        store.batched_put(keys, values)
        pages = [[np.zeros(4096, dtype=np.uint8) for _ in range(3)] for _ in keys]
        before = store.stats()["payload_bytes_read"]
        assert store.batched_get_scattered(keys, pages) == [True, True, True]
        for value, parts in zip(values, pages, strict=True):
            assert b"".join(p.tobytes() for p in parts) == value
        assert store.stats()["payload_bytes_read"] - before == 3 * 3 * 4096

    def test_scattered_get_into_too_little_room_or_corrupt_data_is_false(
        self, store: Store, corrupt: Callable[..., Any]
    ) -> None:
        keys = _keys(2)
        store.batched_put(keys, _values(keys, 8192))
        corrupt(store, keys[1], 6000)  # lands in the second piece
        small = [[bytearray(4096)], [bytearray(4096), bytearray(4096)]]
        assert store.batched_get_scattered(keys, small) == [False, False]

    def test_a_value_given_as_pieces_is_stored_as_their_concatenation(self, store: Store) -> None:
        keys = _keys(2)
        first = [os.urandom(1000), os.urandom(5000), b""]
        second = np.arange(300, dtype=np.uint16)
        assert store.batched_put(keys, [first, [second]]) == [PutOutcome.STORED] * 2
        assert _as_bytes(store.batched_get(keys)) == [b"".join(first), second.tobytes()]
        assert store.stats()["payload_bytes_written"] >= 6600

    def test_ping_says_the_store_answers(self, store: Store) -> None:
        assert store.ping() is True

    def test_get_into_a_partly_used_larger_buffer_returns_the_value_length(
        self, store: Store
    ) -> None:
        keys = _keys(1)
        store.batched_put(keys, [b"short value"])
        buf = bytearray(1024)
        (view,) = store.batched_get(keys, into=[buf])
        assert view is not None
        assert bytes(view) == b"short value"
        assert buf[:11] == b"short value"

    def test_get_into_too_small_buffer_is_a_miss(self, store: Store) -> None:
        keys = _keys(1)
        store.batched_put(keys, [b"x" * 100])
        assert store.batched_get(keys, into=[bytearray(10)]) == [None]

    def test_exists_reports_each_key(self, store: Store) -> None:
        keys = _keys(6)
        store.batched_put([keys[1], keys[4]], _values([keys[1], keys[4]], 64))
        assert store.batched_exists(keys) == [False, True, False, False, True, False]

    def test_empty_batches_cost_nothing(self, store: Store) -> None:
        before = store.stats()["control_rpcs"]
        assert store.batched_contains([]) == 0
        assert store.batched_get([]) == []
        assert store.batched_put([], []) == []
        assert store.batched_exists([]) == []
        assert store.delete([]) == 0
        assert store.stats()["control_rpcs"] == before

    # -- round-trip counts -------------------------------------------------------------

    @pytest.mark.parametrize("n", [1, 64, 1024])
    def test_contains_then_get_of_prefetched_keys_is_one_rpc(self, store: Store, n: int) -> None:
        keys = _keys(n)
        values = _values(keys, 256)
        store.batched_put(keys, values)
        before = store.stats()
        assert store.batched_contains(keys) == n
        got = store.batched_get(keys)
        after = store.stats()
        # One control RPC; none when the index's lookup image answered the lookup.
        onesided = after["onesided_lookups"] - before["onesided_lookups"]
        assert after["control_rpcs"] - before["control_rpcs"] == 1 - onesided
        assert after["prefetch_hits"] - before["prefetch_hits"] == n
        assert _as_bytes(got) == values

    @pytest.mark.parametrize("n", [1, 64, 1024])
    def test_put_is_at_most_two_rpcs(self, store: Store, n: int) -> None:
        keys = _keys(n)
        before = store.stats()["control_rpcs"]
        store.batched_put(keys, _values(keys, 128))
        assert store.stats()["control_rpcs"] - before <= 2

    def test_reput_moves_no_payload_bytes(self, make_store: MakeStore) -> None:
        writer, other = make_store(), make_store()
        keys = _keys(32)
        values = _values(keys, self.value_size)
        writer.batched_put(keys, values)
        for client in (writer, other):
            before = client.stats()
            outcomes = client.batched_put(keys, values)
            after = client.stats()
            assert outcomes == [PutOutcome.DEDUPLICATED] * 32
            assert after["payload_bytes_written"] == before["payload_bytes_written"]
            assert after["dedup_hits"] - before["dedup_hits"] == 32
            assert after["control_rpcs"] - before["control_rpcs"] == 1

    def test_get_without_lookup_resolves_in_one_rpc(self, make_store: MakeStore) -> None:
        writer, reader = make_store(), make_store()
        keys = _keys(50)
        values = _values(keys, 512)
        writer.batched_put(keys, values)
        before = reader.stats()["control_rpcs"]
        got = reader.batched_get(keys)
        assert reader.stats()["control_rpcs"] - before == 1
        assert _as_bytes(got) == values

    def test_descriptors_handed_to_another_client_make_its_read_free(
        self, make_store: MakeStore
    ) -> None:
        looker, loader = make_store(), make_store()
        keys = _keys(16)
        values = _values(keys, self.value_size)
        looker.batched_put(keys, values)
        assert looker.batched_contains(keys) == 16
        handed = [d for d in looker.prefetched(keys) if d is not None]
        assert len(handed) == 16
        loader.remember(handed)
        before = loader.stats()["control_rpcs"]
        assert _as_bytes(loader.batched_get(keys)) == values
        assert loader.stats()["control_rpcs"] == before

    # -- prefixes, gaps, deletes -------------------------------------------------------

    @pytest.mark.parametrize("k", [0, 1, 7, 15])
    def test_gap_at_k_makes_contains_return_k(self, store: Store, k: int) -> None:
        keys = _keys(16)
        stored = keys[:k] + keys[k + 1 :]
        store.batched_put(stored, _values(stored, 64))
        assert store.batched_contains(keys) == k

    @pytest.mark.parametrize("k", [0, 5, 15])
    def test_delete_of_key_k_makes_contains_return_k(self, store: Store, k: int) -> None:
        keys = _keys(16)
        store.batched_put(keys, _values(keys, 64))
        assert store.batched_contains(keys) == 16
        assert store.delete([keys[k]]) == 1
        assert store.batched_contains(keys) == k

    def test_delete_by_another_client_wins_over_a_prefetched_descriptor(
        self, make_store: MakeStore
    ) -> None:
        reader, deleter = make_store(), make_store()
        keys = _keys(8)
        values = _values(keys, self.value_size)
        reader.batched_put(keys, values)
        assert reader.batched_contains(keys) == 8  # reader now holds all descriptors
        assert deleter.delete([keys[3]]) == 1
        # Someone else reuses space and writes new keys meanwhile.
        other = _keys(8)
        deleter.batched_put(other, _values(other, self.value_size))
        assert reader.batched_contains(keys) == 3
        got = reader.batched_get(keys)
        for value, expected in zip(got, values, strict=True):
            assert value is None or bytes(value) == expected

    def test_put_after_delete_stores_again(self, store: Store) -> None:
        keys = _keys(4)
        values = _values(keys, 300)
        store.batched_put(keys, values)
        store.delete(keys)
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 4
        assert store.batched_contains(keys) == 4
        assert _as_bytes(store.batched_get(keys)) == values

    # -- never a wrong value -----------------------------------------------------------

    def test_corrupted_record_reads_as_miss_and_is_counted(
        self, store: Store, corrupt: Callable[..., Any]
    ) -> None:
        keys = _keys(4)
        values = _values(keys, self.value_size)
        store.batched_put(keys, values)
        corrupt(store, keys[2])
        before = store.stats()["validation_failures"]
        assert store.batched_contains(keys) == 4
        got = store.batched_get(keys)
        assert got[2] is None
        assert _as_bytes(got) == [values[0], values[1], None, values[3]]
        assert store.stats()["validation_failures"] - before >= 1

    def test_bad_keys_are_refused(self, store: Store) -> None:
        for bad in (b"short", "a string of 32 characters!!!!!!!", b"x" * 33):
            with pytest.raises(InvalidKeyError):
                store.batched_contains([bad])  # type: ignore[list-item]
            with pytest.raises(InvalidKeyError):
                store.batched_put([bad], [b"v"])  # type: ignore[list-item]

    def test_oversize_value_is_refused_before_anything_moves(self, store_url: str) -> None:
        separator = "&" if "?" in store_url else "?"
        with kvfabric.connect(f"{store_url}{separator}max_value=1000") as small:
            keys = _keys(2)
            before = small.stats()
            with pytest.raises(ValueTooLargeError, match="max_value"):
                small.batched_put(keys, [b"fine", b"x" * 1001])
            assert small.stats()["control_rpcs"] == before["control_rpcs"]
            assert small.batched_contains(keys) == 0

    # -- concurrency and async ---------------------------------------------------------

    def test_threads_sharing_a_client_never_see_wrong_bytes(self, store: Store) -> None:
        keys = _keys(64)
        values = _values(keys, 2048)
        errors: list[str] = []

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                pick = sorted(rng.choice(64, 8, replace=False).tolist())
                ks = [keys[i] for i in pick]
                store.batched_put(ks, [values[i] for i in pick])
                store.batched_contains(ks)
                for i, got in zip(pick, store.batched_get(ks), strict=True):
                    if got is not None and bytes(got) != values[i]:
                        errors.append(f"key {i}: wrong bytes")
                if seed % 2:
                    store.delete(ks[:1])

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []

    def test_async_api_round_trips(self, store_url: str) -> None:
        async def scenario() -> tuple[int, list[bytes | None], list[bytes]]:
            async with await kvfabric.connect_async(store_url) as astore:
                keys = _keys(10)
                values = _values(keys, 1000)
                await astore.batched_put(keys, values)
                hits = await astore.batched_contains(keys)
                got = await astore.batched_get(keys)
                return hits, _as_bytes(got), values

        hits, got, values = asyncio.run(scenario())
        assert hits == 10
        assert got == values

    def test_event_loop_keeps_running_during_a_large_get(self, store_url: str) -> None:
        """The loop keeps ticking while 3 x 64 x 4 MiB land, and the get runs off its thread.

        Outcomes only, so a busy machine cannot fail it: the loop made progress while the
        gets were awaited, and the store touched the buffers from a thread other than the
        loop's. The loop's worst lag is printed, never compared with a time.
        """

        async def scenario() -> tuple[int, float, float, set[int], int]:
            async with await kvfabric.connect_async(store_url) as astore:
                keys = _keys(64)
                chunk = os.urandom(4 << 20)
                await astore.batched_put(keys, [chunk] * 64)
                await astore.batched_contains(keys)
                into = _ThreadSpy(bytearray(len(chunk)) for _ in keys)
                ticks = 0
                lag = 0.0
                done = asyncio.Event()

                async def ticker() -> None:
                    nonlocal ticks, lag
                    while not done.is_set():
                        t = time.perf_counter()
                        await asyncio.sleep(0.001)
                        lag = max(lag, time.perf_counter() - t - 0.001)
                        ticks += 1

                tick = asyncio.create_task(ticker())
                await asyncio.sleep(0.01)  # its first ticks (only those during the gets count)
                ticks_during = 0
                started = time.perf_counter()
                for _ in range(3):
                    before = ticks
                    got = await astore.batched_get(keys, into=into)
                    ticks_during += ticks - before
                    assert all(g is not None and bytes(g[:64]) == chunk[:64] for g in got)
                duration = time.perf_counter() - started
                done.set()
                await tick
                return ticks_during, lag, duration, into.threads, threading.get_ident()

        ticks, lag, duration, threads, loop_thread = asyncio.run(scenario())
        print(
            f"\nevent loop during 3 x 64 x 4 MiB get: {ticks} ticks, max lag "
            f"{lag * 1e3:.1f} ms over {duration * 1e3:.0f} ms"
        )
        assert ticks > 0
        assert threads
        assert loop_thread not in threads


class _ThreadSpy(list[Any]):
    """A list of buffers that records which threads read it."""

    def __init__(self, items: Iterable[Any]) -> None:
        super().__init__(items)
        self.threads: set[int] = set()

    def __len__(self) -> int:
        self.threads.add(threading.get_ident())
        return super().__len__()

    def __getitem__(self, index: Any) -> Any:
        self.threads.add(threading.get_ident())
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[Any]:
        self.threads.add(threading.get_ident())
        return super().__iter__()


class ReplicatedStoreConformance:
    """Mixin for deployments that keep ``replicas=2`` copies of each value on at least two
    data nodes: override ``store_url`` (the store suite passes there too; these add what
    replicas promise, counted)."""

    value_size = 4096

    @pytest.fixture
    def store_url(self) -> str:
        pytest.fail("ReplicatedStoreConformance needs a store_url with two copies per value")

    @pytest.fixture
    def store(self, store_url: str) -> Iterator[Store]:
        with kvfabric.connect(store_url) as store:
            yield store

    def test_a_put_writes_every_copy_in_at_most_two_rpcs(self, store: Store) -> None:
        keys = _keys(64)
        before = store.stats()
        assert store.batched_put(keys, _values(keys, self.value_size)) == [PutOutcome.STORED] * 64
        after = store.stats()
        assert after["control_rpcs"] - before["control_rpcs"] <= 2
        assert after["replica_writes"] - before["replica_writes"] == 64
        written = after["payload_bytes_written"] - before["payload_bytes_written"]
        assert written == 2 * 64 * self.value_size

    def test_a_reput_moves_no_bytes_and_a_lookup_then_get_reads_each_value_once(
        self, store: Store
    ) -> None:
        keys = _keys(32)
        values = _values(keys, self.value_size)
        store.batched_put(keys, values)
        before = store.stats()
        assert store.batched_put(keys, values) == [PutOutcome.DEDUPLICATED] * 32
        assert store.batched_contains(keys) == 32
        assert _as_bytes(store.batched_get(keys)) == values
        after = store.stats()
        assert after["payload_bytes_written"] == before["payload_bytes_written"]
        assert after["payload_bytes_read"] - before["payload_bytes_read"] == 32 * self.value_size
        assert after["replica_reads"] == before["replica_reads"]
        onesided = after["onesided_lookups"] - before["onesided_lookups"]
        assert after["control_rpcs"] - before["control_rpcs"] == 2 - onesided

    def test_a_corrupted_copy_is_read_from_the_other_in_the_same_get(
        self, store: Store, corrupt: Callable[..., Any]
    ) -> None:
        keys = _keys(4)
        values = _values(keys, self.value_size)
        store.batched_put(keys, values)
        corrupt(store, keys[1])
        assert store.batched_contains(keys) == 4
        before = store.stats()
        assert _as_bytes(store.batched_get(keys)) == values
        after = store.stats()
        assert after["validation_failures"] - before["validation_failures"] == 1
        assert after["replica_hits"] - before["replica_hits"] == 1
        # Reported: that copy goes, the key stays readable.
        assert after["invalid_reported"] - before["invalid_reported"] == 1
        assert _as_bytes(store.batched_get(keys[1:2])) == values[1:2]

    @pytest.fixture
    def corrupt(self) -> Callable[..., Any]:
        """Flip a stored payload byte of a key's first copy."""
        return corrupt_payload
