"""Eviction in the memory index: which published entries go, when, and making usable room.

Two reasons to evict. *Headroom*: after grants, entries go until free and retired space
make a share (``headroom``) of the capacity not leased to writers, so writers rarely wait for
a grace period (leased space is not counted: eviction cannot free it, and a writer that
vanished holds its extents until their leases run out);
the entries to go are the least worth keeping (LRU weighted by retention: an entry many
writers stored is worth more). Once the index's owner calls :meth:`Eviction.idle`, a grant
leaves that work to it, so the grant's reply does not wait for it.

*Room*: when a value does not fit, eviction makes room that is *usable*: it prices
contiguous windows around the least recently used entries and retired slots (see
:mod:`kvfabric.indexes.memory_space`) and evicts the cheapest, so the value fits at once.
Slots in such a window are reused before their grace period ends: the grace is a courtesy
to readers (fewer validation misses), and turning it into a refused put would cost the
cache its hit rate.

The LRU is walked with the image's use stamps (:meth:`Eviction.evictable`): an entry a
lookup used since it was queued gets a second chance, and is queued again as used then.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator

from kvfabric.indexes.memory_entries import Entry, EntryState, EntryTable
from kvfabric.indexes.memory_regions import Regions, still_retired
from kvfabric.indexes.memory_space import Plan, RegionSpace

__all__ = ["Eviction"]

# How many of the least recently used entries an eviction compares (sampled LRU).
_EVICTION_SAMPLE = 8
# How many candidate windows (around the oldest entries, and around retired slots) a put
# that does not fit prices before evicting the cheapest.
_WINDOW_SEEDS = 16
# How far past the head of the retirement queue a put looks for retired slots to seed
# windows with (slots reused early are skipped, so more than the seeds it wants).
_RETIRED_LOOKAHEAD = 4 * _WINDOW_SEEDS


class Eviction:
    """Chooses and evicts entries; not thread-safe (the index's lock guards it)."""

    def __init__(
        self,
        *,
        table: EntryTable,
        regions: Regions,
        headroom: float,
        counters: dict[str, int],
        leased_bytes: Callable[[], int],
    ) -> None:
        """``headroom``: share of the capacity taking grants and not leased kept free (or
        on its way to free) by evicting ahead of need; ``leased_bytes``: the bytes leased to
        writers and not written yet."""
        self._table = table
        self._entries = table.entries
        self._regions = regions
        self._headroom = headroom
        self._leased_bytes = leased_bytes
        self._counters = counters
        # Eviction ahead of need after a grant: done in the grant's call, until an owner
        # calls idle(); from then on left to it, off the grant's reply.
        self._idle_owner = False
        self._headroom_owed = False
        self._evictions_unreported = 0
        """Evictions idle() made, for the next grant's result to report."""

    # -- headroom ----------------------------------------------------------------------

    def idle(self, clock: Callable[[], float]) -> None:
        """Evict ahead of need now if a grant left it owed (see :meth:`_keep_headroom`).

        From an owner's first call on, a grant leaves that eviction to this, so the grant's
        reply does not wait for it.
        """
        self._idle_owner = True
        if not self._headroom_owed:
            return
        before = self._counters["evictions"]
        self.settle(clock())
        self._evictions_unreported += self._counters["evictions"] - before

    def after_grants(self, now: float) -> None:
        """Grants were made: keep the headroom now, or leave it owed to :meth:`idle`."""
        if self._idle_owner:
            self._headroom_owed = True
        else:
            self._keep_headroom(now)

    def settle(self, now: float) -> None:
        """What idle() has not done yet is done first: the headroom never lags more than
        one grant behind, whether or not the owner calls it."""
        if self._headroom_owed:
            self._headroom_owed = False
            self._keep_headroom(now)

    def to_report(self, before: int) -> int:
        """Evictions this call made (since ``before``), and those idle() made since the
        last report: each eviction is reported to some writer once."""
        reported = self._counters["evictions"] - before + self._evictions_unreported
        self._evictions_unreported = 0
        return reported

    def report_later(self, evictions: int) -> None:
        """Evictions a call had no result to report them in: the next grant reports them."""
        self._evictions_unreported = evictions

    def _keep_headroom(self, now: float) -> None:
        """Evict ahead of need until free and retired space make the headroom (of the space
        not leased).

        A put of many keys into a full store falls short by about one entry a key. The
        entries to go are chosen in one pass over the LRU's head for the whole shortfall,
        not by a fresh sample per entry, which would walk the LRU's head once an entry.
        """
        regions = self._regions
        # A share of what eviction can act on: with most of the space leased, a share of
        # all of it would evict every entry, those stored a moment ago too, and still fall
        # short.
        evictable_space = max(0, regions.granting_bytes() - self._leased_bytes())
        target = int(evictable_space * self._headroom)
        short = target - regions.free_bytes() - regions.retired_bytes
        if short <= 0:
            return
        for key in self._least_worth_keeping(short, now):
            self._table.remove(key, self._entries[key], now)
            self._counters["evictions"] += 1
            if regions.free_bytes() + regions.retired_bytes >= target:
                return
        # The ranked entries freed less than they hold (copies already vacated).
        while regions.free_bytes() + regions.retired_bytes < target and self._evict_one(now):
            pass

    def _least_worth_keeping(self, short: int, now: float) -> list[bytes]:
        """The oldest entries holding ``short`` bytes and a sample's worth past them,
        ranked by how little they are worth keeping (LRU weighted by retention, as
        :meth:`_evict_one` ranks its sample: a shortfall of one entry ranks exactly that
        sample).
        """
        ranked: list[tuple[float, bytes]] = []
        held = 0
        past = 0
        for key, entry, _ in self.evictable():
            if held >= short:
                if past == _EVICTION_SAMPLE - 1:
                    break
                past += 1
            ranked.append((_eviction_score(entry, now), key))
            held += entry.size * (1 + len(entry.alternates))
        # Stable: of equal worth, the older goes first.
        ranked.sort(key=_first, reverse=True)
        return [key for _, key in ranked]

    def _evict_one(self, now: float) -> bool:
        """Retire the published entry least worth keeping: LRU, weighted by retention."""
        victim: bytes | None = None
        best_score = -1.0
        for key, entry, _ in itertools.islice(self.evictable(), _EVICTION_SAMPLE):
            score = _eviction_score(entry, now)
            if score > best_score:
                victim, best_score = key, score
        if victim is None:
            return False
        self._table.remove(victim, self._entries[victim], now)
        self._counters["evictions"] += 1
        return True

    # -- room for one value ------------------------------------------------------------

    def make_room(self, size: int, now: float, exclude: set[int]) -> None:
        """Evict the cheapest contiguous window that holds ``size`` bytes (on a node not in
        ``exclude``).

        Candidate windows grow around the least recently used entries and the oldest
        retired slots; each is priced by what it would evict (recent and often-stored
        entries cost more). When none can grow big enough (grants being written or leased
        extents block them), one pass over each region finds where a window can; where
        none can, nothing is evicted: evicting the oldest entry and searching again would
        empty the store for a value that still does not fit.
        """
        if any(
            s.allocator.largest_free() >= size and s.node not in exclude
            for s in self._regions.spaces.values()
        ):
            return
        plans = self._candidate_windows(size, now, exclude) or self._any_windows(size, now, exclude)
        if plans:
            self._evict_window(min(plans, key=lambda plan: plan.cost), now)

    def _keep_value(self, key: bytes, now: float) -> float | None:
        """What evicting an entry costs (None: it is being written, never evicted)."""
        entry = self._entries[key]
        if entry.state is not EntryState.PUBLISHED:
            return None
        # A neighbour in a window, not walked in LRU order: its last use may be only in the
        # image's stamp.
        entry.last_use = max(entry.last_use, self._table.image.last_use(key))
        return 1.0 / _eviction_score(entry, now)

    def _candidate_windows(self, size: int, now: float, exclude: set[int]) -> list[Plan]:
        """Windows that would hold ``size`` bytes on nodes not in ``exclude``; a single one
        when a window evicting nothing exists (none is cheaper)."""
        keep_value = functools.partial(self._keep_value, now=now)
        plans: list[Plan] = []
        # A slot reused before its grace ended stays queued (in the regions' queue) until
        # its time comes; under churn such slots pile up at the head (the oldest retired
        # slots are the seeds reused first). Drop those at the head, and look at a bounded
        # stretch past it, so a put does not walk past all of them.
        retired = self._regions.retired
        while retired and not still_retired(retired[0]):
            retired.popleft()
        seeds = 0
        for queued in itertools.islice(retired, _RETIRED_LOOKAHEAD):
            if seeds == _WINDOW_SEEDS:
                break
            space = queued[1]
            if space.node in exclude or not still_retired(queued):
                continue
            seeds += 1
            plan = space.plan(queued[2], size, keep_value)
            if plan is not None:
                if not plan.victims:
                    # Retired and free space only: nothing cheaper exists (under churn of
                    # equal-sized values, the common case), so price nothing else.
                    return [plan]
                plans.append(plan)
        for _, entry, held_in in itertools.islice(self.evictable(), _WINDOW_SEEDS):
            if held_in.node not in exclude:
                plan = held_in.plan(entry.descriptor.offset, size, keep_value)
                if plan is not None:
                    plans.append(plan)
        return plans

    def _any_windows(self, size: int, now: float, exclude: set[int]) -> list[Plan]:
        """Windows of ``size`` bytes wherever evictions can open one (up to
        ``_WINDOW_SEEDS`` of them), found in one pass over each region not in ``exclude``."""
        keep_value = functools.partial(self._keep_value, now=now)

        def evictable(key: bytes) -> bool:
            return self._entries[key].state is EntryState.PUBLISHED

        plans: list[Plan] = []
        for space in self._regions.spaces.values():
            if space.node in exclude:
                continue
            for start in space.openable_starts(size, evictable):
                plan = space.plan(start, size, keep_value)
                if plan is not None:
                    plans.append(plan)
                if len(plans) == _WINDOW_SEEDS:
                    return plans
        return plans

    def _evict_window(self, plan: Plan, now: float) -> None:
        for key in plan.victims:
            self._table.remove(key, self._entries[key], now, immediate=True)
            self._counters["evictions"] += 1
        regions = self._regions
        for offset in plan.retired:
            # Reused before its grace ended: free now, out of the regions' retired bytes.
            regions.retired_bytes -= plan.space.release(offset)
            self._counters["early_reuse"] += 1

    # -- the LRU walk ------------------------------------------------------------------

    def evictable(self) -> Iterator[tuple[bytes, Entry, RegionSpace]]:
        """Published entries whose eviction frees space grants can use, least recently
        used first, with the region their first copy is in.

        Lookups that the image answered stamped their uses there, not in the LRU: an entry
        stamped since it was queued is passed over (a second chance) and, once the walk
        stops, queued again as used then. A walk that reaches the end yields those last,
        least recently used first, so something is always found to evict.

        Entries of a region still being restored are skipped: its space takes no grant
        until the node is done, so evicting them would only lose hits.
        """
        entries, regions = self._entries, self._regions.spaces
        last_use = self._table.image.last_use

        def granting(entry: Entry) -> RegionSpace | None:
            d = entry.descriptor
            space = regions.get((d.node, d.region))
            return space if space is not None and space.restored is None else None

        used_since: list[tuple[float, bytes]] = []
        try:
            for key in self._table.lru:
                entry = entries[key]
                used = last_use(key)
                if used > entry.last_use:
                    used_since.append((used, key))
                elif (space := granting(entry)) is not None:
                    yield key, entry, space
            used_since.sort(key=_first)
            requeued, used_since = used_since, []
            self._requeue(requeued)
            for _, key in requeued:
                entry = entries[key]
                if (space := granting(entry)) is not None:
                    yield key, entry, space
        finally:
            self._requeue(used_since)

    def _requeue(self, used: list[tuple[float, bytes]]) -> None:
        """Entries the image saw used since they were queued: queue them as used then."""
        for when, key in used:
            entry = self._entries.get(key)
            if entry is not None and entry.state is EntryState.PUBLISHED and entry.last_use < when:
                self._table.touch_entry(key, entry, when)


def _first(ranked: tuple[float, bytes]) -> float:
    return ranked[0]


def _eviction_score(entry: Entry, now: float) -> float:
    """How little a published entry is worth keeping: its age, less for one stored by many
    writers (the higher, the sooner it goes)."""
    return (now - entry.last_use + 1e-3) / _weight(entry)


def _weight(entry: Entry) -> float:
    """How much more an entry stored by many writers is worth keeping than one stored once."""
    return 1.0 + math.log2(max(entry.retention, 1))
