"""The shipped conformance suites, run on the built-in embedded stack (dram + shm)."""

from __future__ import annotations

import pytest

from kvfabric.testing import StoreConformance, TransportConformance


class TestShmTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "shm"


class TestEmbeddedStoreOverShm(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        return f"embedded://{unique_name}?capacity=512MiB&transport=shm"
