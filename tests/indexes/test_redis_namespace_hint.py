"""A client in another Redis namespace than its nodes is told so, not only ``NO_SPACE``."""

from __future__ import annotations

import logging
import uuid
from urllib.parse import urlsplit

import pytest
from redis_servers import RedisDeployment

import kvfabric
from kvfabric.keys import chain_keys


def test_a_client_in_an_empty_namespace_gets_a_hint_naming_it(
    redis_single: RedisDeployment, caplog: pytest.LogCaptureFixture
) -> None:
    unique_name = f"hint{uuid.uuid4().hex[:8]}"
    nodes = kvfabric.connect(
        f"embedded://{unique_name}?capacity=64MiB&transport=shm&dram.prefault=false"
        f"&index=redis&redis.url={redis_single.url}&redis.namespace={unique_name}"
    )
    address = urlsplit(redis_single.url)
    other = f"{unique_name}x"
    client = kvfabric.connect(
        f"kvfabric://{address.hostname}:{address.port}?index=redis&redis.namespace={other}"
        "&transport=shm"
    )
    try:
        keys = chain_keys(list(range(64)), 16, namespace=b"hint")
        with caplog.at_level(logging.WARNING, logger="kvfabric._client.store"):
            outcomes = client.batched_put(keys, [b"x" * 1024] * len(keys))
        assert {o.value for o in outcomes} == {"no_space"}
        hints = [r.getMessage() for r in caplog.records if "NO_SPACE" in r.getMessage()]
        assert hints, caplog.text
        assert repr(other) in hints[0]
        assert "redis.namespace=NAME" in hints[0]
        # The nodes' own namespace stores as before: the hint is not a full store's.
        assert {o.value for o in nodes.batched_put(keys, [b"x" * 1024] * len(keys))} == {"stored"}
    finally:
        client.close()
        nodes.close()
