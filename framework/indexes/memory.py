"""The in-memory index: entries, grants with leases, eviction, retired slots.

One lock guards everything; every method is one batched call and does O(1) or O(log n)
work per key. Slots of removed entries are *retired*, not freed: a reader may still hold
their descriptor, so they are reused only after ``grace`` seconds, under a new version, and a
stale read can only fail validation — never return another key's bytes.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import attrs

from kvfabric.descriptor import Descriptor
from kvfabric.spi import (
    SLOT_ALIGN,
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeEndpoint,
    NodeInfo,
    Registry,
    SlotAllocator,
    hookimpl,
    record_size,
)

__all__ = ["MemoryIndex"]

# How many of the least recently used entries an eviction compares (sampled LRU).
_EVICTION_SAMPLE = 8


class _State(enum.Enum):
    PENDING = 1
    PUBLISHED = 2


class _Entry:
    __slots__ = ("descriptor", "last_use", "lease_deadline", "retention", "size", "state")

    def __init__(self, descriptor: Descriptor, size: int, lease_deadline: float) -> None:
        self.descriptor = descriptor
        self.size = size
        self.state = _State.PENDING
        self.lease_deadline = lease_deadline
        self.last_use = 0.0
        self.retention = 0


class _RegionSlots:
    __slots__ = ("allocator", "node", "region", "restored", "rkey", "size")

    def __init__(self, node: int, region: int, rkey: int, size: int, *, restoring: bool) -> None:
        self.node = node
        self.region = region
        self.rkey = rkey
        self.size = size
        # While the node reports its records, nothing is free: a grant must not land on a
        # record not reported yet. ``restored`` collects their slots until the node is done.
        self.allocator = SlotAllocator(0 if restoring else size, SLOT_ALIGN)
        self.restored: list[tuple[int, int]] | None = [] if restoring else None


class MemoryIndex(IndexPlugin):
    """The built-in index, held in this process's memory (a controller's, or embedded).

    Thread-safe.
    """

    name = "memory"

    @classmethod
    def create(cls, config: IndexConfig) -> MemoryIndex:
        return cls(lease=config.lease, grace=config.grace, headroom=config.headroom)

    def __init__(
        self,
        *,
        lease: float = 30.0,
        grace: float = 2.0,
        headroom: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``lease``: seconds a writer has between allocate and publish. ``grace``: seconds a
        retired slot waits before reuse. ``headroom``: share of capacity kept free (or on its
        way to free) by evicting ahead of need, so writers rarely wait for a grace period.
        """
        self._lease = lease
        self._grace = grace
        self._headroom = headroom
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._pending: deque[tuple[float, bytes, int]] = deque()
        self._retired: deque[tuple[float, _RegionSlots, int, int]] = deque()
        self._retired_bytes = 0
        self._regions: dict[tuple[int, int], _RegionSlots] = {}
        self._nodes: dict[int, NodeInfo] = {}
        self._node_ids: dict[str, int] = {}
        self._next_node_id = 0
        self._next_incarnation = 0
        # Seeded from the wall clock so a restarted index never reissues a version that
        # records from before the restart may still carry.
        self._next_version = time.time_ns()
        self._counters = dict.fromkeys(
            (
                "lookups",
                "lookup_keys",
                "prefix_hits",
                "resolves",
                "resolve_hits",
                "exists_calls",
                "grants",
                "dedup_hits",
                "in_flight",
                "no_space",
                "published",
                "publish_rejected",
                "aborted",
                "unpublished",
                "evictions",
                "lease_expiries",
                "restored",
                "restore_duplicates",
                "restore_overlaps",
            ),
            0,
        )

    # -- nodes -------------------------------------------------------------------------

    def register_node(self, info: NodeInfo) -> NodeInfo:
        with self._lock:
            node_id = self._node_ids.get(info.name)
            if node_id is None:
                # Ids are never reused: a client holding routes for a node that is gone must
                # never reach another node under its id.
                self._next_node_id += 1
                node_id = self._node_ids[info.name] = self._next_node_id
            self._next_incarnation += 1
            endpoints = tuple(
                NodeEndpoint(
                    node=node_id, transport=e.transport, address=e.address, regions=e.regions
                )
                for e in info.endpoints
            )
            registered = attrs.evolve(
                info, endpoints=endpoints, id=node_id, incarnation=self._next_incarnation
            )
            self._nodes[node_id] = registered
            wanted = {region.id: region for region in info.regions}
            for (node, region_id), slots in list(self._regions.items()):
                if node != node_id:
                    continue
                region = wanted.get(region_id)
                if (
                    info.restoring
                    or region is None
                    or (region.rkey, region.size) != (slots.rkey, slots.size)
                ):
                    self._drop_region_entries(slots)
                    del self._regions[(node, region_id)]
            for region in info.regions:
                if (node_id, region.id) not in self._regions:
                    self._regions[(node_id, region.id)] = _RegionSlots(
                        node_id, region.id, region.rkey, region.size, restoring=info.restoring
                    )
            return registered

    def remove_node(self, node: int) -> int:
        with self._lock:
            if self._nodes.pop(node, None) is None:
                return 0
            dropped = 0
            for region_id in [r for (n, r) in self._regions if n == node]:
                dropped += self._drop_region_entries(self._regions.pop((node, region_id)))
            return dropped

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        with self._lock:
            now = self._clock()
            kept = 0
            for record in records:
                slots = self._regions.get((node, record.region))
                if slots is None or slots.restored is None:
                    continue
                size = record_size(record.length)
                if record.offset % SLOT_ALIGN or record.offset + size > slots.size:
                    continue
                known = self._entries.get(record.key)
                if known is not None:
                    self._counters["restore_duplicates"] += 1
                    continue
                descriptor = attrs.evolve(record, node=node, rkey=slots.rkey)
                entry = _Entry(descriptor, size, lease_deadline=0.0)
                entry.state = _State.PUBLISHED
                entry.last_use = now
                self._entries[record.key] = entry
                self._lru[record.key] = None
                slots.restored.append((record.offset, size))
                kept += 1
            self._counters["restored"] += kept
            return kept

    def restore_done(self, node: int) -> None:
        with self._lock:
            for (owner, _), slots in self._regions.items():
                if owner != node or slots.restored is None:
                    continue
                used: list[tuple[int, int]] = []
                end = 0
                # Reported records that overlap (a confused or hostile node) lose to the one
                # at the lower offset; their entries go, so nothing points into shared space.
                for offset, size in sorted(slots.restored):
                    if offset < end:
                        self._drop_entry_at(slots, offset)
                        continue
                    used.append((offset, size))
                    end = offset + size
                slots.allocator = SlotAllocator(slots.size, SLOT_ALIGN, used)
                slots.restored = None

    def _drop_entry_at(self, slots: _RegionSlots, offset: int) -> None:
        for key, entry in list(self._entries.items()):
            d = entry.descriptor
            if (d.node, d.region, d.offset) == (slots.node, slots.region, offset):
                del self._entries[key]
                self._lru.pop(key, None)
                self._counters["restore_overlaps"] += 1
                return

    def _drop_region_entries(self, slots: _RegionSlots) -> int:
        doomed = [
            key
            for key, e in self._entries.items()
            if e.descriptor.node == slots.node and e.descriptor.region == slots.region
        ]
        for key in doomed:
            del self._entries[key]
            self._lru.pop(key, None)
        self._retired = deque(r for r in self._retired if r[1] is not slots)
        self._retired_bytes = sum(r[3] for r in self._retired)
        return len(doomed)

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return list(self._nodes.values())

    # -- lookups -----------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        with self._lock:
            now = self._clock()
            found: list[Descriptor] = []
            entries, touch, published = self._entries, self._lru.move_to_end, _State.PUBLISHED
            for key in keys:  # the hottest loop of the controller: kept flat
                entry = entries.get(key)
                if entry is None or entry.state is not published:
                    break
                entry.last_use = now
                touch(key)
                found.append(entry.descriptor)
            self._counters["lookups"] += 1
            self._counters["lookup_keys"] += len(keys)
            self._counters["prefix_hits"] += len(found)
            return found

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        with self._lock:
            now = self._clock()
            out: list[Descriptor | None] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.state is not _State.PUBLISHED:
                    out.append(None)
                    continue
                self._touch(key, entry, now)
                out.append(entry.descriptor)
            self._counters["resolves"] += 1
            self._counters["resolve_hits"] += sum(d is not None for d in out)
            return out

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._counters["exists_calls"] += 1
            published = _State.PUBLISHED
            return [(e := self._entries.get(k)) is not None and e.state is published for k in keys]

    def _touch(self, key: bytes, entry: _Entry, now: float) -> None:
        entry.last_use = now
        self._lru.move_to_end(key)

    # -- writes ------------------------------------------------------------------------

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        with self._lock:
            now = self._clock()
            self._expire_leases(now)
            self._release_retired(now)
            evictions_before = self._counters["evictions"]
            out: list[Allocation] = []
            for req in requests:
                out.append(self._allocate_one(req, now))
            self._keep_headroom(now)
            return AllocateResult(
                allocations=tuple(out),
                evictions=self._counters["evictions"] - evictions_before,
            )

    def _allocate_one(self, req: AllocationRequest, now: float) -> Allocation:
        entry = self._entries.get(req.key)
        if entry is not None:
            if entry.state is _State.PUBLISHED:
                entry.retention += 1
                self._touch(req.key, entry, now)
                self._counters["dedup_hits"] += 1
                return Allocation(kind=AllocationKind.EXISTS, descriptor=entry.descriptor)
            self._counters["in_flight"] += 1
            return Allocation(kind=AllocationKind.IN_FLIGHT)
        size = record_size(req.length)
        placed = self._fit(size)
        if placed is None:
            self._make_room(size, now)
            placed = self._fit(size)
        if placed is None:
            self._counters["no_space"] += 1
            return Allocation(kind=AllocationKind.NO_SPACE)
        slots, offset = placed
        self._next_version += 1
        descriptor = Descriptor(
            key=req.key,
            node=slots.node,
            region=slots.region,
            offset=offset,
            length=req.length,
            rkey=slots.rkey,
            version=self._next_version,
            crc=0,
        )
        deadline = now + self._lease
        self._entries[req.key] = _Entry(descriptor, size, deadline)
        self._pending.append((deadline, req.key, descriptor.version))
        self._counters["grants"] += 1
        return Allocation(kind=AllocationKind.GRANTED, descriptor=descriptor)

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        with self._lock:
            now = self._clock()
            out: list[bool] = []
            for grant in grants:
                entry = self._pending_entry(grant)
                ok = entry is not None and entry.lease_deadline > now
                if ok and entry is not None:
                    entry.descriptor = attrs.evolve(entry.descriptor, crc=grant.crc)
                    entry.state = _State.PUBLISHED
                    entry.retention = 1
                    entry.last_use = now
                    self._lru[grant.key] = None
                    self._counters["published"] += 1
                else:
                    self._counters["publish_rejected"] += 1
                out.append(ok)
            return out

    def abort(self, grants: Sequence[GrantRef]) -> None:
        with self._lock:
            now = self._clock()
            for grant in grants:
                entry = self._pending_entry(grant)
                if entry is not None:
                    # A write may still be landing in the slot: retire it, do not free it.
                    self._remove(grant.key, entry, now)
                    self._counters["aborted"] += 1

    def unpublish(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            now = self._clock()
            removed = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.state is _State.PUBLISHED:
                    self._remove(key, entry, now)
                    removed += 1
            self._counters["unpublished"] += removed
            return removed

    def _pending_entry(self, grant: GrantRef) -> _Entry | None:
        entry = self._entries.get(grant.key)
        if (
            entry is None
            or entry.state is not _State.PENDING
            or entry.descriptor.version != grant.version
        ):
            return None
        return entry

    # -- space -------------------------------------------------------------------------

    def _fit(self, size: int) -> tuple[_RegionSlots, int] | None:
        # The region with the most free bytes first: spreads load across nodes.
        best: _RegionSlots | None = None
        for slots in self._regions.values():
            alloc = slots.allocator
            if alloc.largest_free() >= size and (
                best is None or alloc.free_bytes > best.allocator.free_bytes
            ):
                best = slots
        if best is None:
            return None
        offset = best.allocator.allocate(size)
        assert offset is not None
        return best, offset

    def _make_room(self, size: int, now: float) -> None:
        """Evict until ``size`` fits now, or until enough is retired to fit after the grace."""
        while True:
            self._release_retired(now)
            if any(s.allocator.largest_free() >= size for s in self._regions.values()):
                return
            if self._grace > 0 and self._retired_bytes >= size + self._headroom_bytes():
                return
            if not self._evict_one(now):
                return

    def _keep_headroom(self, now: float) -> None:
        target = self._headroom_bytes()
        while self._free_bytes() + self._retired_bytes < target and self._evict_one(now):
            self._release_retired(now)

    def _headroom_bytes(self) -> int:
        return int(self._capacity() * self._headroom)

    def _capacity(self) -> int:
        return sum(s.size for s in self._regions.values())

    def _free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self._regions.values())

    def _evict_one(self, now: float) -> bool:
        """Retire the published entry least worth keeping: LRU, weighted by retention."""
        victim: bytes | None = None
        best_score = -1.0
        for i, key in enumerate(self._lru):
            if i == _EVICTION_SAMPLE:
                break
            entry = self._entries[key]
            age = now - entry.last_use + 1e-3
            score = age / (1.0 + math.log2(max(entry.retention, 1)))
            if score > best_score:
                victim, best_score = key, score
        if victim is None:
            return False
        self._remove(victim, self._entries[victim], now)
        self._counters["evictions"] += 1
        return True

    def _remove(self, key: bytes, entry: _Entry, now: float) -> None:
        del self._entries[key]
        self._lru.pop(key, None)
        d = entry.descriptor
        slots = self._regions.get((d.node, d.region))
        if slots is not None:
            self._retired.append((now + self._grace, slots, d.offset, entry.size))
            self._retired_bytes += entry.size
        if self._grace <= 0:
            self._release_retired(now)

    def _release_retired(self, now: float) -> None:
        while self._retired and self._retired[0][0] <= now:
            _, slots, offset, size = self._retired.popleft()
            self._retired_bytes -= size
            if slots.restored is not None:
                # Its region is still being restored: the slot is simply not reported used.
                slots.restored.remove((offset, size))
            else:
                slots.allocator.free(offset, size)

    def _expire_leases(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            _, key, version = self._pending.popleft()
            entry = self._pending_entry(GrantRef(key=key, version=version))
            if entry is not None:
                self._remove(key, entry, now)
                self._counters["lease_expiries"] += 1

    def tick(self) -> None:
        """Expire leases and free retired slots now (the controller calls this periodically)."""
        with self._lock:
            now = self._clock()
            self._expire_leases(now)
            self._release_retired(now)

    def stats(self) -> dict[str, int]:
        with self._lock:
            capacity = self._capacity()
            free = self._free_bytes()
            published = len(self._lru)
            return {
                **self._counters,
                "nodes": len(self._nodes),
                "entries": published,
                "pending": len(self._entries) - published,
                "capacity_bytes": capacity,
                "free_bytes": free,
                "retired_bytes": self._retired_bytes,
                "used_bytes": capacity - free - self._retired_bytes,
                "stored_payload_bytes": sum(self._entries[k].descriptor.length for k in self._lru),
            }


@hookimpl
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    registry.add(MemoryIndex.name, MemoryIndex)
