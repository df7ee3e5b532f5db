"""Extents the memory index leases to writers, and the records they publish from them.

A writer lays records into its extent itself, in order (see :class:`~kvfabric.spi.Extent`),
and publishes them in one call. What the index keeps per extent is enough to check each
published record without trusting the writer: it lies in the part not used yet, aligned,
inside the extent, and carries one of the extent's versions not used yet. Records then only
move the cursor forward, so two records of one extent never overlap and a record never
covers space the index gave anyone else.

An extent is at most a share of the capacity taking grants (and never less than the writer
needs): writers holding extents they have not filled must not starve the others. Its unused
part comes back (retired first, in case a write to it is still landing) when the writer
returns it, when its lease runs out, or when a record skips over it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory_entries import Entry, EntryState, EntryTable
from kvfabric.indexes.memory_eviction import Eviction
from kvfabric.indexes.memory_grants import Grants
from kvfabric.indexes.memory_regions import Regions
from kvfabric.indexes.memory_space import RegionSpace
from kvfabric.keys import KEY_SIZE
from kvfabric.spi import (
    SLOT_ALIGN,
    CarvedRecord,
    CarveOutcome,
    EngineBlock,
    Extent,
    record_size,
)

__all__ = ["MIN_RECORD", "Extents", "LeasedExtent"]

MIN_RECORD = record_size(0)
"""The smallest slot a record takes: an extent of ``n`` bytes holds at most ``n //
MIN_RECORD`` records, so that many versions are set aside for it."""

_U32_MAX = (1 << 32) - 1
# An extent is at most this share of the capacity taking grants.
_EXTENT_SHARE = 1 / 16


class LeasedExtent:
    __slots__ = ("cursor", "deadline", "extent", "next_version", "space")

    def __init__(self, extent: Extent, space: RegionSpace, deadline: float) -> None:
        self.extent = extent
        self.space = space
        """The region it lies in (an extent outlives neither it nor a restore of it)."""
        self.deadline = deadline
        self.cursor = extent.offset
        """Where the part no record was published in starts."""
        self.next_version = extent.first_version

    def slot_of(self, record: CarvedRecord) -> int | None:
        """The slot size of ``record`` if it may be published from here, else None."""
        key, offset, length = record.key, record.offset, record.length
        if type(key) is not bytes or len(key) != KEY_SIZE or not 0 <= record.crc <= _U32_MAX:
            return None
        if length < 0 or offset < self.cursor or offset % SLOT_ALIGN:
            return None
        size = record_size(length)
        extent = self.extent
        if offset + size > extent.end:
            return None
        if not self.next_version <= record.version < extent.first_version + extent.versions:
            return None
        return size


class Extents:
    """The extents leased to writers, and the records published from them; not thread-safe
    (the index's lock guards it)."""

    def __init__(
        self,
        *,
        table: EntryTable,
        regions: Regions,
        eviction: Eviction,
        grants: Grants,
        replicas: int,
        lease: float,
        counters: dict[str, int],
    ) -> None:
        """``replicas``: copies of each value (with more than one, no extent is leased:
        every key's copies are placed on distinct nodes, per key)."""
        self.held: dict[int, LeasedExtent] = {}
        """Extent id -> its lease, while it lasts and has space left."""
        self.nodes_generation = 0
        """The data nodes' generation (set by the node registry), in each extent leased: a
        writer holding one sees in the image that its node changed."""
        self._next_id = 0
        self._table = table
        self._regions = regions
        self._eviction = eviction
        self._grants = grants
        self._replicas = replicas
        self._lease = lease
        self._counters = counters

    def lease(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int],
        returned: Sequence[int],
        now: float,
    ) -> list[Extent]:
        """Up to ``count`` extents on distinct nodes (see :meth:`IndexPlugin.lease_extents`),
        once those ``returned`` are taken back."""
        for extent_id in returned:
            held = self.held.get(extent_id)
            if held is not None:
                self._end(held, now)
                self._counters["extents_returned"] += 1
        if need <= 0 or self._replicas > 1:
            # With replicas every key's copies are placed on distinct nodes, per key.
            return []
        need = _aligned(need)
        granting = self._regions.granting_sizes()
        if need > max(granting, default=0):
            self._counters["no_space"] += 1
            return []
        want = max(need, min(_aligned(want), _aligned(int(sum(granting) * _EXTENT_SHARE))))
        eviction = self._eviction
        evictions_before = self._counters["evictions"]
        eviction.settle(now)
        nodes = set(exclude)
        out: list[Extent] = []
        for _ in range(count):
            extent = self._lease_one(need, want, nodes, now)
            if extent is None:
                break
            nodes.add(extent.node)
            out.append(extent)
        eviction.after_grants(now)
        evictions = eviction.to_report(evictions_before)
        if out and evictions:
            out[0] = attrs.evolve(out[0], evictions=evictions)
        elif evictions:
            eviction.report_later(evictions)  # no extent to tell: the next grant
        return out

    def _lease_one(self, need: int, want: int, exclude: set[int], now: float) -> Extent | None:
        """An extent on a node not in ``exclude``: ``want`` bytes of free space, else
        ``need`` bytes, evicting for them."""
        regions = self._regions
        size, placed = want, regions.fit(want, exclude)
        if placed is None:
            size, placed = need, regions.fit(need, exclude)
        if placed is None:
            self._eviction.make_room(need, now, exclude)
            placed = regions.fit(need, exclude)
        if placed is None:
            if not exclude:
                self._counters["no_space"] += 1
            return None
        space, offset = placed
        versions = size // MIN_RECORD
        self._next_id += 1
        extent = Extent(
            id=self._next_id,
            node=space.node,
            region=space.region,
            rkey=space.rkey,
            offset=offset,
            size=size,
            first_version=self._grants.reserve_versions(versions),
            versions=versions,
            lease=self._lease,
            nodes_generation=self.nodes_generation,
        )
        self.held[extent.id] = LeasedExtent(extent, space, now + self._lease)
        self._counters["extents_leased"] += 1
        return extent

    def publish_carved(
        self,
        records: Sequence[CarvedRecord],
        again: Sequence[bytes],
        now: float,
        blocks: Mapping[bytes, EngineBlock] | None = None,
    ) -> list[CarveOutcome]:
        """Records writers laid into their extents (see :meth:`IndexPlugin.publish_carved`),
        each checked against its extent, and keys stored again (``again``). ``blocks``: what
        the writer said of some keys, for the events (if reported)."""
        table, counters = self._table, self._counters
        entries, lru, show = table.entries, table.lru, table.image.show
        retire_unused = self._regions.retire_unused
        # Looked up once: the loop below pays one local test per record for the events.
        told = table.stored if table.events is not None else None
        for key in again:
            entry = entries.get(key)
            if entry is not None and entry.state is EntryState.PUBLISHED:
                entry.retention += 1
                table.touch_entry(key, entry, now)
                counters["dedup_hits"] += 1
        out: list[CarveOutcome] = []
        held: LeasedExtent | None = None
        for record in records:
            if held is None or held.extent.id != record.extent:
                held = self._live(record.extent, now)
            size = None if held is None else held.slot_of(record)
            if held is None or size is None:
                counters["carve_refused"] += 1
                out.append(CarveOutcome.REFUSED)
                continue
            leased, space = held.extent, held.space
            if record.offset > held.cursor:
                # Space skipped (a record not published): back, as an aborted grant's.
                retire_unused(space, held.cursor, record.offset - held.cursor, now)
            held.cursor = record.offset + size
            held.next_version = record.version + 1
            if held.cursor == leased.end:
                del self.held[leased.id]  # used up: nothing left to take back
            key = record.key
            entry = entries.get(key)
            if entry is not None:
                retire_unused(space, record.offset, size, now)
                if entry.state is EntryState.PUBLISHED:
                    entry.retention += 1
                    table.touch_entry(key, entry, now)
                    counters["dedup_hits"] += 1
                    out.append(CarveOutcome.EXISTS)
                else:
                    counters["in_flight"] += 1
                    out.append(CarveOutcome.IN_FLIGHT)
                continue
            descriptor = Descriptor.trusted(
                key=key,
                node=leased.node,
                region=leased.region,
                offset=record.offset,
                length=record.length,
                rkey=leased.rkey,
                version=record.version,
                crc=record.crc,
            )
            space.occupy(record.offset, size, key)
            entry = Entry(descriptor, size, 0.0)
            entry.state = EntryState.PUBLISHED
            entry.retention = 1
            entry.last_use = now
            entries[key] = entry
            lru[key] = None
            show(key, descriptor, entry.alternates)
            if told is not None:
                told(key, entry, blocks.get(key) if blocks else None)
            out.append(CarveOutcome.STORED)
        stored = out.count(CarveOutcome.STORED)
        counters["published"] += stored
        counters["carved"] += stored
        return out

    def _live(self, extent: int, now: float) -> LeasedExtent | None:
        """The extent, while its lease lasts (one whose lease ran out ends now)."""
        held = self.held.get(extent)
        if held is not None and held.deadline <= now:
            self._end(held, now)
            self._counters["extent_expiries"] += 1
            return None
        return held

    def _end(self, held: LeasedExtent, now: float) -> None:
        """The extent's writer is done with it (or its lease ran out): its unused part is
        taken back, retired first in case a write to it is still landing."""
        del self.held[held.extent.id]
        if self._regions.spaces.get((held.extent.node, held.extent.region)) is not held.space:
            return  # the region went (or was restored): the space is not the index's to free
        if held.cursor < held.extent.end:
            self._regions.retire_unused(held.space, held.cursor, held.extent.end - held.cursor, now)

    def expire(self, now: float) -> None:
        """Extents whose lease ran out end."""
        for held in [held for held in self.held.values() if held.deadline <= now]:
            self._end(held, now)
            self._counters["extent_expiries"] += 1

    def forget_region(self, space: RegionSpace) -> None:
        """The region went: its extents are no longer leased (their space went with it)."""
        self.held = {i: held for i, held in self.held.items() if held.space is not space}

    def unused_bytes(self) -> int:
        """Bytes leased to writers and not carved yet: neither free nor used."""
        return sum(h.extent.end - h.cursor for h in self.held.values())


def _aligned(size: int) -> int:
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN
