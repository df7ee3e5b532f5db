"""Test-only hooks into a store's memory (never used by kvfabric itself).

They use the store's public seams only: :meth:`kvfabric.Store.locate` to ask the index where
a record lives, and the record I/O layer (``Store.records``) to move raw bytes of its slot.
"""

from __future__ import annotations

from kvfabric import Store
from kvfabric._runtime.record import HEADER_SIZE
from kvfabric.descriptor import Descriptor

__all__ = ["corrupt_payload", "resolve_descriptor"]


def resolve_descriptor(store: Store, key: bytes) -> Descriptor | None:
    """Ask the index where ``key`` lives (one control RPC, counted like any other)."""
    return store.locate([key])[0]


def corrupt_payload(store: Store, key: bytes, at: int = 0) -> Descriptor:
    """Flip one payload byte of ``key``'s record in place, behind the index's back.

    Goes through the store's own record I/O layer (read the byte, write it back flipped),
    so it works on every deployment and transport a store can reach. Raises ``KeyError``
    if the key is not stored, ``TransportError`` if its node cannot be reached.
    """
    descriptor = resolve_descriptor(store, key)
    if descriptor is None:
        raise KeyError(key.hex())
    if not store.records.reaches([descriptor.node]):
        store.ping()  # learns the nodes that joined since the store last looked
    offset = HEADER_SIZE + at % max(descriptor.length, 1)
    byte = bytearray(1)
    store.records.read_slot(descriptor, offset, byte)
    byte[0] ^= 0xFF
    store.records.write_slot(descriptor, offset, byte)
    return descriptor
