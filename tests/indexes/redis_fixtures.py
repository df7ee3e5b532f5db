"""Helpers of the redis index's tests: what they need installed, fresh namespaces, leak checks."""

from __future__ import annotations

import os
import uuid
from typing import Any

import attrs
import pytest
from redis_servers import RedisDeployment, redis_server_binary

from kvfabric.spi import IndexConfig, IndexPlugin


def need_redis() -> None:
    missing = []
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install 'kvfabric[redis]')")
    if redis_server_binary() is None:
        missing.append("redis-server and redis-cli (apt-get install redis-server)")
    if missing:
        message = "the redis index tests need " + " and ".join(missing)
        if os.environ.get("KVFABRIC_REQUIRE_REDIS") == "1":
            pytest.fail(message)
        pytest.skip(message)


def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def redis_index(deployment: RedisDeployment, config: IndexConfig, **options: Any) -> IndexPlugin:
    """A new index in a namespace of its own on ``deployment``."""
    from kvfabric.indexes.redis import RedisIndex

    merged = {"url": deployment.url, "namespace": namespace(), **config.options, **options}
    return RedisIndex.create(attrs.evolve(config, options=merged))


def keys_left(deployment: RedisDeployment, namespace: str) -> int:
    """How many keys of ``namespace`` any live server still holds."""
    total = 0
    for server in deployment.servers:
        if server.alive:
            client = deployment.client(server.port)
            total += sum(1 for _ in client.scan_iter(match=f"*{namespace}*", count=1000))
    return total
