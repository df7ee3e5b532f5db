"""The vLLM connector's scheduler side, without an engine.

Real vLLM ``Request`` s (block hashes from vLLM's own hasher, ``sha256_cbor``) and real
``SchedulerOutput`` s drive :class:`SchedulerSide` against an embedded kvfabric store, which
counts control RPCs like a remote one. The one stand-in is ``block_ids_of``, the seam the
connector reads vLLM's ``KVCacheManager.get_block_ids`` through: here a dict.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

import kvfabric
from kvfabric.adapters.vllm_events import EngineView
from kvfabric.adapters.vllm_keys import KeySpace, Rank
from kvfabric.adapters.vllm_metadata import KVFabricHandshake, KVFabricMetadata, Transfer
from kvfabric.adapters.vllm_scheduler import (
    SchedulerSide,
    require_recompute_policy,
    warn_if_hashes_unshared,
)
from kvfabric.descriptor import Descriptor

BS = 4  # tokens per block: the connector's block size, no kernel involved
RANKS: list[Rank] = [(0, 0), (0, 1)]  # two tensor-parallel ranks
KEYSPACE = KeySpace(engine_parts=("test-engine",))
VALUE = b"v" * 64

LOOKUP_WAIT = 60.0
"""Long enough for any lookup on a busy machine: these tests get answers, never "not yet"."""

init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


def vllm_request(tokens: int, *, seed: int = 0, **params: object) -> Request:
    """A vLLM request of ``tokens`` prompt tokens, hashed by vLLM itself."""
    prompt = [(seed * 7919 + i) % 1000 + 3 for i in range(tokens)]
    return Request(
        request_id=f"req-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1, **params),
        pooling_params=None,
        block_hasher=HASHER,
    )


class Harness:
    """A scheduler side and a second client of the same store (what other engines stored)."""

    def __init__(
        self, ranks: list[Rank] = RANKS, wrap: Any = None, lookup_wait: float = LOOKUP_WAIT
    ) -> None:
        """``wrap``: makes the scheduler's store from its own client (``wrap(client)``)."""
        url = f"embedded://sched-{uuid.uuid4().hex[:8]}"
        self.other_engine = kvfabric.connect(url)
        self.block_ids: dict[str, list[int]] = {}
        client = kvfabric.connect(url)
        self.scheduler_store = wrap(client) if wrap else client
        self.side = SchedulerSide(
            keyspace=KEYSPACE,
            store=self.scheduler_store,
            block_size=BS,
            ranks_expected=len(RANKS),
            block_ids_of=self.block_ids.__getitem__,
            lookup_wait=lookup_wait,
        )
        self.side.set_layouts({rank: KVFabricHandshake(layout=f"L{rank}") for rank in ranks})

    def store(self, request: Request, blocks: range, ranks: list[Rank] = RANKS) -> None:
        """Another engine stored these blocks of ``request`` for these ranks."""
        for rank in ranks:
            hashes = request.block_hashes[blocks.start : blocks.stop]
            keys = self.side.keys_for(hashes, request.cache_salt, rank)
            self.other_engine.batched_put(keys, [VALUE] * len(keys))

    def admit(self, request: Request, local_tokens: int, block_ids: list[int]) -> int:
        """What vLLM's scheduler does for a new request: look up, allocate, account."""
        external = self.side.get_num_new_matched_tokens(request, local_tokens)
        self.block_ids[request.request_id] = block_ids
        self.side.update_state_after_alloc(request, block_ids, external)
        request.num_computed_tokens = local_tokens + external
        return external

    def close(self) -> None:
        self.side.shutdown()
        self.other_engine.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def step(
    new: Sequence[Request] = (),
    cached: Sequence[Request] = (),
    scheduled: dict[str, int] | None = None,
    block_ids: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    """A vLLM scheduler step: ``scheduled`` tokens of each request, after its computed ones."""
    out = SchedulerOutput.make_empty()
    for request in new:
        out.scheduled_new_reqs.append(
            NewRequestData.from_request(request, ((block_ids or {}).get(request.request_id, []),))
        )
    for request in cached:
        out.scheduled_cached_reqs.req_ids.append(request.request_id)
        out.scheduled_cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
    out.num_scheduled_tokens = scheduled or {}
    return out


# -- lookups ------------------------------------------------------------------------------


def test_lookup_costs_no_control_rpc_and_counts_blocks_every_rank_holds(
    harness: Harness,
) -> None:
    request = vllm_request(10 * BS + 2)  # 10 full blocks and a partial one
    harness.store(request, range(0, 6))
    harness.store(request, range(6, 7), ranks=[(0, 0)])  # block 6: one rank's shard only
    tokens = harness.side.get_num_new_matched_tokens(request, 0)
    assert tokens == 6 * BS
    assert harness.side.counters.snapshot() == {
        "lookups": 1,
        "lookup_blocks": 10,
        "lookup_hit_blocks": 6,
        "lookup_control_rpcs": 0,  # the store answers from its index's lookup image
        "lookup_deferrals": 0,
        "hit_blocks": 0,  # counted when vLLM admits the request
        "miss_blocks": 0,
        "invalid_blocks_reported": 0,
    }


def test_lookup_leaves_a_token_to_compute_skips_local_blocks_and_can_repeat(
    harness: Harness,
) -> None:
    request = vllm_request(4 * BS)  # exactly 4 blocks, all stored
    harness.store(request, range(0, 4))
    answers = [harness.side.get_num_new_matched_tokens(request, 0) for _ in range(3)]
    assert answers == [3 * BS] * 3  # vLLM must compute the last token itself
    counters = harness.side.counters.snapshot()
    assert (counters["lookups"], counters["lookup_control_rpcs"]) == (3, 0)
    # Two blocks in vLLM's own prefix cache: only the third is asked for.
    assert harness.side.get_num_new_matched_tokens(request, 2 * BS) == BS
    assert harness.side.counters.snapshot()["lookup_blocks"] == 3 * 3 + 1


def test_prompt_logprob_requests_are_not_looked_up(harness: Harness) -> None:
    request = vllm_request(4 * BS + 1, prompt_logprobs=1)
    harness.store(request, range(0, 4))
    assert harness.side.get_num_new_matched_tokens(request, 0) == 0
    assert harness.side.counters.snapshot()["lookup_control_rpcs"] == 0


def test_missing_worker_layouts_disable_lookups_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "kvfabric.adapters.vllm"):
        harness = Harness(ranks=[(0, 0)])  # one of two workers reported
    try:
        assert "1 of 2 workers reported their KV layout" in caplog.text
        assert harness.side.layouts == {}
        request = vllm_request(4 * BS + 1)
        assert harness.side.get_num_new_matched_tokens(request, 0) == 0
        assert harness.side.counters.snapshot()["lookup_control_rpcs"] == 0
    finally:
        harness.close()


def test_without_a_store_lookups_miss_and_no_saves_are_planned() -> None:
    side = SchedulerSide(
        keyspace=KEYSPACE, store=None, block_size=BS, ranks_expected=1, block_ids_of=lambda _: []
    )
    side.set_layouts({(0, 0): KVFabricHandshake(layout="L")})
    request = vllm_request(4 * BS + 1)
    assert side.get_num_new_matched_tokens(request, 0) == 0
    side.update_state_after_alloc(request, [0, 1, 2, 3, 4], 0)
    request.num_computed_tokens = 0
    meta = side.build_connector_meta(step(new=[request], scheduled={request.request_id: 17}))
    assert meta == KVFabricMetadata()


# -- loads and saves ------------------------------------------------------------------------


def test_a_hit_becomes_this_steps_load_with_the_lookups_descriptors(harness: Harness) -> None:
    request = vllm_request(10 * BS + 2)
    harness.store(request, range(0, 6))
    block_ids = list(range(100, 111))
    assert harness.admit(request, 0, block_ids) == 6 * BS
    meta = harness.side.build_connector_meta(step())
    (load,) = meta.loads
    assert load.req_id == request.request_id
    assert load.block_hashes == tuple(request.block_hashes[:6])
    assert load.block_ids == tuple(range(100, 106))
    # Each rank gets the descriptors of its own blocks, in block order: no lookup of its own.
    descriptors = dict(load.descriptors)
    assert sorted(descriptors) == RANKS
    for rank in RANKS:
        keys = harness.side.keys_for(request.block_hashes[:6], None, rank)
        assert [Descriptor.from_bytes(w).key for w in descriptors[rank]] == keys
    assert harness.side.build_connector_meta(step()).loads == []  # handed over once


def test_saves_skip_the_hits_and_offer_each_newly_full_block_once(harness: Harness) -> None:
    request = vllm_request(10 * BS + 2)
    harness.store(request, range(0, 6))
    block_ids = list(range(100, 111))
    harness.admit(request, 0, block_ids)
    rest = request.num_tokens - request.num_computed_tokens
    meta = harness.side.build_connector_meta(
        step(new=[request], scheduled={request.request_id: rest})
    )
    assert meta.saves == [
        Transfer(
            req_id=request.request_id,
            cache_salt=None,
            block_hashes=tuple(request.block_hashes[6:10]),
            block_ids=(106, 107, 108, 109),
            # vLLM's view of the saved blocks, for the tier's KV events.
            engine=EngineView(
                parent=request.block_hashes[5],
                token_ids=tuple(request.all_token_ids[6 * BS : 10 * BS]),
                block_size=BS,
            ),
        )
    ]
    request.num_computed_tokens += rest
    again = harness.side.build_connector_meta(
        step(cached=[request], scheduled={request.request_id: 1})
    )
    assert again.saves == []


def test_a_load_error_offers_the_block_and_the_ones_after_it_for_saving_again(
    harness: Harness,
) -> None:
    request = vllm_request(10 * BS + 2)
    harness.store(request, range(0, 6))
    harness.admit(request, 0, list(range(100, 111)))
    harness.side.build_connector_meta(step())
    harness.side.update_connector_output({102})  # the worker could not load block 2
    assert harness.side.counters.snapshot()["invalid_blocks_reported"] == 1
    # vLLM recomputes from block 2: this step computes the whole rest of the prompt.
    request.num_computed_tokens = 2 * BS
    meta = harness.side.build_connector_meta(
        step(cached=[request], scheduled={request.request_id: 8 * BS + 2})
    )
    (save,) = meta.saves
    assert save.block_hashes == tuple(request.block_hashes[2:10])
    assert save.block_ids == tuple(range(102, 110))


def test_a_finished_request_is_forgotten(harness: Harness) -> None:
    request = vllm_request(4 * BS + 1)
    harness.admit(request, 0, [0, 1, 2, 3, 4])
    harness.side.request_finished(request.request_id)
    meta = harness.side.build_connector_meta(
        step(new=[request], scheduled={request.request_id: 17})
    )
    assert meta.saves == []


def test_a_resumed_request_is_saved_from_where_it_had_computed(harness: Harness) -> None:
    request = vllm_request(6 * BS + 1)
    request.num_computed_tokens = 2 * BS  # computed (and offered) before it was preempted
    harness.block_ids[request.request_id] = [10, 11, 12, 13, 14, 15, 16]
    harness.side.update_state_after_alloc(request, harness.block_ids[request.request_id], 0)
    meta = harness.side.build_connector_meta(
        step(cached=[request], scheduled={request.request_id: 4 * BS + 1})
    )
    (save,) = meta.saves
    assert save.block_ids == (12, 13, 14, 15)


# -- start-up checks -------------------------------------------------------------------------


def test_randomly_seeded_block_hashes_are_warned_about(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.INFO, "kvfabric.adapters.vllm"):
        warn_if_hashes_unshared("xxhash")
        assert "no other instance can use the blocks" in caplog.text
        assert "sha256_cbor" in caplog.text
        caplog.clear()
        warn_if_hashes_unshared("sha256_cbor")
        assert caplog.records == []
        monkeypatch.setenv("PYTHONHASHSEED", "7")
        warn_if_hashes_unshared("xxhash")
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert "PYTHONHASHSEED=7" in caplog.text


def test_the_load_failure_policy_becomes_recompute() -> None:
    config = KVTransferConfig(kv_connector="KVFabricConnector", kv_role="kv_both")
    assert config.kv_load_failure_policy == "fail"  # vLLM's default
    require_recompute_policy(config)
    assert config.kv_load_failure_policy == "recompute"
