"""Test-only hooks into a store's memory (never used by kvfabric itself)."""

from __future__ import annotations

from kvfabric.descriptor import Descriptor
from kvfabric.errors import NotSupportedError
from kvfabric.record import HEADER_SIZE
from kvfabric.store import Store

__all__ = ["corrupt_payload", "resolve_descriptor"]


def resolve_descriptor(store: Store, key: bytes) -> Descriptor | None:
    """Ask the index where ``key`` lives (one control RPC, counted like any other)."""
    return store._rpc(store._index.resolve, [key])[0]


def corrupt_payload(store: Store, key: bytes, at: int = 0) -> Descriptor:
    """Flip one payload byte of ``key``'s record in place, behind the store's back.

    Works on stores whose data node runs in this process (``embedded://``).
    """
    descriptor = resolve_descriptor(store, key)
    if descriptor is None:
        raise KeyError(key.hex())
    node = store.local_node
    if node is None:
        raise NotSupportedError("corrupt_payload needs a store whose data node is in-process")
    region = node.backend.regions()[descriptor.region]
    position = descriptor.offset + HEADER_SIZE + at % max(descriptor.length, 1)
    region.view[position] ^= 0xFF
    return descriptor
