"""The store suite over ``embedded://`` with its index in Redis: a real single server and a
real 3-master cluster, a data node and clients in this process, reading over shm.

The counts the suite asserts (a lookup then a get of N prefetched keys is one index call, a
put at most two, a re-put one and no payload bytes) hold with the index in Redis: each index
call is one round, one round trip per master holding its keys.
"""

from __future__ import annotations

import pytest
from redis_servers import RedisDeployment

from kvfabric.testing import StoreConformance


def _url(name: str, deployment: RedisDeployment) -> str:
    # The timeout bounds a hang, not the machine's speed. dram.prefault off: a new store for
    # each test, and preparing 512 MiB ahead costs more than most tests (what they check
    # does not depend on it).
    return (
        f"embedded://{name}?capacity=512MiB&transport=shm&timeout=60s&dram.prefault=false"
        f"&index=redis&redis.url={deployment.url}&redis.namespace={name}"
    )


class TestEmbeddedStoreOnOneRedis(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str, redis_single: RedisDeployment) -> str:
        return _url(unique_name, redis_single)


class TestEmbeddedStoreOnRedisCluster(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str, redis_cluster: RedisDeployment) -> str:
        return _url(unique_name, redis_cluster)
