"""Real Redis servers for the redis index's tests: one server, and a 3-master cluster.

Both are started once per test module (``redis-server`` on 127.0.0.1, persistence off, in a
temporary directory) and stopped after it. Without redis-server or redis-py the tests skip,
saying what to install; the tox ``redis`` env sets ``KVFABRIC_REQUIRE_REDIS=1`` so there they
fail instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_fixtures import need_redis
from redis_servers import RedisDeployment


@pytest.fixture(scope="module")
def redis_single() -> Iterator[RedisDeployment]:
    need_redis()
    with RedisDeployment.single() as deployment:
        yield deployment


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisDeployment]:
    """3 masters, each with one replica; a failover takes about 2 s (node timeout 1 s)."""
    need_redis()
    with RedisDeployment.cluster(masters=3, replicas=1, node_timeout=1.0) as deployment:
        yield deployment
