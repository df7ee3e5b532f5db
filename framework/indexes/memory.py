"""The in-memory index: :class:`MemoryIndex`, the parts it is made of, and its options.

One lock guards everything; every method is one batched call and does O(1) or O(log n)
work per key. Slots of removed entries are *retired*, not freed: a reader may still hold
their descriptor, so they are reused only after ``grace`` seconds, under a new version, and a
stale read can only fail validation — never return another key's bytes.

:class:`MemoryIndex` takes the lock and hands each call to the part that owns it:

- :mod:`~kvfabric.indexes.memory_entries` — the entries, their LRU order, and lookups
  (``lookup_copies``, ``resolve_copies``, ``exists``, ``touch``, ``unpublish``);
- :mod:`~kvfabric.indexes.memory_image` — the lookup image, kept in step with the entries
  under the same lock; clients read it one-sided where the controller serves it;
- :mod:`~kvfabric.indexes.memory_grants` — writes by grant (``allocate``, ``publish``,
  ``abort``, leases running out) and the versions every grant takes;
- :mod:`~kvfabric.indexes.memory_extents` — extents leased to writers and ``publish_carved``;
- :mod:`~kvfabric.indexes.memory_eviction` — headroom, and windows priced to make room;
- :mod:`~kvfabric.indexes.memory_regions` — every region's space, placement, retired slots
  (one region's bookkeeping is :mod:`~kvfabric.indexes.memory_space`'s);
- :mod:`~kvfabric.indexes.memory_replicas` — an entry's copies lost, added, promoted;
- :mod:`~kvfabric.indexes.memory_nodes` — the data nodes, their regions, restores.

Where its owner asks for KV events (:meth:`MemoryIndex.report_events`), the parts that
publish and the table, which every removal goes through, tell the owner's sink of each
entry as it comes and goes (:mod:`kvfabric.spi.events`).

The parts share the state each owns by reference (the table's dicts, the regions), never a
copy, and each loop over keys stays in one part.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvfabric._runtime.bounds import bounded
from kvfabric.descriptor import Descriptor
from kvfabric.indexes.index_counters import LOOKUP_COUNTERS, WRITE_COUNTERS
from kvfabric.indexes.memory_entries import EntryTable
from kvfabric.indexes.memory_eviction import Eviction
from kvfabric.indexes.memory_extents import Extents
from kvfabric.indexes.memory_grants import Grants
from kvfabric.indexes.memory_image import MemoryImage, NoImage
from kvfabric.indexes.memory_nodes import NodeRegistry
from kvfabric.indexes.memory_regions import Regions
from kvfabric.indexes.memory_replicas import Replicas
from kvfabric.spi import (
    AllocateResult,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    EngineBlock,
    Extent,
    GrantRef,
    IndexConfig,
    IndexEvents,
    IndexPlugin,
    NodeInfo,
    OptionSpec,
    Region,
    Registry,
    format_size,
    hookimpl,
    parse_size,
)

__all__ = ["MemoryIndex"]

# Bytes of the lookup image by default: 2 ** 18 buckets, ~64k entries at a quarter full.
_IMAGE_SIZE = 16 << 20

_COUNTERS = (
    *LOOKUP_COUNTERS,
    *WRITE_COUNTERS,
    "touches",
    "touched_keys",
    "replica_grants",
    "replica_shortfall",
    "replica_repairs",
    "replicas_published",
    "replicas_dropped",
    "promotions",
    "extents_leased",
    "extents_returned",
    "extent_expiries",
    "carved",
    "carve_refused",
)


class MemoryIndex(IndexPlugin):
    """The built-in index, held in this process's memory (a controller's, or embedded).

    Thread-safe.
    """

    name = "memory"
    supports_replicas = True
    options = (
        OptionSpec(
            name="image",
            # One 64-byte bucket at least; past 64 GiB (some 64 million entries) the start
            # would allocate more than any node's index needs.
            parse=bounded(
                parse_size, at_least=64, at_most=64 << 30, zero="keep none", show=format_size
            ),
            default=_IMAGE_SIZE,
            help="size of the lookup image (clients read it one-sided where the controller "
            "serves it, and the index answers lookups by RPC from it) "
            "(a power of two of 64-byte buckets; it answers best up to a quarter full, ~1 "
            "entry per 256 bytes, and keys past that fall back to RPC; its memory is all "
            "allocated at start, as a data node's regions are; 0: keep none)",
        ),
    )

    @classmethod
    def create(cls, config: IndexConfig) -> MemoryIndex:
        # A subclass may declare other options: then it gets the default image.
        return cls(
            lease=config.lease,
            grace=config.grace,
            headroom=config.headroom,
            image_size=config.options.get("image", _IMAGE_SIZE),
            replicas=config.replicas,
        )

    def __init__(
        self,
        *,
        lease: float = 30.0,
        grace: float = 2.0,
        headroom: float = 0.05,
        image_size: int = _IMAGE_SIZE,
        replicas: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``lease``: seconds a writer has between allocate and publish. ``grace``: seconds a
        retired slot waits before reuse. ``headroom``: share of the capacity not leased to
        writers kept free (or on its way to free) by evicting ahead of need, so writers
        rarely wait for a grace period.
        ``image_size``: bytes of the lookup image (0: none; lookups then walk the entries).
        ``replicas``: copies of each value, on distinct data nodes.
        """
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self._clock = clock
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        counters = self._counters
        # Kept from the start, served or not: it answers lookups by RPC in C too.
        image: MemoryImage | NoImage = NoImage()
        if image_size > 0:
            image = MemoryImage(image_size, replicas=replicas)
        self._regions = Regions(grace=grace)
        self._table = EntryTable(
            image=image, regions=self._regions, replicas=replicas, counters=counters
        )
        self._eviction = Eviction(
            table=self._table,
            regions=self._regions,
            headroom=headroom,
            counters=counters,
            # Made below: the extents need the eviction to make room for a lease.
            leased_bytes=lambda: self._extents.unused_bytes(),
        )
        self._replicas = Replicas(
            table=self._table, regions=self._regions, wanted=replicas, counters=counters
        )
        self._grants = Grants(
            table=self._table,
            regions=self._regions,
            eviction=self._eviction,
            replicas=self._replicas,
            lease=lease,
            counters=counters,
        )
        self._extents = Extents(
            table=self._table,
            regions=self._regions,
            eviction=self._eviction,
            grants=self._grants,
            replicas=replicas,
            lease=lease,
            counters=counters,
        )
        self._nodes = NodeRegistry(
            table=self._table,
            regions=self._regions,
            replicas=self._replicas,
            extents=self._extents,
            counters=counters,
        )

    # -- nodes -------------------------------------------------------------------------

    def register_node(self, info: NodeInfo) -> NodeInfo:
        with self._lock:
            return self._nodes.register(info)

    def heartbeat(self, node: int, incarnation: int) -> bool:
        with self._lock:
            return self._nodes.heartbeat(node, incarnation)

    def remove_node(self, node: int) -> int:
        with self._lock:
            return self._nodes.remove(node)

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        with self._lock:
            return self._nodes.restore(node, records, self._clock())

    def restore_done(self, node: int) -> None:
        with self._lock:
            self._nodes.restore_done(node)

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return list(self._nodes.nodes.values())

    # -- lookups -----------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        # One walk for both: the image's probe, then the entries where it cannot tell.
        return [d for d in self.lookup_copies(keys).descriptors if d is not None]

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return list(self.resolve_copies(keys).descriptors)

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        with self._lock:
            return self._table.lookup_copies(keys, self._clock())

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        with self._lock:
            return self._table.resolve_copies(keys, self._clock())

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return self._table.exists(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._table.touch(keys, self._clock())

    def report_events(self, events: IndexEvents) -> bool:
        """Every entry published (by a writer or a node's restore) and every published
        entry that goes (deleted, evicted, invalid, its last copy lost with its node) is
        told to ``events`` under the index's lock, in order; each entry keeps the engine
        hash its writer attached, for its removal."""
        with self._lock:
            self._table.events = events
        return True

    def lookup_image(self) -> Region | None:
        with self._lock:
            image = self._table.image
            return image.region if isinstance(image, MemoryImage) else None

    # -- writes ------------------------------------------------------------------------

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        with self._lock:
            now = self._clock()
            self._expire(now)
            return self._grants.allocate(requests, now)

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        with self._lock:
            return self._grants.publish(grants, self._clock())

    def publish_described(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock]
    ) -> list[bool]:
        with self._lock:
            return self._grants.publish(grants, self._clock(), blocks)

    def abort(self, grants: Sequence[GrantRef]) -> None:
        with self._lock:
            self._grants.abort(grants, self._clock())

    def leases_extents(self) -> bool:
        # With replicas each key's copies are placed per key, on distinct nodes, and a put
        # of a stored key is how its lost copies are granted again (allocate's EXISTS).
        return self._replicas.wanted == 1

    def lease_extents(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int] = (),
        returned: Sequence[int] = (),
    ) -> list[Extent]:
        with self._lock:
            now = self._clock()
            self._expire(now)
            return self._extents.lease(need, want, count, exclude, returned, now)

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes] = ()
    ) -> list[CarveOutcome]:
        with self._lock:
            return self._extents.publish_carved(records, again, self._clock())

    def publish_carved_described(
        self,
        records: Sequence[CarvedRecord],
        again: Sequence[bytes],
        blocks: Mapping[bytes, EngineBlock],
    ) -> list[CarveOutcome]:
        with self._lock:
            return self._extents.publish_carved(records, again, self._clock(), blocks)

    def unpublish(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return self._table.unpublish(keys, self._clock())

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        """Readers found these published records invalid: unpublish each that is still
        the published version of its copy, so the next put of its key stores it again (a
        key with another copy keeps it, promoted if need be)."""
        with self._lock:
            return self._replicas.drop_invalid(records, self._clock())

    # -- upkeep ------------------------------------------------------------------------

    def idle(self) -> None:
        """Evict ahead of need now if a grant left it owed (see
        :meth:`~kvfabric.indexes.memory_eviction.Eviction.idle`)."""
        with self._lock:
            self._eviction.idle(self._clock)

    def tick(self) -> None:
        """Expire leases and free retired slots now (the controller calls this periodically)."""
        with self._lock:
            self._expire(self._clock())
            self._table.image.beat()

    def _expire(self, now: float) -> None:
        """Leases that ran out end (extents', then grants'); retired slots whose grace
        ended are free."""
        self._extents.expire(now)
        self._grants.expire(now)
        self._regions.release_due(now)

    def close(self) -> None:
        with self._lock:
            image, self._table.image = self._table.image, NoImage()
        image.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            regions, table = self._regions, self._table
            capacity = regions.capacity()
            free = regions.free_bytes()
            published = len(table.lru)
            extent_bytes = self._extents.unused_bytes()
            return {
                **self._counters,
                "nodes": len(self._nodes.nodes),
                "entries": published,
                "pending": len(table.entries) - published,
                "capacity_bytes": capacity,
                "free_bytes": free,
                "retired_bytes": regions.retired_bytes,
                "extents": len(self._extents.held),
                # Leased to writers and not carved yet: neither free nor used.
                "extent_bytes": extent_bytes,
                "used_bytes": capacity - free - regions.retired_bytes - extent_bytes,
                # Every copy's payload.
                "stored_payload_bytes": table.stored_payload_bytes(),
                **table.image.stats(),
            }


@hookimpl
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    registry.add(MemoryIndex.name, MemoryIndex)
