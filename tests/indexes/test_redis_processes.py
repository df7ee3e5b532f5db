"""The store suite against real data-node processes registered with Redis, no controller:
``kvfabric node --index redis`` and clients on ``kvfabric://HOST:PORT?index=redis``, on a
single server and on the 3-master, 3-replica cluster; and with two copies of each value.

The counts the suite asserts hold there too: each index call is one round, one round trip
per master holding its keys, and nothing else goes to Redis on the read path.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_servers import RedisDeployment

from kvfabric.testing import Cluster, StoreConformance
from kvfabric.testing.store_suite import ReplicatedStoreConformance


@pytest.fixture(scope="module")
def nodes_on_one_redis(redis_single: RedisDeployment) -> Iterator[Cluster]:
    with Cluster(
        nodes=2, transports=("tcp", "shm"), capacity="512MiB", redis=redis_single.url
    ) as c:
        yield c


@pytest.fixture(scope="module")
def nodes_on_redis_cluster(redis_cluster: RedisDeployment) -> Iterator[Cluster]:
    with Cluster(
        nodes=3, transports=("tcp", "shm"), capacity="512MiB", redis=redis_cluster.url
    ) as c:
        yield c


class TestStoreWithNodeProcessesOnOneRedis(StoreConformance):
    @pytest.fixture
    def store_url(self, nodes_on_one_redis: Cluster) -> str:
        # The timeout bounds a hang, not the machine's speed.
        return nodes_on_one_redis.url(timeout="60s")


class TestStoreWithNodeProcessesOnRedisCluster(StoreConformance):
    @pytest.fixture
    def store_url(self, nodes_on_redis_cluster: Cluster) -> str:
        return nodes_on_redis_cluster.url(timeout="60s")


class TestTwoCopiesWithNodeProcessesOnRedisCluster(ReplicatedStoreConformance):
    @pytest.fixture
    def store_url(self, nodes_on_redis_cluster: Cluster) -> str:
        return nodes_on_redis_cluster.url(timeout="60s", replicas="2")


def test_nodes_registered_with_redis_are_what_clients_see(nodes_on_redis_cluster: Cluster) -> None:
    infos = nodes_on_redis_cluster.node_infos()
    assert [n.name for n in infos] == ["node0", "node1", "node2"]
    assert all({e.transport for e in n.endpoints} == {"tcp", "shm"} for n in infos)
    stats = nodes_on_redis_cluster.stats()["index"]
    assert stats["nodes"] == 3
    assert stats["shards"] == 3
