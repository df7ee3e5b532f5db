"""Batches of any size: how a control request is cut into chunks and timed, the wire forms
that carry a client's id and an abort's answer, and a put of 100,000 keys in
``embedded://``."""

from __future__ import annotations

import math
import uuid
from collections import Counter

import kvfabric
from kvfabric import PutOutcome
from kvfabric._client.writes import PUT_ROUND_KEYS
from kvfabric._control.session import (
    CHUNK_BYTES,
    CHUNK_KEYS,
    PER_ITEM_ALLOWANCE,
    allowance,
    chunks,
)
from kvfabric._runtime.codec import Reader
from kvfabric._wire import protocol as p
from kvfabric._wire import write_bodies as wb
from kvfabric.keys import KEY_SIZE, chain_keys


def test_chunks_cover_every_item_once_bounded_by_count_and_bytes() -> None:
    for count, size in [(0, 32), (1, 32), (CHUNK_KEYS, 32), (CHUNK_KEYS + 1, 32), (100_000, 64)]:
        ranges = chunks(count, size)
        assert [i for r in ranges for i in r] == list(range(count))
        assert all(len(r) <= CHUNK_KEYS and len(r) * size <= CHUNK_BYTES for r in ranges)
    # Large items: the byte bound cuts first; an item larger than the bound goes alone.
    assert max(len(r) for r in chunks(10_000, 1024)) == CHUNK_BYTES // 1024
    assert [len(r) for r in chunks(3, CHUNK_BYTES * 2)] == [1, 1, 1]
    # A chunk's frame is far below the controller's default --max-frame.
    assert CHUNK_KEYS * wb.CARVED_SIZE <= CHUNK_BYTES < (4 << 20) // 8


def test_a_deadline_grows_with_the_work() -> None:
    assert allowance(0, 1.0) == 1.0
    assert math.isclose(allowance(100_000, 1.0), 1.0 + 100_000 * PER_ITEM_ALLOWANCE)


def test_a_client_id_heads_the_requests_that_reserve() -> None:
    body = p.write_client(0xDEADBEEF) + p.write_keys([bytes(KEY_SIZE)])
    r = Reader(body)
    assert p.read_client(r) == 0xDEADBEEF
    assert p.read_keys(r) == [bytes(KEY_SIZE)]
    r.end()


def test_a_put_of_100k_keys_in_embedded_mode_is_stored_and_readable() -> None:
    n = 100_000
    keys = chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)
    values = [key[:16] * 4 for key in keys]
    with kvfabric.connect(f"embedded://{uuid.uuid4().hex[:8]}?capacity=256MiB") as store:
        assert Counter(store.batched_put(keys, values)) == {PutOutcome.STORED: n}
        # Rounds of PUT_ROUND_KEYS, each a bounded number of index calls.
        assert store.stats()["control_rpcs"] <= 3 * math.ceil(n / PUT_ROUND_KEYS)
        assert store.batched_contains(keys) == n
        got = store.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == values
        assert store.delete(keys) == n
