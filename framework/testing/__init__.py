"""The conformance suite kvfabric ships for plugin authors (and runs on its own plugins).

Subclass a mixin in your test module and override its fixtures::

    from kvfabric.testing import StoreConformance, TransportConformance

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def transport_name(self) -> str:
            return "mytransport"

    class TestStoreOverMyTransport(StoreConformance):
        @pytest.fixture
        def store_url(self, unique_name: str) -> str:
            return f"embedded://{unique_name}?transport=mytransport"

Every test asserts an outcome (bytes, counts, errors); none asserts a timing.
"""

from kvfabric._tools.bench_timing import BusyThread
from kvfabric._tools.local_cluster import free_port
from kvfabric.testing.cluster import Cluster
from kvfabric.testing.hooks import corrupt_payload, resolve_descriptor
from kvfabric.testing.index_suite import IndexConformance, MakeIndex
from kvfabric.testing.polling import PATIENCE, wait_for, wait_until_stopped
from kvfabric.testing.recovery import exact_hits
from kvfabric.testing.store_suite import StoreConformance
from kvfabric.testing.transport_suite import (
    MakeClient,
    RegionServer,
    TransportConformance,
    open_client,
    round_trip_works,
    segment_for,
)

__all__ = [
    "PATIENCE",
    "BusyThread",
    "Cluster",
    "IndexConformance",
    "MakeClient",
    "MakeIndex",
    "RegionServer",
    "StoreConformance",
    "TransportConformance",
    "corrupt_payload",
    "exact_hits",
    "free_port",
    "open_client",
    "resolve_descriptor",
    "round_trip_works",
    "segment_for",
    "wait_for",
    "wait_until_stopped",
]
