"""The shipped conformance suites over ``shm``: embedded, and against real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.testing import Cluster, StoreConformance, TransportConformance


class TestShmTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "shm"


class TestEmbeddedStoreOverShm(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        return f"embedded://{unique_name}?capacity=512MiB&transport=shm"


@pytest.fixture(scope="module")
def shm_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("shm",), capacity="512MiB") as cluster:
        yield cluster


class TestClusterStoreOverShm(StoreConformance):
    """The store suite against real controller and node processes, reading over shm."""

    @pytest.fixture
    def store_url(self, shm_cluster: Cluster) -> str:
        return shm_cluster.url(transport="shm")
