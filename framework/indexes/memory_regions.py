"""Every region's space in the memory index: where a slot is placed, and retired slots.

One region's bookkeeping (its free, occupied and retired bytes, and the windows eviction
prices) is :class:`~kvfabric.indexes.memory_space.RegionSpace`'s. This module keeps all of
them by (node, region), places a slot in the region with the most free bytes (which spreads
load across nodes), and keeps the queue of retired slots, oldest first: a slot whose entry
left is retired, not freed, because a reader may still hold its descriptor; it is free again
after ``grace`` seconds (or sooner, when eviction reuses it early).
"""

from __future__ import annotations

from collections import deque

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory_space import RegionSpace

__all__ = ["Regions", "Retirement", "still_retired"]

Retirement = tuple[float, RegionSpace, int, int]
"""A queued retirement: (reusable at, region, offset, retirement token)."""


class Regions:
    """The regions of every registered node, and their retired slots; not thread-safe (the
    index's lock guards it)."""

    def __init__(self, *, grace: float) -> None:
        """``grace``: seconds a retired slot waits before reuse (0: free at once)."""
        self.spaces: dict[tuple[int, int], RegionSpace] = {}
        """(node, region) -> its space."""
        self.retired: deque[Retirement] = deque()
        """Oldest first. A slot reused early stays queued until its time comes, or until
        eviction, which seeds windows from the head, drops it from there (see
        :func:`still_retired`)."""
        self.retired_bytes = 0
        self._grace = grace

    def drop(self, space: RegionSpace) -> None:
        """The region is gone: its space goes, and its retired slots with it."""
        del self.spaces[(space.node, space.region)]
        self.retired = deque(r for r in self.retired if r[1] is not space)
        self.retired_bytes -= sum(size for size, _ in space.retired.values())

    def finish_restore(self, space: RegionSpace) -> list[bytes]:
        """The region's node reported all its records: build its free space; returns the
        keys whose records lost to an overlapping one (see
        :meth:`RegionSpace.finish_restore`)."""
        keys, retired_bytes = space.finish_restore()
        self.retired_bytes -= retired_bytes
        return keys

    # -- placing -----------------------------------------------------------------------

    def fit(self, size: int, exclude: set[int]) -> tuple[RegionSpace, int] | None:
        """A free slot of ``size`` bytes on a node not in ``exclude`` (those already hold a
        copy of the value), taken from the region with the most free bytes: spreads load
        across nodes."""
        best: RegionSpace | None = None
        for space in self.spaces.values():
            alloc = space.allocator
            if (
                alloc.largest_free() >= size
                and (best is None or alloc.free_bytes > best.allocator.free_bytes)
                and space.node not in exclude
            ):
                best = space
        if best is None:
            return None
        offset = best.take(size)
        assert offset is not None
        return best, offset

    # -- retiring ----------------------------------------------------------------------

    def vacate(
        self, key: bytes, d: Descriptor, size: int, now: float, *, immediate: bool = False
    ) -> None:
        """One copy's slot leaves its key: it retires (or is free at once: ``immediate``,
        or no grace)."""
        space = self.spaces.get((d.node, d.region))
        if space is None or space.occupants.get(d.offset, (None,))[0] != key:
            return
        token = space.vacate(d.offset)
        if immediate or self._grace <= 0:
            space.release(d.offset, token)
            return
        self.retired.append((now + self._grace, space, d.offset, token))
        self.retired_bytes += size

    def retire_unused(self, space: RegionSpace, offset: int, size: int, now: float) -> None:
        """Space no entry occupies (part of a leased extent no record was published in)
        retires, in case a write to it is still landing."""
        token = space.retire(offset, size)
        if self._grace <= 0:
            space.release(offset, token)
            return
        self.retired.append((now + self._grace, space, offset, token))
        self.retired_bytes += size

    def release_due(self, now: float) -> None:
        """Retired slots whose grace ended are free."""
        while self.retired and self.retired[0][0] <= now:
            _, space, offset, token = self.retired.popleft()
            # Zero when the slot was already reused early (its token no longer matches).
            self.retired_bytes -= space.release(offset, token)

    # -- how much ----------------------------------------------------------------------

    def capacity(self) -> int:
        return sum(s.size for s in self.spaces.values())

    def free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self.spaces.values())

    def granting_bytes(self) -> int:
        """The bytes of the regions taking grants (not still being restored)."""
        return sum(s.size for s in self.spaces.values() if s.restored is None)

    def granting_sizes(self) -> list[int]:
        """The size of each region taking grants (not still being restored)."""
        return [s.size for s in self.spaces.values() if s.restored is None]

    def largest_granting(self) -> int:
        """The largest slot any region taking grants could hold (0: none takes them)."""
        return max((s.size for s in self.spaces.values() if s.restored is None), default=0)

    def largest(self) -> int:
        return max((s.size for s in self.spaces.values()), default=0)


def still_retired(queued: Retirement) -> bool:
    """Whether a queued retirement still holds its slot (not released, nor reused early)."""
    _, space, offset, token = queued
    held = space.retired.get(offset)
    return held is not None and held[1] == token
