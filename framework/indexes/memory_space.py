"""One region's space in the memory index: free extents, occupants, retired slots.

A region's bytes are at any moment in one of three states: *free* (in the best-fit
allocator), *occupied* by an entry (a grant being written, or a published record), or
*retired* (its entry left, and a reader may still hold its descriptor, so it waits out the
grace period before it is free again). Occupants and retired slots are indexed by start and
by end, so the neighbours of any slot are found in O(1).

That is what eviction needs to make *usable* room. Under churn with mixed value sizes,
freeing the least recently used entries one by one leaves free space scattered in holes
too small for the next value, so a store with free space would refuse puts. Instead,
when a value does not fit, :meth:`RegionSpace.plan` grows a contiguous window around a
candidate victim — swallowing free extents, retired slots and published neighbours — until
it holds the value, and prices it by what would be evicted. The index evicts the cheapest
window among a few candidates, and the value fits at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs

from kvfabric._runtime.slots import SlotAllocator
from kvfabric.spi import SLOT_ALIGN

__all__ = ["Plan", "RegionSpace"]

_tokens = itertools.count(1)


@attrs.frozen(kw_only=True)
class Plan:
    """A contiguous window that would hold a value once its victims are evicted."""

    space: RegionSpace
    cost: float
    victims: tuple[bytes, ...]
    """Keys of the published entries in the window."""
    retired: tuple[int, ...]
    """Offsets of retired slots in the window, released before their grace ends."""


class RegionSpace:
    __slots__ = (
        "allocator",
        "node",
        "occupant_end",
        "occupants",
        "region",
        "restored",
        "retired",
        "retired_end",
        "rkey",
        "size",
    )

    def __init__(self, node: int, region: int, rkey: int, size: int, *, restoring: bool) -> None:
        self.node = node
        self.region = region
        self.rkey = rkey
        self.size = size - size % SLOT_ALIGN
        # While the node reports its records nothing is free: a grant must not land on a
        # record not reported yet. ``restored`` collects their slots until the node is done.
        self.allocator = SlotAllocator(0 if restoring else self.size, SLOT_ALIGN)
        self.restored: list[tuple[int, int]] | None = [] if restoring else None
        self.occupants: dict[int, tuple[bytes, int]] = {}
        """offset -> (key, slot size) of every entry in the region, pending or published."""
        self.occupant_end: dict[int, int] = {}
        self.retired: dict[int, tuple[int, int]] = {}
        """offset -> (slot size, token); the token tells a later retirement of the same slot."""
        self.retired_end: dict[int, int] = {}

    # -- state changes -------------------------------------------------------------------

    def take(self, size: int) -> int | None:
        """A free slot of ``size`` bytes, or None."""
        if self.restored is not None:
            return None
        return self.allocator.allocate(size)

    def occupy(self, offset: int, size: int, key: bytes) -> None:
        self.occupants[offset] = (key, size)
        self.occupant_end[offset + size] = offset
        if self.restored is not None:
            self.restored.append((offset, size))

    def vacate(self, offset: int) -> int:
        """The entry at ``offset`` left: its slot is retired; returns the retirement token."""
        _, size = self.occupants.pop(offset)
        del self.occupant_end[offset + size]
        return self.retire(offset, size)

    def retire(self, offset: int, size: int) -> int:
        """Space no entry occupies (part of a leased extent that no record was published
        in) is retired; returns the retirement token."""
        token = next(_tokens)
        self.retired[offset] = (size, token)
        self.retired_end[offset + size] = offset
        return token

    def release(self, offset: int, token: int | None = None) -> int:
        """A retired slot becomes free (if ``token`` still names its retirement); its size."""
        held = self.retired.get(offset)
        if held is None or (token is not None and held[1] != token):
            return 0
        size = held[0]
        del self.retired[offset]
        del self.retired_end[offset + size]
        if self.restored is not None:
            # Still being restored: the slot is simply not among those reported used.
            self.restored.remove((offset, size))
        else:
            self.allocator.free(offset, size)
        return size

    def finish_restore(self) -> tuple[list[bytes], int]:
        """The node reported everything: build the free space.

        Reported records that overlap (a confused or hostile node) lose to the one at the
        lower offset. Returns the keys of the entries that lost (the caller drops them, so
        nothing points into shared space) and the bytes of retired slots that lost.
        """
        assert self.restored is not None
        used: list[tuple[int, int]] = []
        keys: list[bytes] = []
        retired_bytes = 0
        end = 0
        for offset, size in sorted(self.restored):
            if offset < end:
                occupant = self.occupants.pop(offset, None)
                if occupant is not None:
                    keys.append(occupant[0])
                    if self.occupant_end.get(offset + size) == offset:
                        del self.occupant_end[offset + size]
                elif offset in self.retired:
                    del self.retired[offset]
                    if self.retired_end.get(offset + size) == offset:
                        del self.retired_end[offset + size]
                    retired_bytes += size
                continue
            used.append((offset, size))
            end = offset + size
        self.allocator = SlotAllocator(self.size, SLOT_ALIGN, used)
        self.restored = None
        return keys, retired_bytes

    # -- making room ---------------------------------------------------------------------

    def openable_starts(self, need: int, evictable: Callable[[bytes], bool]) -> list[int]:
        """Where runs of at least ``need`` bytes start that free slots, retired slots and
        entries ``evictable`` lets go could make; grants being written and the unused part
        of leased extents (neither free, retired nor an entry's) break a run. One pass over
        the region, for when no window around the usual seeds can grow big enough."""
        if self.restored is not None:
            return []
        pieces = self.allocator.free_runs()
        pieces += [(offset, size) for offset, (size, _) in self.retired.items()]
        pieces += [(at, size) for at, (key, size) in self.occupants.items() if evictable(key)]
        pieces.sort()
        starts: list[int] = []
        start = end = -1
        for offset, size in pieces:
            if offset != end:
                start = offset  # a gap before it: a new run
            end = offset + size
            if end - start >= need and (not starts or starts[-1] != start):
                starts.append(start)
        return starts

    def plan(
        self, seed: int, need: int, keep_value: Callable[[bytes], float | None]
    ) -> Plan | None:
        """The window of at least ``need`` bytes around the slot at ``seed``, if one exists.

        ``keep_value(key)`` prices evicting a published entry (None: it cannot be evicted,
        e.g. a grant being written); the plan's cost is the sum over its victims.
        """
        if self.restored is not None:
            return None
        victims: list[bytes] = []
        retired: list[int] = []
        cost = 0.0

        def step(offset: int, forward: bool) -> int | None:
            """Swallow the slot starting (forward) or ending (backward) at ``offset``."""
            nonlocal cost
            if forward:
                free = self.allocator.free_at(offset)
                if free:
                    return offset + free
                held = self.retired.get(offset)
                if held is not None:
                    retired.append(offset)
                    return offset + held[0]
                occupant = self.occupants.get(offset)
                if occupant is None:
                    return None
                start, size = offset, occupant[1]
            else:
                start = self.allocator.free_ending_at(offset)
                if start >= 0:
                    return start
                start = self.retired_end.get(offset, -1)
                if start >= 0:
                    retired.append(start)
                    return start
                start = self.occupant_end.get(offset, -1)
                if start < 0:
                    return None
                size = offset - start
            key = self.occupants[start][0]
            value = keep_value(key)
            if value is None:
                return None
            victims.append(key)
            cost += value
            return start + size if forward else start

        low = high = seed
        first = step(seed, forward=True)
        if first is None:
            return None
        high = first
        while high - low < need:
            moved = step(high, forward=True) if high < self.size else None
            if moved is not None:
                high = moved
                continue
            moved = step(low, forward=False) if low > 0 else None
            if moved is None:
                return None
            low = moved
        return Plan(space=self, cost=cost, victims=tuple(victims), retired=tuple(retired))
