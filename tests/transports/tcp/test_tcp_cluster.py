"""The store against real controller and node processes, over tcp: the conformance suite,
and batches past every per-call limit of the wire and the kernel."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, StoreConformance


@pytest.fixture(scope="module")
def tcp_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp",), capacity="512MiB") as cluster:
        yield cluster


class TestClusterStoreOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, tcp_cluster: Cluster) -> str:
        return tcp_cluster.url(transport="tcp")


@pytest.mark.slow
def test_a_batch_of_1500_values_of_100kb_is_stored_and_read_back(tcp_cluster: Cluster) -> None:
    """Two segments per record (header and payload) and 1,500 records: each node's share
    is several IOV_MAX (1,024) buffers in one batch, on both sides of both directions."""
    keys = chain_keys(list(range(1500)), 1, namespace=os.urandom(16))
    values = [os.urandom(100_000) for _ in keys]
    # The timeout bounds a hang, not the machine's speed: 150 MB on a busy 2-core host.
    with kvfabric.connect(tcp_cluster.url(transport="tcp", timeout="60s")) as store:
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
        got = store.batched_get(keys)
    assert sum(1 for g, v in zip(got, values, strict=True) if g is not None and g == v) == 1500
