"""Best-fit slot allocation inside one region, with coalescing of freed neighbours.

KV chunks of one model have (nearly) one size, so exact-size reuse is the common case; the
allocator still serves mixed sizes without size-class waste: it takes the smallest free
extent that fits, splits off the rest, and merges a freed extent with free neighbours.
Every operation is O(log n) in the number of distinct free sizes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["SlotAllocator"]


class SlotAllocator:
    """Free-extent bookkeeping for ``size`` bytes; offsets and sizes are multiples of ``align``."""

    def __init__(self, size: int, align: int = 64, used: Iterable[tuple[int, int]] = ()) -> None:
        """``used``: (offset, size) slots already taken (rebuilding from records); they must
        lie inside the region and must not overlap (ValueError otherwise)."""
        self.size = size - size % align
        self.align = align
        self.free_bytes = 0
        self._by_offset: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: dict[int, set[int]] = {}
        self._sizes: list[int] = []
        cursor = 0
        for offset, length in sorted(used):
            length = self._round(length)
            if offset < cursor or offset % align or offset + length > self.size:
                raise ValueError(f"used slot [{offset}, {offset + length}) overlaps or is outside")
            if offset > cursor:
                self._insert(cursor, offset - cursor)
            cursor = offset + length
        if self.size > cursor:
            self._insert(cursor, self.size - cursor)

    def free_at(self, offset: int) -> int:
        """Size of the free extent starting at ``offset`` (0 if none starts there)."""
        return self._by_offset.get(offset, 0)

    def free_ending_at(self, end: int) -> int:
        """Start of the free extent ending at ``end`` (-1 if none ends there)."""
        return self._by_end.get(end, -1)

    def free_runs(self) -> list[tuple[int, int]]:
        """Every free extent, as (offset, size), in no particular order."""
        return list(self._by_offset.items())

    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def allocate(self, size: int) -> int | None:
        """Offset of a new slot of ``size`` bytes (rounded up to ``align``), or None if no room."""
        size = self._round(size)
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes):
            return None
        extent = self._sizes[i]
        offset = next(iter(self._by_size[extent]))
        self._remove(offset, extent)
        if extent > size:
            self._insert(offset + size, extent - size)
        return offset

    def free(self, offset: int, size: int) -> None:
        """Return a slot; it merges with free neighbours."""
        size = self._round(size)
        if offset < 0 or offset + size > self.size or offset % self.align:
            raise ValueError(f"slot [{offset}, {offset + size}) is not inside this region")
        if offset in self._by_offset or (offset + size) in self._by_end:
            raise ValueError(f"slot at {offset} is already free")
        before = self._by_end.get(offset)
        if before is not None:
            before_size = offset - before
            self._remove(before, before_size)
            offset, size = before, size + before_size
        after_size = self._by_offset.get(offset + size)
        if after_size is not None:
            self._remove(offset + size, after_size)
            size += after_size
        self._insert(offset, size)

    def _round(self, size: int) -> int:
        if size <= 0:
            raise ValueError("slot size must be positive")
        return (size + self.align - 1) // self.align * self.align

    def _insert(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_end[offset + size] = offset
        bucket = self._by_size.get(size)
        if bucket is None:
            self._by_size[size] = {offset}
            bisect.insort(self._sizes, size)
        else:
            bucket.add(offset)
        self.free_bytes += size

    def _remove(self, offset: int, size: int) -> None:
        del self._by_offset[offset]
        del self._by_end[offset + size]
        bucket = self._by_size[size]
        bucket.discard(offset)
        if not bucket:
            del self._by_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
        self.free_bytes -= size
