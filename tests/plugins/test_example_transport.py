"""The third-party ``example`` transport (tests/plugins/example_transport, its own
distribution, installed into the test env): it passes the conformance suites, a
``kvfabric://`` client chooses it by its declared preference, and it takes its option from
the URL. The cluster is real controller and node processes on 127.0.0.1.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric._plugins import plugin_manager
from kvfabric.errors import ConfigError
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, StoreConformance, TransportConformance, wait_for


class TestExampleTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "example"


class TestEmbeddedStoreOverExample(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        # dram.prefault off: a new store for each test, and preparing 512 MiB ahead
        # costs more than most tests (what they check does not depend on it).
        url = f"embedded://{unique_name}?capacity=512MiB&transport=example&timeout=60s"
        return f"{url}&dram.prefault=false"


def test_it_is_installed_as_its_own_distribution() -> None:
    cls = plugin_manager().transport("example")
    assert cls.__module__ == "kvfabric_example_transport"
    assert cls.preference > plugin_manager().transport("tcp").preference


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("example", "tcp"), capacity="256MiB") as cluster:
        yield cluster


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _node_counters(cluster: Cluster, settled: str = "", value: int = 0) -> dict[str, int]:
    """The node's counters once ``settled`` has reached ``value`` (they ride heartbeats).

    Each snapshot is consistent: the node updates a request's counters together.
    """

    def counters() -> dict[str, int]:
        nodes = [v for k, v in cluster.stats().items() if k.startswith("node")]
        return nodes[0] if nodes else {}

    return wait_for(
        f"the node's counters, {settled} at {value} or more" if settled else "the node's counters",
        counters,
        # A node's counters appear with its first heartbeat.
        until=lambda seen: "example_bytes_read" in seen and (not settled or seen[settled] >= value),
    )


def test_a_kvfabric_client_chooses_it_over_tcp_by_its_declared_preference(
    cluster: Cluster,
) -> None:
    keys = _keys(8)
    values = [os.urandom(100_000) for _ in keys]
    before = _node_counters(cluster)
    with kvfabric.connect(cluster.url()) as store:  # no ?transport=
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 8
        got = store.batched_get(keys)
        assert [bytes(v) if v is not None else None for v in got] == values
    payload = sum(len(v) for v in values)
    after = _node_counters(cluster, "example_bytes_read", before["example_bytes_read"] + payload)
    # The writes ended before the reads began: a snapshot showing the reads shows them.
    assert after["example_bytes_written"] - before["example_bytes_written"] >= payload
    assert after["example_bytes_read"] - before["example_bytes_read"] >= payload
    assert after["tcp_requests"] == before["tcp_requests"]


def test_its_option_from_the_url_reaches_the_client(cluster: Cluster) -> None:
    """``example.max_segments=1``: one request per segment read, as the node counts them
    (without it, a record's header and payload travel in one request)."""
    keys = _keys(1)
    with kvfabric.connect(cluster.url()) as writer:
        assert writer.batched_put(keys, [os.urandom(50_000)]) == [PutOutcome.STORED]
    before = _node_counters(cluster)
    with kvfabric.connect(cluster.url(**{"example.max_segments": "1"})) as store:
        assert store.batched_get(keys)[0] is not None
    after = _node_counters(cluster, "example_segments_read", before["example_segments_read"] + 2)
    segments = after["example_segments_read"] - before["example_segments_read"]
    requests = after["example_read_requests"] - before["example_read_requests"]
    assert segments >= 2
    assert requests == segments


def test_an_unknown_option_is_refused_with_the_one_it_declares(cluster: Cluster) -> None:
    with pytest.raises(ConfigError) as caught:
        kvfabric.connect(cluster.url(**{"example.max_segmnts": "1"}))
    assert "max_segments" in str(caught.value)
    with pytest.raises(ConfigError):
        kvfabric.connect(cluster.url(**{"example.max_segments": "0"}))
