"""The vLLM connector's worker side, without an engine.

Real paged caches shaped as vLLM's CPU worker lays them out (per layer ``[num_blocks,
kv_heads, block_size, 2 * head_size]``, all layers in one allocation), filled with random
floats, and an embedded kvfabric store that counts control RPCs like a remote one. Two
worker sides on the same store are two engines: what one saves, the other loads into other
blocks of its own cache. The last test adds the scheduler side, with a real vLLM ``Request``,
to count the control RPCs of a lookup and its load together.
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from collections.abc import Callable, Iterator

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

import kvfabric
from kvfabric.adapters.vllm_keys import KeySpace, Rank
from kvfabric.adapters.vllm_metadata import KVFabricMetadata, Transfer
from kvfabric.adapters.vllm_scheduler import SchedulerSide
from kvfabric.adapters.vllm_worker import WorkerSide
from kvfabric.testing import corrupt_payload, wait_for

LAYERS, NUM_BLOCKS, HEADS, BLOCK, HEAD = 3, 8, 2, 4, 8
VALUE_BYTES = LAYERS * HEADS * BLOCK * 2 * HEAD * 4  # one block's page of every layer, fp32
KEYSPACE = KeySpace(engine_parts=("test-engine",))
HASHES = tuple(bytes([i + 1]) * 32 for i in range(4))


def paged_cache(seed: int | None) -> dict[str, torch.Tensor]:
    """One allocation, layer after layer, as vLLM's CPU worker lays it out (random or zero)."""
    storage = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float32)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        storage.copy_(torch.randn(storage.shape, generator=generator))
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}


class Worker:
    """A worker side with its own paged cache and its own client of a shared store."""

    def __init__(
        self, url: str | None, *, seed: int | None = None, rank: Rank = (0, 0), **options: int
    ) -> None:
        self.caches = paged_cache(seed)
        self.store = kvfabric.connect(url) if url else None
        self.side = WorkerSide(keyspace=KEYSPACE, store=self.store, **options)  # type: ignore[arg-type]
        self.side.register_kv_caches(
            self.caches, num_blocks=NUM_BLOCKS, rank=rank, backend="device=cpu,test"
        )

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [cache[block_id].clone() for cache in self.caches.values()]

    def counters(self) -> dict[str, int]:
        return self.side.counters.snapshot()

    def save(
        self, block_ids: tuple[int, ...], req_id: str = "r", hashes: tuple[bytes, ...] = HASHES
    ) -> None:
        saves = [Transfer(req_id=req_id, cache_salt=None, block_hashes=hashes, block_ids=block_ids)]
        self.side.wait_for_save(KVFabricMetadata(saves=saves))
        assert self.side.flush(timeout=30)

    def load(
        self, block_ids: tuple[int, ...], req_id: str = "r", hashes: tuple[bytes, ...] = HASHES
    ) -> set[int]:
        loads = [Transfer(req_id=req_id, cache_salt=None, block_hashes=hashes, block_ids=block_ids)]
        self.side.start_load_kv(KVFabricMetadata(loads=loads))
        return self.finish_load(req_id)

    def finish_load(self, req_id: str) -> set[int]:
        """Poll as vLLM does each step until ``req_id``'s load is done; its failed blocks."""
        done: set[str] = set()
        errors: set[int] = set()

        def finished() -> bool:
            done.update(self.side.poll_loads())
            errors.update(self.side.take_load_errors())  # vLLM takes them in the same pass
            return req_id in done

        wait_for(f"load of {req_id} reported done", finished)
        return errors

    def close(self) -> None:
        self.side.shutdown()  # closes the store


@pytest.fixture
def url() -> str:
    return f"embedded://worker-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def worker(url: str) -> Iterator[Callable[..., Worker]]:
    """Makes workers on this test's store (``query``: client options; ``own_store=False``:
    a worker without a store)."""
    made: list[Worker] = []

    def make(*, own_store: bool = True, query: str = "", **options: object) -> Worker:
        made.append(Worker(url + query if own_store else None, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for w in made:
        w.close()


@pytest.fixture
def client(url: str) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(url) as store:
        yield store


def test_blocks_one_worker_saves_load_into_other_blocks_of_another_worker_byte_exact(
    worker: Callable[..., Worker], client: kvfabric.Store
) -> None:
    a, b = worker(seed=1), worker()
    a.save((1, 3, 5, 7))
    assert a.counters()["saved_blocks"] == 4
    assert client.batched_contains(a.side.keys_for(HASHES, None)) == 4

    assert b.load((0, 2, 4, 6)) == set()
    assert b.counters()["loaded_blocks"] == 4
    assert b.counters()["loaded_bytes"] == 4 * VALUE_BYTES
    for theirs, ours in zip((1, 3, 5, 7), (0, 2, 4, 6), strict=True):
        for page_a, page_b in zip(a.block(theirs), b.block(ours), strict=True):
            assert torch.equal(page_a, page_b)
    for untouched in (1, 3, 5, 7):
        assert all(not page.any() for page in b.block(untouched))

    # The same blocks saved again by B move no payload: kvfabric stores them once.
    b.save((0, 2, 4, 6))
    assert b.counters()["save_deduplicated_blocks"] == 4
    assert b.counters()["saved_blocks"] == 0


def test_a_corrupted_block_is_a_load_error_and_its_record_is_dropped(
    worker: Callable[..., Worker], client: kvfabric.Store
) -> None:
    a, b = worker(seed=2), worker()
    a.save((0, 1, 2, 3))
    keys = a.side.keys_for(HASHES, None)
    corrupt_payload(client, keys[2], at=3)
    assert b.load((4, 5, 6, 7)) == {6}  # the block id vLLM must recompute
    assert b.side.take_load_errors() == set()  # reported once
    assert (b.counters()["loaded_blocks"], b.counters()["load_errors"]) == (3, 1)
    # Dropped, so that the recomputed block can be stored in its place; the others stay.
    assert client.batched_exists(keys) == [True, True, False, True]


def test_saves_beyond_the_pending_bound_are_skipped_and_counted(
    worker: Callable[..., Worker], client: kvfabric.Store, caplog: pytest.LogCaptureFixture
) -> None:
    a = worker(seed=4, max_pending_save_bytes=3 * VALUE_BYTES)
    with caplog.at_level(logging.WARNING, "kvfabric.adapters.vllm"):
        a.save((0, 1, 2, 3))
    assert "saves are behind: 4 blocks not saved" in caplog.text
    assert a.counters()["save_skipped_blocks"] == 4
    assert client.batched_contains(a.side.keys_for(HASHES, None)) == 0
    a.save((0, 1, 2), hashes=HASHES[:3])  # within the bound
    assert a.counters()["saved_blocks"] == 3


def test_blocks_over_the_stores_max_value_are_counted_as_failed_saves_not_raised(
    worker: Callable[..., Worker], client: kvfabric.Store, caplog: pytest.LogCaptureFixture
) -> None:
    a = worker(seed=8, query="?max_value=1KiB")  # a block value here is 1.5 KiB
    with caplog.at_level(logging.ERROR, "kvfabric.adapters.vllm"):
        a.save((0, 1), hashes=HASHES[:2])  # flush() would raise what the saver thread raised
    assert "max_value" in caplog.text
    assert (a.counters()["save_failed_blocks"], a.counters()["saved_blocks"]) == (2, 0)
    assert client.batched_contains(a.side.keys_for(HASHES[:2], None)) == 0


def test_without_a_store_every_load_is_an_error_and_saves_are_dropped(
    worker: Callable[..., Worker],
) -> None:
    b = worker(own_store=False, seed=5)
    assert b.load((0, 1, 2, 3)) == {0, 1, 2, 3}
    b.save((4, 5, 6, 7))
    assert b.counters()["saved_blocks"] == 0


def test_handshake_names_the_layout_and_worker_and_scheduler_agree_on_keys(
    worker: Callable[..., Worker],
) -> None:
    mine = worker(rank=(0, 1))
    handshake = mine.side.handshake()
    assert handshake is not None
    assert handshake.layout == mine.side.layout
    assert handshake.layout.startswith("device=cpu,test;model.layers.0.self_attn.attn:")
    assert f"({HEADS}, {BLOCK}, {2 * HEAD})" in handshake.layout
    scheduler = SchedulerSide(
        keyspace=KEYSPACE, store=None, block_size=BLOCK, ranks_expected=2, block_ids_of=lambda _: []
    )
    other = worker(rank=(0, 0)).side.handshake()
    scheduler.set_layouts({(0, 0): other, (0, 1): handshake})
    for salt in (None, "tenant"):
        assert scheduler.keys_for(HASHES, salt, (0, 1)) == mine.side.keys_for(HASHES, salt)
    assert set(scheduler.keys_for(HASHES, None, (0, 0))).isdisjoint(
        mine.side.keys_for(HASHES, None)
    )


def test_a_worker_that_cannot_serve_reports_no_layout(caplog: pytest.LogCaptureFixture) -> None:
    assert WorkerSide(keyspace=KEYSPACE, store=None, enabled=False).handshake() is None
    side = WorkerSide(keyspace=KEYSPACE, store=None)
    odd = {"layer": torch.zeros(NUM_BLOCKS - 1, 4)}  # no block dimension of NUM_BLOCKS
    with caplog.at_level(logging.WARNING, "kvfabric.adapters.vllm"):
        side.register_kv_caches(odd, num_blocks=NUM_BLOCKS, rank=(0, 0), backend="b")
    assert "unsupported KV cache" in caplog.text
    assert side.handshake() is None


def test_lookup_and_load_of_a_request_cost_no_control_rpc_in_all(
    worker: Callable[..., Worker], url: str
) -> None:
    """Scheduler side and worker side of engine B: the lookup's descriptors ride along."""
    init_none_hash(sha256_cbor)
    request = Request(
        request_id="shared-prefix",
        prompt_token_ids=list(range(3, 3 + 4 * BLOCK + 1)),  # 4 full blocks and a token
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )
    hashes = tuple(request.block_hashes)
    a = worker(seed=6)
    a.save((0, 1, 2, 3), hashes=hashes)

    b = worker()
    handshake = b.side.handshake()
    scheduler = SchedulerSide(
        keyspace=KEYSPACE,
        store=kvfabric.connect(url),
        block_size=BLOCK,
        ranks_expected=1,
        block_ids_of=lambda _: [],
        lookup_wait=60.0,  # an answer, however busy the machine
    )
    scheduler.set_layouts({(0, 0): handshake})
    try:
        external = scheduler.get_num_new_matched_tokens(request, 0)
        assert external == 4 * BLOCK
        scheduler.update_state_after_alloc(request, [4, 5, 6, 7, 0], external)
        meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
        # vLLM pickles the metadata to worker processes: the descriptors survive that.
        b.side.start_load_kv(pickle.loads(pickle.dumps(meta)))
        assert b.finish_load(request.request_id) == set()
    finally:
        scheduler.shutdown()
    assert b.counters()["loaded_blocks"] == 4
    # The lookup reads the index's lookup image; the load uses the descriptors it found.
    assert scheduler.counters.snapshot()["lookup_control_rpcs"] == 0
    assert b.counters()["load_control_rpcs"] == 0
    for block in range(4):
        for page_a, page_b in zip(a.block(block), b.block(4 + block), strict=True):
            assert torch.equal(page_a, page_b)
