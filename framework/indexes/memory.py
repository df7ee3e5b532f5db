"""The in-memory index: entries, grants with leases, eviction, retired slots, restores.

One lock guards everything; every method is one batched call and does O(1) or O(log n)
work per key. Slots of removed entries are *retired*, not freed: a reader may still hold
their descriptor, so they are reused only after ``grace`` seconds, under a new version, and a
stale read can only fail validation — never return another key's bytes.

When a put does not fit, the index makes room that is *usable*: it prices contiguous
windows around the least recently used entries and retired slots (see
:mod:`kvfabric.indexes.memory_space`) and evicts the cheapest, so the value fits at once.
Slots in such a window are reused before their grace period ends: the grace is a courtesy
to readers (fewer validation misses), and turning it into a refused put would cost the
cache its hit rate. A value larger than any region is refused up front, evicting nothing.

With ``replicas=k`` each value is granted on up to k distinct data nodes (the regions with
the most free bytes, one per node). An entry then holds its copies: the one read first and
the others (*alternates*), each with a slot and a version of its own. The key is published
once any copy landed (the first that did is read first; grants the writer did not name are
dropped), eviction and unpublish take every copy, and a lost node or an invalid record costs
only that copy: another is promoted. A put of a stored key that lacks copies (a node was
lost) is granted the missing ones from free space, never by evicting.

The index also keeps its published entries in a lookup image
(:mod:`kvfabric.indexes.memory_image`), written under the same lock as the entries. A
controller serving it lets clients answer lookups without asking; those lookups do not reach
the index, and clients report the keys they used in batches (:meth:`MemoryIndex.touch`), so
eviction still sees the use. Lookups that do reach it are answered from the image too: one C
probe finds the leading run, hands back its descriptors in wire form and stamps each hit's
use beside the image; reported uses are stamped the same way, and the LRU learns of them when
eviction walks it (:meth:`MemoryIndex._evictable`). No step per key runs in Python.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

import attrs

from kvfabric._runtime.image import ImageStop, alternate_key, first_bad_key
from kvfabric.descriptor import Descriptor, PackedDescriptors
from kvfabric.indexes.memory_extents import MIN_RECORD, LeasedExtent
from kvfabric.indexes.memory_image import MemoryImage, NoImage
from kvfabric.indexes.memory_space import Plan, RegionSpace
from kvfabric.spi import (
    SLOT_ALIGN,
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeEndpoint,
    NodeInfo,
    OptionSpec,
    Region,
    Registry,
    hookimpl,
    parse_size,
    record_size,
)

__all__ = ["MemoryIndex"]

# Bytes of the lookup image by default: 2 ** 18 buckets, ~64k entries at a quarter full
# (its pages are only backed once written).
_IMAGE_SIZE = 16 << 20
# How many of the least recently used entries an eviction compares (sampled LRU).
_EVICTION_SAMPLE = 8
# How many candidate windows (around the oldest entries, and around retired slots) a put
# that does not fit prices before evicting the cheapest.
_WINDOW_SEEDS = 16
# How far past the head of the retirement queue a put looks for retired slots to seed
# windows with (slots reused early are skipped, so more than the seeds it wants).
_RETIRED_LOOKAHEAD = 4 * _WINDOW_SEEDS

_COUNTERS = (
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
    "oversize",
    "published",
    "publish_rejected",
    "aborted",
    "unpublished",
    "evictions",
    "early_reuse",
    "lease_expiries",
    "invalid_reports",
    "restored",
    "restore_duplicates",
    "restore_overlaps",
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
# An extent is at most this share of the capacity taking grants (and never less than the
# writer needs): writers holding extents they have not filled must not starve the others.
_EXTENT_SHARE = 1 / 16


class _State(enum.Enum):
    PENDING = 1
    PUBLISHED = 2


class _Entry:
    __slots__ = (
        "alternates",
        "descriptor",
        "grants",
        "last_use",
        "lease_deadline",
        "retention",
        "size",
        "state",
    )

    def __init__(self, descriptor: Descriptor, size: int, lease_deadline: float) -> None:
        self.descriptor = descriptor
        """PENDING: the first grant; PUBLISHED: the copy read first."""
        self.alternates: tuple[Descriptor, ...] = ()
        """The other published copies, each on another node."""
        self.grants: dict[int, Descriptor] | None = None
        """Version -> copy granted and not published yet (PENDING: all of them, the first
        included; PUBLISHED: copies granted to repair it); None when there are none."""
        self.size = size
        self.state = _State.PENDING
        self.lease_deadline = lease_deadline
        self.last_use = 0.0
        self.retention = 0

    def copies(self) -> tuple[Descriptor, ...]:
        """The published copies, the one read first first."""
        return (self.descriptor, *self.alternates)


class MemoryIndex(IndexPlugin):
    """The built-in index, held in this process's memory (a controller's, or embedded).

    Thread-safe.
    """

    name = "memory"
    supports_replicas = True
    options = (
        OptionSpec(
            name="image",
            parse=parse_size,
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
        retired slot waits before reuse. ``headroom``: share of capacity kept free (or on its
        way to free) by evicting ahead of need, so writers rarely wait for a grace period.
        ``image_size``: bytes of the lookup image (0: none; lookups then walk the entries).
        ``replicas``: copies of each value, on distinct data nodes.
        """
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self._replicas = replicas
        self._lease = lease
        self._grace = grace
        self._headroom = headroom
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._pending: deque[tuple[float, bytes, int]] = deque()
        self._extents: dict[int, LeasedExtent] = {}
        self._next_extent = 0
        self._nodes_generation = 0
        """Grows whenever a node registers or leaves; in the image's header, and in each
        extent leased (a writer holding one sees in the image that its node changed)."""
        # (reusable at, region, offset, retirement token), oldest first.
        self._retired: deque[tuple[float, RegionSpace, int, int]] = deque()
        self._retired_bytes = 0
        self._regions: dict[tuple[int, int], RegionSpace] = {}
        self._nodes: dict[int, NodeInfo] = {}
        self._node_ids: dict[str, int] = {}
        self._next_node_id = 0
        self._next_incarnation = 0
        # Seeded from the wall clock so a restarted index never reissues a version that
        # records from before the restart may still carry.
        self._next_version = time.time_ns()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Eviction ahead of need (_keep_headroom) after a grant: done in the grant's call,
        # until an owner calls idle(); from then on left to it, off the grant's reply.
        self._idle_owner = False
        self._headroom_owed = False
        self._evictions_unreported = 0
        """Evictions idle() made, for the next grant's result to report."""
        # Kept from the start, served or not: it answers lookups by RPC in C too (see
        # lookup_copies).
        self._image: MemoryImage | NoImage = NoImage()
        if image_size > 0:
            self._image = MemoryImage(image_size)

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
            self._nodes_changed()
            wanted = {region.id: region for region in info.regions}
            for (node, region_id), space in list(self._regions.items()):
                if node != node_id:
                    continue
                region = wanted.get(region_id)
                if (
                    info.restoring
                    or region is None
                    or (region.rkey, region.size) != (space.rkey, space.size)
                ):
                    self._drop_region(space)
            for region in info.regions:
                if (node_id, region.id) not in self._regions:
                    self._regions[(node_id, region.id)] = RegionSpace(
                        node_id, region.id, region.rkey, region.size, restoring=info.restoring
                    )
            return registered

    def heartbeat(self, node: int, incarnation: int) -> bool:
        with self._lock:
            known = self._nodes.get(node)
            return known is not None and known.incarnation == incarnation

    def remove_node(self, node: int) -> int:
        with self._lock:
            if self._nodes.pop(node, None) is None:
                return 0
            self._nodes_changed()
            spaces = [s for (n, _), s in self._regions.items() if n == node]
            return sum(self._drop_region(space) for space in spaces)

    def _nodes_changed(self) -> None:
        self._nodes_generation = (self._nodes_generation + 1) & 0xFFFFFFFF
        self._image.set_nodes_generation(self._nodes_generation)

    def _drop_region(self, space: RegionSpace) -> int:
        """The region is gone: its copies go; returns how many entries went with them (an
        entry with a copy elsewhere stays, that copy promoted)."""
        del self._regions[(space.node, space.region)]
        self._extents = {i: held for i, held in self._extents.items() if held.space is not space}
        dropped = 0
        for key, _ in space.occupants.values():
            entry = self._entries.get(key)
            if entry is not None and self._forget_copy(key, entry, space.node, space.region):
                dropped += 1
        self._retired = deque(r for r in self._retired if r[1] is not space)
        self._retired_bytes -= sum(size for size, _ in space.retired.values())
        return dropped

    def _forget_copy(self, key: bytes, entry: _Entry, node: int, region: int) -> bool:
        """Take the entry's copy in (node, region) out of it (its slot is not touched: the
        caller owns it); True when that was the last copy and the entry went."""
        if entry.grants:
            for version, d in list(entry.grants.items()):
                if (d.node, d.region) == (node, region):
                    del entry.grants[version]
            entry.grants = entry.grants or None
        if entry.state is _State.PENDING:
            if entry.grants:
                entry.descriptor = next(iter(entry.grants.values()))
                return False
            del self._entries[key]
            return True
        copies = entry.copies()
        kept = tuple(d for d in copies if (d.node, d.region) != (node, region))
        if len(kept) == len(copies):
            return False
        self._counters["replicas_dropped"] += 1
        if not kept:
            del self._entries[key]
            self._lru.pop(key, None)
            self._hide(key)
            return True
        self._set_copies(key, entry, kept)
        return False

    def _set_copies(self, key: bytes, entry: _Entry, copies: Sequence[Descriptor]) -> None:
        """A published entry's copies changed (one lost, or one added)."""
        if copies[0] is not entry.descriptor:
            self._counters["promotions"] += 1
        entry.descriptor, entry.alternates = copies[0], tuple(copies[1:])
        self._show(key, entry)

    # -- the lookup image ------------------------------------------------------------------

    def _show(self, key: bytes, entry: _Entry) -> None:
        """Put a published entry into the image: its copy read first under its key, each
        other copy under :func:`alternate_key` (those it no longer has come out)."""
        image = self._image
        image.put(entry.descriptor)
        if self._replicas == 1 or isinstance(image, NoImage):
            return
        for n in range(1, self._replicas):
            if n <= len(entry.alternates):
                image.put(attrs.evolve(entry.alternates[n - 1], key=alternate_key(key, n)))
            else:
                image.remove(alternate_key(key, n))

    def _hide(self, key: bytes) -> None:
        """Take a key out of the image, its alternates with it."""
        image = self._image
        image.remove(key)
        if self._replicas == 1 or isinstance(image, NoImage):
            return
        for n in range(1, self._replicas):
            image.remove(alternate_key(key, n))

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        with self._lock:
            now = self._clock()
            kept = 0
            for record in records:
                space = self._regions.get((node, record.region))
                if space is None or space.restored is None:
                    continue
                size = record_size(record.length)
                if record.offset % SLOT_ALIGN or record.offset + size > space.size:
                    continue
                if record.offset in space.occupants:
                    self._counters["restore_duplicates"] += 1
                    continue
                # Nodes report their records addressed (their id, each region's rkey).
                descriptor = (
                    record
                    if (record.node, record.rkey) == (node, space.rkey)
                    else attrs.evolve(record, node=node, rkey=space.rkey)
                )
                entry = self._entries.get(record.key)
                if entry is not None:
                    # A key found on two nodes: one more copy while it has fewer than
                    # ``replicas`` (and none on this node), else a duplicate.
                    copies = entry.copies()
                    if (
                        entry.state is not _State.PUBLISHED
                        or entry.grants
                        or len(copies) >= self._replicas
                        or any(d.node == node for d in copies)
                        or entry.size != size
                    ):
                        self._counters["restore_duplicates"] += 1
                        continue
                    space.occupy(record.offset, size, record.key)
                    self._set_copies(record.key, entry, (*copies, descriptor))
                    kept += 1
                    continue
                entry = _Entry(descriptor, size, lease_deadline=0.0)
                entry.state = _State.PUBLISHED
                entry.last_use = now
                self._entries[record.key] = entry
                self._lru[record.key] = None
                self._image.put(descriptor)
                space.occupy(record.offset, size, record.key)
                kept += 1
            self._counters["restored"] += kept
            return kept

    def restore_done(self, node: int) -> None:
        with self._lock:
            for (owner, _), space in self._regions.items():
                if owner != node or space.restored is None:
                    continue
                keys, retired_bytes = space.finish_restore()
                self._retired_bytes -= retired_bytes
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is not None:
                        self._forget_copy(key, entry, space.node, space.region)
                self._counters["restore_overlaps"] += len(keys)

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return list(self._nodes.values())

    # -- lookups -----------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        # One walk for both: the image's probe, then the entries where it cannot tell.
        return [d for d in self.lookup_copies(keys).descriptors if d is not None]

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return list(self.resolve_copies(keys).descriptors)

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        with self._lock:
            now = self._clock()
            # The image answers the leading run in C, its descriptors already in wire form
            # (the reply needs no per-key encoding), and stamps each hit's use there (the
            # LRU learns of it when eviction walks it). With replicas the probe would not
            # find the alternates, and a key that is not 32 bytes names no entry: the loop
            # below answers.
            hits, stop, wires = (
                self._image.prefix(keys, now)
                if self._replicas == 1 and first_bad_key(keys) < 0
                else (0, ImageStop.UNUSABLE, b"")
            )
            entries, touch = self._entries, self._lru.move_to_end
            found: list[Descriptor] = []
            alternates: dict[int, tuple[Descriptor, ...]] = {}
            if hits < len(keys) and stop != ImageStop.MISS:
                # A key the image cannot answer for (its window overflowed; or no image):
                # the entries answer from there on.
                published = _State.PUBLISHED
                for key in itertools.islice(keys, hits, None):
                    entry = entries.get(key)
                    if entry is None or entry.state is not published:
                        break
                    entry.last_use = now
                    touch(key)
                    if entry.alternates:
                        alternates[hits + len(found)] = entry.alternates
                    found.append(entry.descriptor)
            self._counters["lookups"] += 1
            self._counters["lookup_keys"] += len(keys)
            self._counters["prefix_hits"] += hits + len(found)
            if not hits:
                return Copies(descriptors=found, alternates=alternates)
            if found:
                wires += b"".join(d.to_bytes() for d in found)
            return Copies(descriptors=PackedDescriptors(wires), alternates=alternates)

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        with self._lock:
            now = self._clock()
            out: list[Descriptor | None] = []
            alternates: dict[int, tuple[Descriptor, ...]] = {}
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None or entry.state is not _State.PUBLISHED:
                    out.append(None)
                    continue
                self._touch(key, entry, now)
                if entry.alternates:
                    alternates[i] = entry.alternates
                out.append(entry.descriptor)
            self._counters["resolves"] += 1
            self._counters["resolve_hits"] += sum(d is not None for d in out)
            return Copies(descriptors=out, alternates=alternates)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._counters["exists_calls"] += 1
            probe = self._replicas == 1 and first_bad_key(keys) < 0
            states = self._image.exists(keys) if probe else b""
            if states and ImageStop.UNKNOWN not in states:
                return [state == ImageStop.HIT for state in states]
            published = _State.PUBLISHED
            return [(e := self._entries.get(k)) is not None and e.state is published for k in keys]

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            now = self._clock()
            if first_bad_key(keys) >= 0:
                keys = [k for k in keys if type(k) is bytes]  # the others name no entry
            # Keys in the image are stamped there in C; those it cannot tell of (spilled)
            # are touched one by one.
            states = self._image.exists(keys, used_at=now)
            if ImageStop.UNKNOWN in states:
                entries, published = self._entries, _State.PUBLISHED
                for key, state in zip(keys, states, strict=True):
                    entry = entries.get(key) if state == ImageStop.UNKNOWN else None
                    if entry is not None and entry.state is published:
                        self._touch(key, entry, now)
            self._counters["touches"] += 1
            self._counters["touched_keys"] += len(keys)

    def lookup_image(self) -> Region | None:
        with self._lock:
            return self._image.region if isinstance(self._image, MemoryImage) else None

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
            self._settle_headroom(now)
            # Region sizes do not change while the lock is held: the largest record any
            # region taking grants could hold, once per call rather than per key.
            largest = max((s.size for s in self._regions.values() if s.restored is None), default=0)
            out = [self._allocate_one(req, now, largest) for req in requests]
            self._headroom_after_grants(now)
            return AllocateResult(
                allocations=tuple(out),
                evictions=self._evictions_to_report(evictions_before),
                lease=self._lease,
            )

    def _allocate_one(self, req: AllocationRequest, now: float, largest: int) -> Allocation:
        entry = self._entries.get(req.key)
        if entry is not None:
            if entry.state is _State.PUBLISHED:
                entry.retention += 1
                self._touch(req.key, entry, now)
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
            self._counters["oversize"] += size > max(
                (s.size for s in self._regions.values()), default=0
            )
            return Allocation(kind=AllocationKind.NO_SPACE)
        first = self._place(req, size, now, set(), evict=True)
        if first is None:
            self._counters["no_space"] += 1
            return Allocation(kind=AllocationKind.NO_SPACE)
        entry = _Entry(first, size, now + self._lease)
        self._entries[req.key] = entry
        copies = [first]
        for _ in range(self._replicas - 1):
            copy = self._place(req, size, now, {d.node for d in copies}, evict=True)
            if copy is None:
                self._counters["replica_shortfall"] += self._replicas - len(copies)
                break
            copies.append(copy)
        entry.grants = {d.version: d for d in copies}
        self._counters["grants"] += 1
        self._counters["replica_grants"] += len(copies) - 1
        return Allocation(kind=AllocationKind.GRANTED, descriptor=first, replicas=tuple(copies[1:]))

    def _repair(self, req: AllocationRequest, entry: _Entry, now: float) -> tuple[Descriptor, ...]:
        """Grants of the copies a stored key lacks (a node holding one was lost), from free
        space only: a repair never evicts (it might evict the very entry it repairs)."""
        if entry.grants or self._replicas == 1:
            return ()
        copies = entry.copies()
        if len(copies) >= self._replicas:
            return ()
        nodes = {d.node for d in copies}
        grants: list[Descriptor] = []
        for _ in range(self._replicas - len(copies)):
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
        placed = self._fit(size, exclude)
        if placed is None and evict:
            self._make_room(size, now, exclude)
            placed = self._fit(size, exclude)
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

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        with self._lock:
            now = self._clock()
            out: list[bool] = []
            landed: dict[bytes, list[Descriptor]] = {}
            for grant in grants:
                found = self._granted(grant)
                ok = found is not None and found[0].lease_deadline > now
                if ok and found is not None:
                    entry, copy = found
                    assert entry.grants is not None
                    del entry.grants[grant.version]
                    landed.setdefault(grant.key, []).append(copy.with_crc(grant.crc))
                else:
                    self._counters["publish_rejected"] += 1
                out.append(ok)
            for key, copies in landed.items():
                self._publish_copies(key, self._entries[key], copies, now)
            return out

    def _publish_copies(
        self, key: bytes, entry: _Entry, copies: list[Descriptor], now: float
    ) -> None:
        """Copies of ``key`` landed: it is readable from them; its grants not named go."""
        for d in (entry.grants or {}).values():
            self._vacate(key, d, entry.size, now)
            self._counters["replicas_dropped"] += 1
        entry.grants = None
        if entry.state is _State.PENDING:
            self._counters["replicas_published"] += len(copies) - 1
            entry.state = _State.PUBLISHED
            entry.retention = 1
            entry.last_use = now
            entry.descriptor, entry.alternates = copies[0], tuple(copies[1:])
            self._lru[key] = None
            self._show(key, entry)
            self._counters["published"] += 1
        else:
            # Copies repairing a stored key.
            self._counters["replicas_published"] += len(copies)
            self._set_copies(key, entry, (*entry.copies(), *copies))

    def abort(self, grants: Sequence[GrantRef]) -> None:
        with self._lock:
            now = self._clock()
            for grant in grants:
                found = self._granted(grant)
                if found is None:
                    continue
                entry, copy = found
                assert entry.grants is not None
                del entry.grants[grant.version]
                # A write may still be landing in the slot: retire it, do not free it.
                self._vacate(grant.key, copy, entry.size, now)
                self._counters["aborted"] += 1
                if not entry.grants:
                    entry.grants = None
                    if entry.state is _State.PENDING:
                        del self._entries[grant.key]

    # -- extents -----------------------------------------------------------------------

    def leases_extents(self) -> bool:
        # With replicas each key's copies are placed per key, on distinct nodes, and a put
        # of a stored key is how its lost copies are granted again (allocate's EXISTS).
        return self._replicas == 1

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
            self._expire_leases(now)
            self._release_retired(now)
            for extent_id in returned:
                held = self._extents.get(extent_id)
                if held is not None:
                    self._end_extent(held, now)
                    self._counters["extents_returned"] += 1
            if need <= 0 or self._replicas > 1:
                # With replicas every key's copies are placed on distinct nodes, per key.
                return []
            need = _aligned(need)
            granting = [s.size for s in self._regions.values() if s.restored is None]
            if need > max(granting, default=0):
                self._counters["no_space"] += 1
                return []
            want = max(need, min(_aligned(want), _aligned(int(sum(granting) * _EXTENT_SHARE))))
            evictions_before = self._counters["evictions"]
            self._settle_headroom(now)
            nodes = set(exclude)
            out: list[Extent] = []
            for _ in range(count):
                extent = self._lease_one(need, want, nodes, now)
                if extent is None:
                    break
                nodes.add(extent.node)
                out.append(extent)
            self._headroom_after_grants(now)
            evictions = self._evictions_to_report(evictions_before)
            if out and evictions:
                out[0] = attrs.evolve(out[0], evictions=evictions)
            elif evictions:
                self._evictions_unreported = evictions  # no extent to tell: the next grant
            return out

    def _lease_one(self, need: int, want: int, exclude: set[int], now: float) -> Extent | None:
        """An extent on a node not in ``exclude``: ``want`` bytes of free space, else
        ``need`` bytes, evicting for them."""
        size, placed = want, self._fit(want, exclude)
        if placed is None:
            size, placed = need, self._fit(need, exclude)
        if placed is None:
            self._make_room(need, now, exclude)
            placed = self._fit(need, exclude)
        if placed is None:
            if not exclude:
                self._counters["no_space"] += 1
            return None
        space, offset = placed
        versions = size // MIN_RECORD
        self._next_extent += 1
        extent = Extent(
            id=self._next_extent,
            node=space.node,
            region=space.region,
            rkey=space.rkey,
            offset=offset,
            size=size,
            first_version=self._next_version + 1,
            versions=versions,
            lease=self._lease,
            nodes_generation=self._nodes_generation,
        )
        self._next_version += versions
        self._extents[extent.id] = LeasedExtent(extent, space, now + self._lease)
        self._counters["extents_leased"] += 1
        return extent

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes] = ()
    ) -> list[CarveOutcome]:
        with self._lock:
            now = self._clock()
            for key in again:
                entry = self._entries.get(key)
                if entry is not None and entry.state is _State.PUBLISHED:
                    entry.retention += 1
                    self._touch(key, entry, now)
                    self._counters["dedup_hits"] += 1
            out: list[CarveOutcome] = []
            held: LeasedExtent | None = None
            for record in records:
                if held is None or held.extent.id != record.extent:
                    held = self._live_extent(record.extent, now)
                size = None if held is None else held.slot_of(record)
                if held is None or size is None:
                    self._counters["carve_refused"] += 1
                    out.append(CarveOutcome.REFUSED)
                    continue
                leased, space = held.extent, held.space
                if record.offset > held.cursor:
                    # Space skipped (a record not published): back, as an aborted grant's.
                    self._retire_unused(space, held.cursor, record.offset - held.cursor, now)
                held.cursor = record.offset + size
                held.next_version = record.version + 1
                if held.cursor == leased.end:
                    del self._extents[leased.id]  # used up: nothing left to take back
                key = record.key
                entry = self._entries.get(key)
                if entry is not None:
                    self._retire_unused(space, record.offset, size, now)
                    if entry.state is _State.PUBLISHED:
                        entry.retention += 1
                        self._touch(key, entry, now)
                        self._counters["dedup_hits"] += 1
                        out.append(CarveOutcome.EXISTS)
                    else:
                        self._counters["in_flight"] += 1
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
                entry = _Entry(descriptor, size, 0.0)
                entry.state = _State.PUBLISHED
                entry.retention = 1
                entry.last_use = now
                self._entries[key] = entry
                self._lru[key] = None
                self._show(key, entry)
                out.append(CarveOutcome.STORED)
            stored = out.count(CarveOutcome.STORED)
            self._counters["published"] += stored
            self._counters["carved"] += stored
            return out

    def _live_extent(self, extent: int, now: float) -> LeasedExtent | None:
        """The extent, while its lease lasts (one whose lease ran out ends now)."""
        held = self._extents.get(extent)
        if held is not None and held.deadline <= now:
            self._end_extent(held, now)
            self._counters["extent_expiries"] += 1
            return None
        return held

    def _end_extent(self, held: LeasedExtent, now: float) -> None:
        """The extent's writer is done with it (or its lease ran out): its unused part is
        taken back, retired first in case a write to it is still landing."""
        del self._extents[held.extent.id]
        if self._regions.get((held.extent.node, held.extent.region)) is not held.space:
            return  # the region went (or was restored): the space is not the index's to free
        if held.cursor < held.extent.end:
            self._retire_unused(held.space, held.cursor, held.extent.end - held.cursor, now)

    def _retire_unused(self, space: RegionSpace, offset: int, size: int, now: float) -> None:
        token = space.retire(offset, size)
        if self._grace <= 0:
            space.release(offset, token)
            return
        self._retired.append((now + self._grace, space, offset, token))
        self._retired_bytes += size

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

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        """Readers found these published records invalid: unpublish each that is still
        the published version of its copy, so the next put of its key stores it again (a
        key with another copy keeps it, promoted if need be)."""
        with self._lock:
            now = self._clock()
            dropped = 0
            for record in records:
                entry = self._entries.get(record.key)
                if entry is None or entry.state is not _State.PUBLISHED:
                    continue
                copies = entry.copies()
                bad = next((d for d in copies if d.version == record.version), None)
                if bad is None:
                    continue
                dropped += 1
                if len(copies) == 1:
                    self._remove(record.key, entry, now)
                    continue
                self._vacate(record.key, bad, entry.size, now)
                self._counters["replicas_dropped"] += 1
                self._set_copies(record.key, entry, [d for d in copies if d is not bad])
            self._counters["invalid_reports"] += dropped
            return dropped

    def _granted(self, grant: GrantRef) -> tuple[_Entry, Descriptor] | None:
        """The entry and the copy a grant names, while it is granted and not published."""
        entry = self._entries.get(grant.key)
        if entry is None or not entry.grants:
            return None
        copy = entry.grants.get(grant.version)
        return None if copy is None else (entry, copy)

    # -- space -------------------------------------------------------------------------

    def _fit(self, size: int, exclude: set[int]) -> tuple[RegionSpace, int] | None:
        # The region with the most free bytes first: spreads load across nodes. Nodes in
        # ``exclude`` already hold a copy of the value.
        best: RegionSpace | None = None
        for space in self._regions.values():
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

    def _make_room(self, size: int, now: float, exclude: set[int]) -> None:
        """Evict the cheapest contiguous window that holds ``size`` bytes (on a node not in
        ``exclude``).

        Candidate windows grow around the least recently used entries and the oldest
        retired slots; each is priced by what it would evict (recent and often-stored
        entries cost more). When none can grow big enough (grants being written or leased
        extents block them), one pass over each region finds where a window can; where
        none can, nothing is evicted. Evicting the oldest entry and searching again
        instead emptied a 512 MiB store of 2,000 entries and held the controller for 72 s
        when a lease could not be had (half the region leased to a writer).
        """
        if any(
            s.allocator.largest_free() >= size and s.node not in exclude
            for s in self._regions.values()
        ):
            return
        plans = self._candidate_windows(size, now, exclude) or self._any_windows(size, now, exclude)
        if plans:
            self._evict_window(min(plans, key=lambda plan: plan.cost), now)

    def _keep_value(self, key: bytes, now: float) -> float | None:
        """What evicting an entry costs (None: it is being written, never evicted)."""
        entry = self._entries[key]
        if entry.state is not _State.PUBLISHED:
            return None
        # A neighbour in a window, not walked in LRU order: its last use may be only in the
        # image's stamp.
        entry.last_use = max(entry.last_use, self._image.last_use(key))
        return 1.0 / _eviction_score(entry, now)

    def _candidate_windows(self, size: int, now: float, exclude: set[int]) -> list[Plan]:
        """Windows that would hold ``size`` bytes on nodes not in ``exclude``; a single one
        when a window evicting nothing exists (none is cheaper)."""
        keep_value = functools.partial(self._keep_value, now=now)
        plans: list[Plan] = []
        # A slot reused before its grace ended stays queued until its time comes. Under
        # churn such slots pile up at the head by the thousand (the oldest retired slots are
        # the seeds reused first), and every put that did not fit walked past all of them:
        # drop those at the head, and look at a bounded stretch past it.
        retired = self._retired
        while retired and not _still_retired(retired[0]):
            retired.popleft()
        seeds = 0
        for queued in itertools.islice(retired, _RETIRED_LOOKAHEAD):
            if seeds == _WINDOW_SEEDS:
                break
            space = queued[1]
            if space.node in exclude or not _still_retired(queued):
                continue
            seeds += 1
            plan = space.plan(queued[2], size, keep_value)
            if plan is not None:
                if not plan.victims:
                    # Retired and free space only: nothing cheaper exists (under churn of
                    # equal-sized values, the common case), so price nothing else.
                    return [plan]
                plans.append(plan)
        for _, entry, held_in in itertools.islice(self._evictable(), _WINDOW_SEEDS):
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
            return self._entries[key].state is _State.PUBLISHED

        plans: list[Plan] = []
        for space in self._regions.values():
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
            self._remove(key, self._entries[key], now, immediate=True)
            self._counters["evictions"] += 1
        for offset in plan.retired:
            self._retired_bytes -= plan.space.release(offset)
            self._counters["early_reuse"] += 1

    def _evictable(self) -> Iterator[tuple[bytes, _Entry, RegionSpace]]:
        """Published entries whose eviction frees space grants can use, least recently
        used first, with the region their first copy is in.

        Lookups that the image answered stamped their uses there, not in the LRU: an entry
        stamped since it was queued is passed over (a second chance) and, once the walk
        stops, queued again as used then. A walk that reaches the end yields those last,
        least recently used first, so something is always found to evict.

        Entries of a region still being restored are skipped: its space takes no grant
        until the node is done, so evicting them would only lose hits.
        """
        entries, regions, last_use = self._entries, self._regions, self._image.last_use

        def granting(entry: _Entry) -> RegionSpace | None:
            d = entry.descriptor
            space = regions.get((d.node, d.region))
            return space if space is not None and space.restored is None else None

        used_since: list[tuple[float, bytes]] = []
        try:
            for key in self._lru:
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
            if entry is not None and entry.state is _State.PUBLISHED and entry.last_use < when:
                self._touch(key, entry, when)

    def idle(self) -> None:
        """Evict ahead of need now if a grant left it owed (see :meth:`_keep_headroom`).

        From an owner's first call on, a grant leaves that eviction to this, so the grant's
        reply does not wait for it: in a full store it was ~1 ms of a 1.1 ms extent lease
        (64 evictions), measured here in-process.
        """
        with self._lock:
            self._idle_owner = True
            if not self._headroom_owed:
                return
            before = self._counters["evictions"]
            self._settle_headroom(self._clock())
            self._evictions_unreported += self._counters["evictions"] - before

    def _headroom_after_grants(self, now: float) -> None:
        if self._idle_owner:
            self._headroom_owed = True
        else:
            self._keep_headroom(now)

    def _settle_headroom(self, now: float) -> None:
        """What idle() has not done yet is done first: the headroom never lags more than
        one grant behind, whether or not the owner calls it."""
        if self._headroom_owed:
            self._headroom_owed = False
            self._keep_headroom(now)

    def _evictions_to_report(self, before: int) -> int:
        """Evictions this call made (since ``before``), and those idle() made since the
        last report: each eviction is reported to some writer once."""
        reported = self._counters["evictions"] - before + self._evictions_unreported
        self._evictions_unreported = 0
        return reported

    def _keep_headroom(self, now: float) -> None:
        """Evict ahead of need until free and retired space make the headroom.

        A put of many keys into a full store falls short by about one entry a key. The
        entries to go are chosen in one pass over the LRU's head for the whole shortfall,
        not by a fresh sample per entry (which cost ~20 µs an eviction in the controller).
        """
        target = self._headroom_bytes()
        short = target - self._free_bytes() - self._retired_bytes
        if short <= 0:
            return
        for key in self._least_worth_keeping(short, now):
            self._remove(key, self._entries[key], now)
            self._counters["evictions"] += 1
            if self._free_bytes() + self._retired_bytes >= target:
                return
        # The ranked entries freed less than they hold (copies already vacated).
        while self._free_bytes() + self._retired_bytes < target and self._evict_one(now):
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
        for key, entry, _ in self._evictable():
            if held >= short:
                if past == _EVICTION_SAMPLE - 1:
                    break
                past += 1
            ranked.append((_eviction_score(entry, now), key))
            held += entry.size * (1 + len(entry.alternates))
        # Stable: of equal worth, the older goes first.
        ranked.sort(key=_first, reverse=True)
        return [key for _, key in ranked]

    def _headroom_bytes(self) -> int:
        granting = sum(s.size for s in self._regions.values() if s.restored is None)
        return int(granting * self._headroom)

    def _capacity(self) -> int:
        return sum(s.size for s in self._regions.values())

    def _free_bytes(self) -> int:
        return sum(s.allocator.free_bytes for s in self._regions.values())

    def _evict_one(self, now: float) -> bool:
        """Retire the published entry least worth keeping: LRU, weighted by retention."""
        victim: bytes | None = None
        best_score = -1.0
        for key, entry, _ in itertools.islice(self._evictable(), _EVICTION_SAMPLE):
            score = _eviction_score(entry, now)
            if score > best_score:
                victim, best_score = key, score
        if victim is None:
            return False
        self._remove(victim, self._entries[victim], now)
        self._counters["evictions"] += 1
        return True

    def _remove(self, key: bytes, entry: _Entry, now: float, *, immediate: bool = False) -> None:
        """Take an entry out with every copy; their slots retire (or are free at once:
        ``immediate``, no grace)."""
        del self._entries[key]
        self._lru.pop(key, None)
        if entry.state is _State.PUBLISHED:
            self._hide(key)
            for d in entry.copies():
                self._vacate(key, d, entry.size, now, immediate=immediate)
        for d in (entry.grants or {}).values():
            self._vacate(key, d, entry.size, now, immediate=immediate)

    def _vacate(
        self, key: bytes, d: Descriptor, size: int, now: float, *, immediate: bool = False
    ) -> None:
        """One copy's slot leaves its key: it retires (or is free at once)."""
        space = self._regions.get((d.node, d.region))
        if space is None or space.occupants.get(d.offset, (None,))[0] != key:
            return
        token = space.vacate(d.offset)
        if immediate or self._grace <= 0:
            space.release(d.offset, token)
            return
        self._retired.append((now + self._grace, space, d.offset, token))
        self._retired_bytes += size

    def _release_retired(self, now: float) -> None:
        while self._retired and self._retired[0][0] <= now:
            _, space, offset, token = self._retired.popleft()
            # Zero when the slot was already reused early (its token no longer matches).
            self._retired_bytes -= space.release(offset, token)

    def _expire_leases(self, now: float) -> None:
        for held in [held for held in self._extents.values() if held.deadline <= now]:
            self._end_extent(held, now)
            self._counters["extent_expiries"] += 1
        while self._pending and self._pending[0][0] <= now:
            _, key, version = self._pending.popleft()
            found = self._granted(GrantRef(key=key, version=version))
            if found is None:
                continue
            entry, copy = found
            assert entry.grants is not None
            del entry.grants[version]
            self._vacate(key, copy, entry.size, now)
            self._counters["lease_expiries"] += 1
            if not entry.grants:
                entry.grants = None
                if entry.state is _State.PENDING:
                    del self._entries[key]

    def tick(self) -> None:
        """Expire leases and free retired slots now (the controller calls this periodically)."""
        with self._lock:
            now = self._clock()
            self._expire_leases(now)
            self._release_retired(now)
            self._image.beat()

    def close(self) -> None:
        with self._lock:
            image, self._image = self._image, NoImage()
        image.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            capacity = self._capacity()
            free = self._free_bytes()
            published = len(self._lru)
            extent_bytes = sum(h.extent.end - h.cursor for h in self._extents.values())
            return {
                **self._counters,
                "nodes": len(self._nodes),
                "entries": published,
                "pending": len(self._entries) - published,
                "capacity_bytes": capacity,
                "free_bytes": free,
                "retired_bytes": self._retired_bytes,
                "extents": len(self._extents),
                # Leased to writers and not carved yet: neither free nor used.
                "extent_bytes": extent_bytes,
                "used_bytes": capacity - free - self._retired_bytes - extent_bytes,
                # Every copy's payload.
                "stored_payload_bytes": sum(
                    (1 + len(e.alternates)) * e.descriptor.length
                    for e in map(self._entries.__getitem__, self._lru)
                ),
                **self._image.stats(),
            }


def _aligned(size: int) -> int:
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


def _still_retired(queued: tuple[float, RegionSpace, int, int]) -> bool:
    """Whether a queued retirement still holds its slot (not released, nor reused early)."""
    _, space, offset, token = queued
    held = space.retired.get(offset)
    return held is not None and held[1] == token


def _first(ranked: tuple[float, bytes]) -> float:
    return ranked[0]


def _eviction_score(entry: _Entry, now: float) -> float:
    """How little a published entry is worth keeping: its age, less for one stored by many
    writers (the higher, the sooner it goes)."""
    return (now - entry.last_use + 1e-3) / _weight(entry)


def _weight(entry: _Entry) -> float:
    """How much more an entry stored by many writers is worth keeping than one stored once."""
    return 1.0 + math.log2(max(entry.retention, 1))


@hookimpl
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    registry.add(MemoryIndex.name, MemoryIndex)
