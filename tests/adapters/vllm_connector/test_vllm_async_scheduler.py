"""The vLLM connector's scheduler side with asynchronous loads and lookups, without an engine.

Real vLLM ``Request`` s against an embedded kvfabric store (``test_vllm_scheduler``'s
harness): hits and misses counted once per admitted request, a request whose load failed is
not offered kvfabric's blocks again, and a lookup that hangs (an index that does not answer)
answers "not yet" instead of holding vLLM's scheduler.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    # vllm.v1: a plain "vllm" would import this directory's vllm/ (the engine helper) as a
    # namespace package where vLLM is not installed.
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

from test_vllm_scheduler import BS, Harness, step, vllm_request

import kvfabric
from kvfabric.testing import wait_for


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_hits_and_misses_are_counted_per_block_once_per_admitted_request(
    harness: Harness,
) -> None:
    request = vllm_request(10 * BS + 2)  # 10 full blocks and a partial one
    harness.store(request, range(0, 6))
    for _ in range(3):  # vLLM may ask again while it cannot schedule the request
        assert harness.side.get_num_new_matched_tokens(request, 0) == 6 * BS
    assert harness.side.take_stats() is None  # nothing admitted yet
    harness.admit(request, 0, list(range(100, 111)))
    stats = harness.side.take_stats()
    assert stats is not None
    assert stats.data == {"hit_blocks": 6, "miss_blocks": 4}
    # Once its load is done vLLM allocates the rest and tells the connector again.
    harness.side.update_state_after_alloc(request, list(range(100, 111)), 0)
    assert harness.side.take_stats() is None
    meta = harness.side.build_connector_meta(
        step(cached=[request], scheduled={request.request_id: 4 * BS + 2})
    )
    (save,) = meta.saves  # saved from where the load ended
    assert save.block_ids == (106, 107, 108, 109)


def test_a_request_whose_load_failed_is_not_offered_kvfabrics_blocks_again(
    harness: Harness,
) -> None:
    request = vllm_request(10 * BS + 2)
    harness.store(request, range(0, 6))
    harness.admit(request, 0, list(range(100, 111)))
    harness.side.build_connector_meta(step())
    harness.side.update_connector_output({100})  # its first block failed (or timed out)
    # vLLM freed its blocks and asks again as for a new request: recompute, don't wait twice.
    assert harness.side.get_num_new_matched_tokens(request, 0) == 0
    other = vllm_request(10 * BS + 2)  # same prompt, another request: still a hit
    assert harness.side.get_num_new_matched_tokens(other, 0) == 6 * BS


class HungIndex:
    """A store whose lookups wait at a gate (an index that does not answer) until opened."""

    def __init__(self, store: kvfabric.Store) -> None:
        self.store = store
        self.gate = threading.Event()
        self.entered = threading.Event()

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.store.batched_contains(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_lookup_the_index_does_not_answer_is_not_yet_and_never_holds_the_scheduler() -> None:
    # No wait at all: what a lookup past its wait looks like, at once.
    harness = Harness(wrap=HungIndex, lookup_wait=0.0)
    index = harness.scheduler_store
    try:
        first, second = vllm_request(6 * BS + 1, seed=1), vllm_request(6 * BS + 1, seed=2)
        harness.store(first, range(0, 6))
        # The scheduler gets "not yet" for the request whose lookup hangs, and for one
        # behind it, and goes on with its step.
        assert harness.side.get_num_new_matched_tokens(first, 0) is None
        assert index.entered.wait(30)
        assert harness.side.get_num_new_matched_tokens(second, 0) is None
        assert harness.side.get_num_new_matched_tokens(first, 0) is None  # asked again
        index.gate.set()  # the index answers
        answers: dict[str, int | None] = {}

        def answered() -> bool:
            for request in (first, second):
                if answers.get(request.request_id) is None:
                    got = harness.side.get_num_new_matched_tokens(request, 0)
                    answers[request.request_id] = got
            return None not in answers.values()

        wait_for("both lookups answered", answered)
        assert answers == {first.request_id: 6 * BS, second.request_id: 0}
        assert harness.side.counters.snapshot()["lookups"] == 2  # one each, not one per ask
    finally:
        index.gate.set()
        harness.close()


class QueuedLookups:
    """A store whose lookups each wait for the test's go, in order: a lookup that is still
    running when the next request of the step is asked about."""

    def __init__(self, store: kvfabric.Store) -> None:
        self.store = store
        self.go = threading.Semaphore(0)

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        assert self.go.acquire(timeout=60), "the test never let the lookup go"
        return self.store.batched_contains(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_step_s_requests_queued_behind_a_running_lookup_still_get_their_answers() -> None:
    # A generous wait, spent only while lookups run: a healthy index answers every new
    # request of the step, also one asked while another's lookup is still under way.
    harness = Harness(wrap=QueuedLookups, lookup_wait=60.0)
    index = harness.scheduler_store
    try:
        requests = [vllm_request(6 * BS + 1, seed=s) for s in range(4)]
        harness.store(requests[0], range(0, 6))
        for _ in requests:
            index.go.release()
        answers = [harness.side.get_num_new_matched_tokens(r, 0) for r in requests]
        assert answers == [6 * BS, 0, 0, 0]
        assert harness.side.counters.snapshot()["lookup_deferrals"] == 0
    finally:
        harness.close()


def test_a_step_whose_wait_is_spent_answers_not_yet_at_once_until_the_next_step() -> None:
    harness = Harness(wrap=HungIndex, lookup_wait=0.05)
    index = harness.scheduler_store
    try:
        first, second = vllm_request(6 * BS + 1, seed=1), vllm_request(6 * BS + 1, seed=2)
        assert harness.side.get_num_new_matched_tokens(first, 0) is None  # waited 50 ms
        assert harness.side.get_num_new_matched_tokens(second, 0) is None  # at once
        assert harness.side.counters.snapshot()["lookup_deferrals"] == 2
        index.gate.set()
        answers: dict[str, int | None] = {}

        def answered() -> bool:
            harness.side.build_connector_meta(step())  # each step a fresh budget
            for request in (first, second):
                if answers.get(request.request_id) is None:
                    answers[request.request_id] = harness.side.get_num_new_matched_tokens(
                        request, 0
                    )
            return None not in answers.values()

        wait_for("both lookups answered in later steps", answered)
        assert answers == {first.request_id: 0, second.request_id: 0}
    finally:
        index.gate.set()
        harness.close()
