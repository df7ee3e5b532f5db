"""Test-only hooks into a store's memory (never used by kvfabric itself)."""

from __future__ import annotations

from kvfabric._client.store import Store
from kvfabric.descriptor import Descriptor
from kvfabric.errors import TransportError
from kvfabric.spi.record import HEADER_SIZE
from kvfabric.spi.transport import Segment

__all__ = ["corrupt_payload", "resolve_descriptor"]


def resolve_descriptor(store: Store, key: bytes) -> Descriptor | None:
    """Ask the index where ``key`` lives (one control RPC, counted like any other)."""
    return store._rpc(store._index.resolve, [key])[0]


def corrupt_payload(store: Store, key: bytes, at: int = 0) -> Descriptor:
    """Flip one payload byte of ``key``'s record in place, behind the index's back.

    Goes through the store's own data plane (read the byte, write it back flipped), so it
    works on every deployment and transport a store can reach.
    """
    descriptor = resolve_descriptor(store, key)
    if descriptor is None:
        raise KeyError(key.hex())
    store._ensure_routes({descriptor.node})
    _, client = store._data.route(descriptor.node)
    offset = descriptor.offset + HEADER_SIZE + at % max(descriptor.length, 1)
    byte = memoryview(bytearray(1))
    segment = Segment(descriptor.region, descriptor.rkey, offset, byte)
    errors = client.read(descriptor.node, [segment])
    byte[0] ^= 0xFF
    errors += client.write(descriptor.node, [segment])
    if any(errors):
        raise TransportError(f"could not corrupt {key.hex()}: {errors}")
    return descriptor
