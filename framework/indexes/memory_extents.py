"""Extents the memory index leased to writers: where each one's unused part starts.

A writer lays records into its extent itself, in order (see :class:`~kvfabric.spi.Extent`),
and publishes them in one call. What the index keeps per extent is enough to check each
published record without trusting the writer: it lies in the part not used yet, aligned,
inside the extent, and carries one of the extent's versions not used yet. Records then only
move the cursor forward, so two records of one extent never overlap and a record never
covers space the index gave anyone else.
"""

from __future__ import annotations

from kvfabric.indexes.memory_space import RegionSpace
from kvfabric.keys import KEY_SIZE
from kvfabric.spi import SLOT_ALIGN, CarvedRecord, Extent, record_size

__all__ = ["MIN_RECORD", "LeasedExtent"]

MIN_RECORD = record_size(0)
"""The smallest slot a record takes: an extent of ``n`` bytes holds at most ``n //
MIN_RECORD`` records, so that many versions are set aside for it."""

_U32_MAX = (1 << 32) - 1


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
