"""Writes by grant in the memory index: allocate, publish, abort, and leases running out.

Per key, allocate answers *exists* (published: retention +1, no bytes move), *in flight*
(another writer holds the grant) or *grant*: a slot on up to ``replicas`` distinct data
nodes (the regions with the most free bytes, one per node, evicting to make room), each
under a version never issued before, with a lease. A value larger than any region taking
grants is refused up front, evicting nothing. A put of a stored key that lacks copies (a
node was lost) is granted the missing ones from free space, never by evicting: it might
evict the very entry it repairs.

Publish makes the key readable once any copy landed (the first that did is read first;
grants the writer did not name are dropped). A grant aborted, or not published by the end
of its lease, is taken back; its slot retires rather than coming free, since a write may
still be landing in it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory_entries import Entry, EntryState, EntryTable
from kvfabric.indexes.memory_eviction import Eviction
from kvfabric.indexes.memory_regions import Regions
from kvfabric.indexes.memory_replicas import Replicas
from kvfabric.spi import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    EngineBlock,
    GrantRef,
    record_size,
)

__all__ = ["Grants"]


class Grants:
    """Grants of slots to writers, and the versions every grant takes; not thread-safe
    (the index's lock guards it)."""

    def __init__(
        self,
        *,
        table: EntryTable,
        regions: Regions,
        eviction: Eviction,
        replicas: Replicas,
        lease: float,
        counters: dict[str, int],
    ) -> None:
        """``lease``: seconds a writer has between allocate and publish."""
        self._table = table
        self._entries = table.entries
        self._lru = table.lru
        self._regions = regions
        self._eviction = eviction
        self._replicas = replicas
        self._wanted = replicas.wanted
        self._lease = lease
        self._counters = counters
        self._pending: deque[tuple[float, bytes, int]] = deque()
        """(lease deadline, key, version) of each copy granted, oldest first."""
        # Seeded from the wall clock so a restarted index never reissues a version that
        # records from before the restart may still carry.
        self._next_version = time.time_ns()

    def reserve_versions(self, count: int) -> int:
        """Set ``count`` versions aside (for a leased extent's records); the first."""
        first = self._next_version + 1
        self._next_version += count
        return first

    # -- allocate ----------------------------------------------------------------------

    def allocate(self, requests: Sequence[AllocationRequest], now: float) -> AllocateResult:
        eviction = self._eviction
        evictions_before = self._counters["evictions"]
        eviction.settle(now)
        # Region sizes do not change while the lock is held: the largest record any region
        # taking grants could hold, once per call rather than per key.
        largest = self._regions.largest_granting()
        allocate_one = self._allocate_one
        out = [allocate_one(req, now, largest) for req in requests]
        eviction.after_grants(now)
        return AllocateResult(
            allocations=tuple(out),
            evictions=eviction.to_report(evictions_before),
            lease=self._lease,
        )

    def _allocate_one(self, req: AllocationRequest, now: float, largest: int) -> Allocation:
        entry = self._entries.get(req.key)
        if entry is not None:
            if entry.state is EntryState.PUBLISHED:
                entry.retention += 1
                self._table.touch_entry(req.key, entry, now)
                self._counters["dedup_hits"] += 1
                return Allocation(
                    kind=AllocationKind.EXISTS,
                    descriptor=entry.descriptor,
                    replicas=self._repair(req, entry, now),
                )
            self._counters["in_flight"] += 1
            return Allocation(kind=AllocationKind.IN_FLIGHT)
        size = record_size(req.length)
        if size > largest:
            # It cannot fit in any region taking grants (the value is larger than every
            # region, or the nodes are still restoring their records): refuse it without
            # evicting anything for it.
            self._counters["no_space"] += 1
            self._counters["oversize"] += size > self._regions.largest()
            return Allocation(kind=AllocationKind.NO_SPACE)
        first = self._place(req, size, now, set(), evict=True)
        if first is None:
            self._counters["no_space"] += 1
            return Allocation(kind=AllocationKind.NO_SPACE)
        entry = Entry(first, size, now + self._lease)
        self._entries[req.key] = entry
        copies = [first]
        for _ in range(self._wanted - 1):
            copy = self._place(req, size, now, {d.node for d in copies}, evict=True)
            if copy is None:
                self._counters["replica_shortfall"] += self._wanted - len(copies)
                break
            copies.append(copy)
        entry.grants = {d.version: d for d in copies}
        self._counters["grants"] += 1
        self._counters["replica_grants"] += len(copies) - 1
        return Allocation(kind=AllocationKind.GRANTED, descriptor=first, replicas=tuple(copies[1:]))

    def _repair(self, req: AllocationRequest, entry: Entry, now: float) -> tuple[Descriptor, ...]:
        """Grants of the copies a stored key lacks (a node holding one was lost), from free
        space only: a repair never evicts (it might evict the very entry it repairs)."""
        if entry.grants or self._wanted == 1:
            return ()
        copies = entry.copies()
        if len(copies) >= self._wanted:
            return ()
        nodes = {d.node for d in copies}
        grants: list[Descriptor] = []
        for _ in range(self._wanted - len(copies)):
            copy = self._place(req, entry.size, now, nodes, evict=False)
            if copy is None:
                break
            nodes.add(copy.node)
            grants.append(copy)
        if grants:
            entry.grants = {d.version: d for d in grants}
            entry.lease_deadline = now + self._lease
            self._counters["replica_repairs"] += len(grants)
        return tuple(grants)

    def _place(
        self, req: AllocationRequest, size: int, now: float, exclude: set[int], *, evict: bool
    ) -> Descriptor | None:
        """Grant one copy on a node not in ``exclude`` (evicting to make room if allowed)."""
        placed = self._regions.fit(size, exclude)
        if placed is None and evict:
            self._eviction.make_room(size, now, exclude)
            placed = self._regions.fit(size, exclude)
        if placed is None:
            return None
        space, offset = placed
        self._next_version += 1
        descriptor = Descriptor.trusted(
            key=req.key,
            node=space.node,
            region=space.region,
            offset=offset,
            length=req.length,
            rkey=space.rkey,
            version=self._next_version,
            crc=0,
        )
        space.occupy(offset, size, req.key)
        self._pending.append((now + self._lease, req.key, descriptor.version))
        return descriptor

    # -- publish, abort, expiry --------------------------------------------------------

    def publish(
        self,
        grants: Sequence[GrantRef],
        now: float,
        blocks: Mapping[bytes, EngineBlock] | None = None,
    ) -> list[bool]:
        """``blocks``: what the writer said of some keys, for the events (if reported)."""
        granted = self._table.granted
        out: list[bool] = []
        landed: dict[bytes, list[Descriptor]] = {}
        for grant in grants:
            found = granted(grant)
            ok = found is not None and found[0].lease_deadline > now
            if ok and found is not None:
                entry, copy = found
                assert entry.grants is not None
                del entry.grants[grant.version]
                landed.setdefault(grant.key, []).append(copy.with_crc(grant.crc))
            else:
                self._counters["publish_rejected"] += 1
            out.append(ok)
        if self._table.events is None:
            for key, copies in landed.items():
                self._publish_copies(key, self._entries[key], copies, now)
            return out
        for key, copies in landed.items():
            entry = self._entries[key]
            fresh = entry.state is EntryState.PENDING
            self._publish_copies(key, entry, copies, now)
            if fresh:
                self._table.stored(key, entry, blocks.get(key) if blocks else None)
        return out

    def _publish_copies(
        self, key: bytes, entry: Entry, copies: list[Descriptor], now: float
    ) -> None:
        """Copies of ``key`` landed: it is readable from them; its grants not named go."""
        for d in (entry.grants or {}).values():
            self._regions.vacate(key, d, entry.size, now)
            self._counters["replicas_dropped"] += 1
        entry.grants = None
        if entry.state is EntryState.PENDING:
            self._counters["replicas_published"] += len(copies) - 1
            entry.state = EntryState.PUBLISHED
            entry.retention = 1
            entry.last_use = now
            entry.descriptor, entry.alternates = copies[0], tuple(copies[1:])
            self._lru[key] = None
            self._table.image.show(key, entry.descriptor, entry.alternates)
            self._counters["published"] += 1
        else:
            # Copies repairing a stored key.
            self._counters["replicas_published"] += len(copies)
            self._replicas.set_copies(key, entry, (*entry.copies(), *copies))

    def abort(self, grants: Sequence[GrantRef], now: float) -> None:
        for grant in grants:
            found = self._table.granted(grant)
            if found is None:
                continue
            entry, copy = found
            assert entry.grants is not None
            del entry.grants[grant.version]
            # A write may still be landing in the slot: retire it, do not free it.
            self._regions.vacate(grant.key, copy, entry.size, now)
            self._counters["aborted"] += 1
            if not entry.grants:
                entry.grants = None
                if entry.state is EntryState.PENDING:
                    del self._entries[grant.key]

    def expire(self, now: float) -> None:
        """Grants whose lease ran out are taken back."""
        while self._pending and self._pending[0][0] <= now:
            _, key, version = self._pending.popleft()
            found = self._table.granted(GrantRef(key=key, version=version))
            if found is None:
                continue
            entry, copy = found
            assert entry.grants is not None
            del entry.grants[version]
            self._regions.vacate(key, copy, entry.size, now)
            self._counters["lease_expiries"] += 1
            if not entry.grants:
                entry.grants = None
                if entry.state is EntryState.PENDING:
                    del self._entries[key]
