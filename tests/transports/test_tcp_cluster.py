"""The store conformance suite against real controller and node processes, over tcp."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.testing import Cluster, StoreConformance


@pytest.fixture(scope="module")
def tcp_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp",), capacity="512MiB") as cluster:
        yield cluster


class TestClusterStoreOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, tcp_cluster: Cluster) -> str:
        return tcp_cluster.url(transport="tcp")
