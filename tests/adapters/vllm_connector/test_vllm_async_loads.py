"""The vLLM connector's asynchronous loads, without an engine: deadlines and late data.

:class:`AsyncLoads` against an embedded kvfabric store whose reads can be held at a gate
(a frozen data node, as the loader thread sees it), on a clock the test moves: whether a
load is past its deadline never depends on how fast this machine is. Pages are real paged
caches shaped as vLLM's CPU worker lays them out (``test_vllm_worker``'s helpers).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    # vllm.v1: a plain "vllm" would import this directory's vllm/ (the engine helper) as a
    # namespace package where vLLM is not installed.
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

import torch
from test_vllm_worker import HASHES, KEYSPACE, NUM_BLOCKS, paged_cache

import kvfabric
from kvfabric.adapters.vllm_loads import LOAD_COUNTERS, AsyncLoads
from kvfabric.adapters.vllm_metadata import Transfer
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.adapters.vllm_stats import IntervalStats
from kvfabric.spi import Counters
from kvfabric.testing import wait_for

LAYOUT = "device=cpu,test;layers"
OTHER_HASHES = tuple(bytes([0x80 + i]) * 32 for i in range(4))


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GatedStore:
    """A store whose reads of ``gated`` keys wait at a gate (a frozen node, as seen by the
    reading thread), then land as usual; every other call goes straight to ``store``."""

    def __init__(self, store: kvfabric.Store, gated: Sequence[bytes]) -> None:
        self.store = store
        self.gated = set(gated)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batched_get(self, keys: Sequence[bytes], into: Any = None) -> Any:
        if self.gated.intersection(keys):
            self.entered.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self.store.batched_get(keys, into)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def keys_of(transfer: Transfer) -> list[bytes]:
    return KEYSPACE.keys(transfer.block_hashes, rank=(0, 0), layout=LAYOUT, cache_salt=None)


def transfer(req_id: str, block_ids: tuple[int, ...], hashes: Sequence[bytes]) -> Transfer:
    return Transfer(req_id=req_id, cache_salt=None, block_hashes=tuple(hashes), block_ids=block_ids)


class Loads:
    """An ``AsyncLoads`` over its own zeroed paged cache, reading a store that holds
    ``HASHES`` and ``OTHER_HASHES`` (values of another cache); reads of ``HASHES`` are gated."""

    def __init__(self, timeout: float = 1.0) -> None:
        url = f"embedded://loads-{uuid.uuid4().hex[:8]}"
        self.source_caches = paged_cache(seed=1)
        source = PagedKV(self.source_caches, NUM_BLOCKS)
        self.writer = kvfabric.connect(url)
        hashes = HASHES + OTHER_HASHES
        values = source.new_values(len(hashes))
        source.gather(list(range(len(hashes))), values)
        self.writer.batched_put(keys_of(transfer("w", (), hashes)), [row.numpy() for row in values])
        self.caches = paged_cache(seed=None)
        self.pages = PagedKV(self.caches, NUM_BLOCKS)
        self.store = GatedStore(kvfabric.connect(url), keys_of(transfer("g", (), HASHES)))
        self.clock = Clock()
        self.counters = Counters(LOAD_COUNTERS)
        self.loads = AsyncLoads(
            store=self.store,  # type: ignore[arg-type]
            pages=self.pages,
            rank=(0, 0),
            keys_of=keys_of,
            counters=self.counters,
            stats=IntervalStats(self.counters),
            timeout=timeout,
            clock=self.clock,
        )

    def source_block(self, i: int) -> list[torch.Tensor]:
        return [cache[i] for cache in self.source_caches.values()]

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [cache[block_id].clone() for cache in self.caches.values()]

    def poll_until(self, req_id: str, ended: Sequence[str] = ()) -> set[int]:
        """Poll as vLLM does each step until ``req_id`` is reported; the failed blocks."""
        errors: set[int] = set()
        done: set[str] = set()

        def reported() -> bool:
            finished, failed = self.loads.poll(ended)
            done.update(finished)
            errors.update(failed)
            return req_id in done

        wait_for(f"load of {req_id} reported", reported)
        return errors

    def close(self) -> None:
        self.store.gate.set()
        self.loads.close()
        self.store.store.close()
        self.writer.close()


@pytest.fixture
def loads() -> Iterator[Loads]:
    made = Loads()
    yield made
    made.close()


def test_a_load_past_its_deadline_is_all_errors_and_its_late_data_never_reaches_the_pages(
    loads: Loads,
) -> None:
    loads.loads.submit(transfer("frozen", (4, 5, 6, 7), HASHES))
    assert loads.store.entered.wait(30)  # the read is under way, held at the gate
    assert loads.loads.poll() == (set(), set())  # not done, not due
    loads.clock.now += 1.0  # the deadline
    assert loads.poll_until("frozen") == {4, 5, 6, 7}
    assert loads.loads.in_flight == 0
    counters = loads.counters.snapshot()
    assert (counters["load_timeouts"], counters["load_errors"]) == (1, 4)
    assert counters["loaded_blocks"] == 0

    # vLLM recomputes into those pages (or hands them to another request) ...
    for cache in loads.caches.values():
        cache[4:8].fill_(7.0)
    # ... and then the frozen node wakes up: its values land, but not in the pages.
    loads.store.gate.set()
    wait_for("the late read returned", lambda: loads.counters.snapshot()["late_loads"] == 1)
    for block_id in (4, 5, 6, 7):
        assert all(bool((page == 7.0).all()) for page in loads.block(block_id))


def test_other_loads_finish_while_one_is_held_and_it_lands_intact_within_its_deadline(
    loads: Loads,
) -> None:
    loads.loads.submit(transfer("held", (0, 1, 2, 3), HASHES))
    assert loads.store.entered.wait(30)
    loads.loads.submit(transfer("free", (4, 5, 6, 7), OTHER_HASHES))
    assert loads.poll_until("free") == set()
    assert loads.loads.in_flight == 1  # "held" is still loading: it never held "free" up

    loads.store.gate.set()  # the node answers, before the deadline
    assert loads.poll_until("held") == set()
    for i, block_id in enumerate((0, 1, 2, 3, 4, 5, 6, 7)):
        for ours, theirs in zip(loads.block(block_id), loads.source_block(i), strict=True):
            assert torch.equal(ours, theirs)
    counters = loads.counters.snapshot()
    assert (counters["loaded_blocks"], counters["load_errors"]) == (8, 0)
    assert (counters["load_timeouts"], counters["late_loads"]) == (0, 0)


def test_a_load_of_a_request_vllm_ended_is_reported_at_once_and_lands_nowhere(
    loads: Loads,
) -> None:
    loads.loads.submit(transfer("aborted", (0, 1, 2, 3), HASHES))
    assert loads.store.entered.wait(30)
    # vLLM finished the request (an abort) while it loaded: it frees the blocks once the
    # load is reported, so report it now, without load errors.
    assert loads.poll_until("aborted", ended=["aborted"]) == set()
    loads.store.gate.set()
    wait_for("the late read returned", lambda: loads.counters.snapshot()["late_loads"] == 1)
    for block_id in (0, 1, 2, 3):
        assert all(not page.any() for page in loads.block(block_id))
    assert loads.counters.snapshot()["load_timeouts"] == 0


def test_a_load_still_waiting_for_a_thread_at_its_deadline_never_reads() -> None:
    made = Loads()
    try:
        # Four held loads take every loader thread; a fifth waits for one.
        for n in range(4):
            made.loads.submit(transfer(f"held-{n}", (n,), HASHES[n : n + 1]))
        made.loads.submit(transfer("queued", (4, 5, 6, 7), OTHER_HASHES))
        made.clock.now += 1.0
        assert made.poll_until("queued") == set(range(8))
        assert made.loads.in_flight == 0
        made.store.gate.set()
        wait_for("the held reads returned", lambda: made.counters.snapshot()["late_loads"] == 4)
        for block_id in range(8):
            assert all(not page.any() for page in made.block(block_id))
        assert made.counters.snapshot()["load_timeouts"] == 5
    finally:
        made.close()


def test_loads_of_different_sizes_one_after_another_land_byte_exact(loads: Loads) -> None:
    # Staging buffers of several sizes are kept and reused: each load takes one that fits.
    plan = [
        ((0,), (0,)),
        ((1, 2, 3, 4), (0, 1, 2, 3)),
        ((4, 5, 6, 7), (3, 2, 1, 0)),
        ((5,), (1,)),
        ((2, 3), (2, 3)),
    ]
    for n, (block_ids, sources) in enumerate(plan):
        hashes = [OTHER_HASHES[i] for i in sources]
        loads.loads.submit(transfer(f"r{n}", block_ids, hashes))
        assert loads.poll_until(f"r{n}") == set()
        for block_id, source in zip(block_ids, sources, strict=True):
            ours, theirs = loads.block(block_id), loads.source_block(4 + source)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert loads.counters.snapshot()["loaded_blocks"] == 12
