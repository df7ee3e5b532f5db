"""Batches of any size with the index in Redis: one server and a 3-master cluster.

Redis runs a function call whole and serves no one else meanwhile, so a batch's keys go in
calls of at most ``CALL_ITEMS`` per arena — more calls in the same pipelines, not more round
trips. A put of 100,000 keys is then stored whole (before, its publish outlived
``redis.timeout`` and was reported failed although applied), read back whole, and deleted.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from redis_fixtures import need_redis
from redis_servers import RedisDeployment

import kvfabric
from kvfabric import PutOutcome
from kvfabric.indexes.redis import RedisIndex
from kvfabric.indexes.redis_calls import CALL_ITEMS
from kvfabric.keys import chain_keys

_N = 100_000


@pytest.fixture(scope="module")
def redis_cluster_as_deployed() -> Iterator[RedisDeployment]:
    """3 masters with a replica each, and Redis's default node timeout (15 s). The shared
    fixture's 1 s (for quick failovers) is shorter than a busy host can take to answer the
    cluster bus while a master runs a large batch's calls: its peers would mark it failed
    and the cluster down, and the batch would fail truly but for the test's host."""
    need_redis()
    with RedisDeployment.cluster(masters=3, replicas=1, node_timeout=15.0) as deployment:
        yield deployment


def _url(deployment: RedisDeployment) -> str:
    name = f"big{uuid.uuid4().hex[:8]}"
    return (
        f"embedded://{name}?capacity=512MiB&transport=shm&timeout=60s"
        f"&index=redis&redis.url={deployment.url}&redis.namespace={name}"
    )


@pytest.mark.parametrize("deployment", ["redis_single", "redis_cluster_as_deployed"])
def test_a_put_of_100k_keys_is_stored_read_and_deleted_whole(
    deployment: str, request: pytest.FixtureRequest
) -> None:
    redis: RedisDeployment = request.getfixturevalue(deployment)
    keys = chain_keys(list(range(_N)), 1, namespace=uuid.uuid4().bytes)
    values = [key[:8] * 32 for key in keys]
    with kvfabric.connect(_url(redis)) as store:
        assert Counter(store.batched_put(keys, values)) == {PutOutcome.STORED: _N}
        assert store.batched_contains(keys) == _N
        assert store.batched_exists(keys) == [True] * _N
        got = store.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == values
        assert store.delete(keys) == _N
        assert store.batched_exists(keys) == [False] * _N
        stats = store.stats()
        assert stats["controller_unavailable"] == 0
        assert stats["put_failures"] == 0


def test_a_batch_of_many_calls_per_arena_is_still_one_round_trip_per_master(
    redis_single: RedisDeployment,
) -> None:
    keys = chain_keys(list(range(8 * CALL_ITEMS)), 1, namespace=uuid.uuid4().bytes)
    with kvfabric.connect(_url(redis_single)) as store:
        store.batched_put(keys, [b"v" * 64] * len(keys))
        index = store.local_index
        assert isinstance(index, RedisIndex)
        before = index.round_trip_counts()
        assert store.batched_exists(keys) == [True] * len(keys)
        after = index.round_trip_counts()
    assert after["rounds"] - before["rounds"] == 1
    assert after["round_trips"] - before["round_trips"] == 1
