"""The ``shm`` transport: the shipped conformance suites, then what only shm has."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest

from kvfabric._plugins import plugin_manager
from kvfabric.errors import TransportError
from kvfabric.spi import TransportConfig
from kvfabric.testing import Cluster, RegionServer, StoreConformance, TransportConformance


class TestShmTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "shm"


class TestEmbeddedStoreOverShm(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        # The timeout bounds a hang, not the machine's speed.
        # dram.prefault off: a new store for each test, and preparing 512 MiB ahead
        # costs more than most tests (what they check does not depend on it).
        url = f"embedded://{unique_name}?capacity=512MiB&transport=shm&timeout=60s"
        return f"{url}&dram.prefault=false"


@pytest.fixture(scope="module")
def shm_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("shm",), capacity="512MiB") as cluster:
        yield cluster


class TestClusterStoreOverShm(StoreConformance):
    """The store suite against real controller and node processes, reading over shm."""

    @pytest.fixture
    def store_url(self, shm_cluster: Cluster) -> str:
        return shm_cluster.url(transport="shm", timeout="60s")


@pytest.fixture
def server() -> Iterator[RegionServer]:
    server = RegionServer("shm")
    yield server
    server.close()


def test_a_node_on_another_host_is_unreachable_and_never_mapped(server: RegionServer) -> None:
    elsewhere = attrs.evolve(server.endpoint, address=b"another host's boot id")
    client = plugin_manager().transport("shm").create_client(TransportConfig())
    try:
        assert client.reachable(server.endpoint)
        assert not client.reachable(elsewhere)
        with pytest.raises(TransportError, match="another host"):
            client.connect(elsewhere)
    finally:
        client.close()


def test_a_region_file_that_is_not_the_registered_one_is_refused(server: RegionServer) -> None:
    """The handle names the file by device and inode too: a same-named file elsewhere (another
    mount namespace, a recycled pid) is never mapped."""
    handle = server.endpoint.regions[0]
    forged_info = bytes(8) + handle.info[8:]  # another st_dev, the same path
    forged = attrs.evolve(
        server.endpoint,
        regions=(attrs.evolve(handle, info=forged_info), *server.endpoint.regions[1:]),
    )
    client = plugin_manager().transport("shm").create_client(TransportConfig())
    try:
        assert not client.reachable(forged)
        with pytest.raises(TransportError, match="not the file the node registered"):
            client.connect(forged)
    finally:
        client.close()
