"""The extents a writer holds: where its next records go, without asking the index.

An index that leases extents (:meth:`~kvfabric.spi.Index.lease_extents`) lets a put lay its
records into runs of region it holds and publish them in one call, instead of an
``allocate`` round trip that places each key. This module keeps the extents a store holds
between puts (one per data node) and carves each put's records from them: dealt round-robin
over the extents, and in each one back to back, each at the next
:data:`~kvfabric.spi.SLOT_ALIGN` boundary, versions counting up — what the index checks
when they are published.

A put takes an extent out of the pool for its whole write and publish, then gives it back,
so concurrent puts never carve one extent at once (the index takes an extent's records only
in order). An extent past a share of its lease is not carved from (a slow writer must not
write into space the index already took back) and goes back to the index with the next lease
call, as does one too full for the put at hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvfabric.descriptor import Descriptor
from kvfabric.spi import Extent, record_size

__all__ = ["Carving", "ExtentPool", "HeldExtent", "stripes"]

LEASE_SHARE = 0.5
"""Share of an extent's lease after which no new record is carved from it."""
EXTENT_BYTES = 16 << 20
"""Bytes a lease asks for at least (the index may give less; a put needing more asks for
four times what it needs): a store writing a few puts a second leases rarely."""
RETRY_AFTER = 5.0
"""Seconds a store waits before asking for an extent again after the index gave none (it
leases none, or had no room): meanwhile puts allocate per key."""


class HeldExtent:
    """An extent this store leased, and how far its records reach."""

    __slots__ = ("cursor", "expires_at", "extent", "next_version")

    def __init__(self, extent: Extent, asked_at: float) -> None:
        self.extent = extent
        # From when it was asked for: the index's lease starts later, never earlier.
        self.expires_at = asked_at + extent.lease * LEASE_SHARE
        self.cursor = extent.offset
        self.next_version = extent.first_version

    def room(self) -> int:
        return self.extent.end - self.cursor

    def carve(self, keys: Sequence[bytes], lengths: Sequence[int], positions: list[int]) -> Carving:
        """Records for ``keys`` laid from the cursor on (the caller checked the room);
        ``positions``: where each key is in the put's."""
        e = self.extent
        assert sum(map(record_size, lengths)) <= self.room()
        at, version = self.cursor, self.next_version
        descriptors = []
        for key, length in zip(keys, lengths, strict=True):
            descriptors.append(
                Descriptor.trusted(
                    key=key,
                    node=e.node,
                    region=e.region,
                    offset=at,
                    length=length,
                    rkey=e.rkey,
                    version=version,
                    crc=0,
                )
            )
            at += record_size(length)
            version += 1
        return Carving(self, descriptors, positions, at, version)


class Carving:
    """One put's records in an extent; :meth:`done` moves the extent's cursor past them."""

    __slots__ = ("_end", "_next_version", "descriptors", "held", "positions")

    def __init__(
        self,
        held: HeldExtent,
        descriptors: list[Descriptor],
        positions: list[int],
        end: int,
        next_version: int,
    ) -> None:
        self.held = held
        self.descriptors = descriptors
        self.positions = positions
        self._end = end
        self._next_version = next_version

    def done(self) -> None:
        self.held.cursor = self._end
        self.held.next_version = self._next_version


class ExtentPool:
    """The extents one store holds; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[HeldExtent] = []
        self._returning: list[int] = []
        self._retry_at = 0.0

    def take(self, need: int, count: int, nodes_generation: int) -> list[HeldExtent]:
        """Up to ``count`` idle extents, each on another node and with ``need`` bytes of
        room, for this put alone. Idle ones too old or too full for it, or leased before
        the nodes changed (``nodes_generation``, as the lookup image says now: the extent's
        node may have restarted and lost it), are set to go back with the next lease
        call."""
        now = time.monotonic()
        with self._lock:
            taken: list[HeldExtent] = []
            nodes: set[int] = set()
            keep = []
            for held in self._idle:
                if (
                    held.expires_at <= now
                    or held.room() < need
                    or held.extent.nodes_generation != nodes_generation
                ):
                    self._returning.append(held.extent.id)
                elif len(taken) < count and held.extent.node not in nodes:
                    taken.append(held)
                    nodes.add(held.extent.node)
                else:
                    keep.append(held)
            self._idle = keep
            return taken

    def stale(self, nodes_generation: int) -> bool:
        """Whether extents held were leased before the nodes last changed (this store
        should learn the nodes again before it spreads a put over them)."""
        with self._lock:
            return any(h.extent.nodes_generation != nodes_generation for h in self._idle)

    def may_lease(self) -> bool:
        """Whether asking the index for extents is worth a round trip now."""
        return time.monotonic() >= self._retry_at

    def returning(self) -> list[int]:
        """Ids of extents to give back, handed to the next lease call (and forgotten)."""
        with self._lock:
            ids, self._returning = self._returning, []
            return ids

    def leased(self, extents: Sequence[Extent], asked_at: float, count: int) -> list[HeldExtent]:
        """What a lease call for ``count`` extents gave, held for the put that asked. When
        it gave fewer, the next lease waits a while (the index leases none, or has not the
        room): meanwhile puts use what they hold, or allocate per key."""
        if len(extents) < count:
            self._retry_at = time.monotonic() + RETRY_AFTER
        return [HeldExtent(extent, asked_at) for extent in extents]

    def give_back(self, held: HeldExtent) -> None:
        """The put is done with it: idle again, for the next put."""
        with self._lock:
            self._idle.append(held)

    def give_up(self, held: HeldExtent) -> None:
        """The put failed with it (a node, the publish): it goes back to the index."""
        with self._lock:
            self._returning.append(held.extent.id)

    def forget(self) -> None:
        """The index restarted: the extents it leased are gone with it."""
        with self._lock:
            self._idle = []
            self._returning = []

    def release_all(self) -> list[int]:
        """Every extent held, to give back (the store is closing)."""
        with self._lock:
            ids = [held.extent.id for held in self._idle] + self._returning
            self._idle, self._returning = [], []
            return ids


def stripes(count: int, ways: int) -> list[list[int]]:
    """``range(count)`` dealt round-robin into ``ways`` stripes, none empty: a put's records
    over as many extents, each on another node, so any run of its keys (a prefix read
    back) spreads over the nodes as ``allocate`` would spread it."""
    ways = max(1, min(ways, count))
    return [list(range(start, count, ways)) for start in range(ways)]
