"""Shared fixtures for kvfabric's own tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    """A switch interval of 1 s. A batch of 8 MiB or more hands its rest to a helper thread
    once that rest should take no longer than the interval (``native.gil_handoffs``): with
    1 s it does so on any machine, early in the batch, so tests can count it exactly."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
