"""The memory index's entries: the table of keys, their LRU order, and the lookups it answers.

An entry is PENDING while its grants are being written and PUBLISHED once a copy landed;
only published entries are in the LRU and in the lookup image
(:mod:`kvfabric.indexes.memory_image`), which the table keeps in step with them.

Lookups that reach the index are answered from the image first: one C probe finds the
leading run, hands back its descriptors in wire form and stamps each hit's use beside the
image; the table answers from where the image cannot tell (a spilled key, replicas, no
image). Uses clients report (:meth:`EntryTable.touch`) are stamped the same way, and the
LRU learns of stamped uses when eviction walks it
(:meth:`~kvfabric.indexes.memory_eviction.Eviction.evictable`). No step per key runs in
Python where the image answers.

Where the index reports KV events (:mod:`kvfabric.spi.events`), the table tells its
:attr:`EntryTable.events` of every published entry that goes, whatever removes it, naming
the engine hash its writer attached (:attr:`Entry.engine`); the parts that publish tell it
of what they publish.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvfabric._runtime.image import ImageStop, first_bad_key
from kvfabric.descriptor import Descriptor, PackedDescriptors
from kvfabric.indexes.memory_image import MemoryImage, NoImage
from kvfabric.indexes.memory_regions import Regions
from kvfabric.spi import Copies, EngineBlock, GrantRef, IndexEvents

__all__ = ["Entry", "EntryState", "EntryTable"]


class EntryState(enum.Enum):
    PENDING = 1
    PUBLISHED = 2


class Entry:
    __slots__ = (
        "alternates",
        "descriptor",
        "engine",
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
        self.state = EntryState.PENDING
        self.lease_deadline = lease_deadline
        self.last_use = 0.0
        self.retention = 0
        self.engine: bytes | int | None = None
        """The engine's hash of the block, where its writer attached one and the index
        reports events (its removal then names it): one slot per entry, and the hash
        itself (a 65-byte object for vLLM's SHA-256 digests) only where there is one."""

    def copies(self) -> tuple[Descriptor, ...]:
        """The published copies, the one read first first."""
        return (self.descriptor, *self.alternates)


class EntryTable:
    """Every entry by key, the published ones in LRU order and in the image; not
    thread-safe (the index's lock guards it)."""

    def __init__(
        self,
        *,
        image: MemoryImage | NoImage,
        regions: Regions,
        replicas: int,
        counters: dict[str, int],
    ) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        """Published keys, least recently used first (uses the image stamped are learnt
        when eviction walks it)."""
        self.image = image
        """Replaced by a :class:`NoImage` when the index closes."""
        self.events: IndexEvents | None = None
        """Where every entry stored and removed is told, while the index reports events."""
        self._regions = regions
        self._replicas = replicas
        self._counters = counters

    def touch_entry(self, key: bytes, entry: Entry, now: float) -> None:
        entry.last_use = now
        self.lru.move_to_end(key)

    def granted(self, grant: GrantRef) -> tuple[Entry, Descriptor] | None:
        """The entry and the copy a grant names, while it is granted and not published."""
        entry = self.entries.get(grant.key)
        if entry is None or not entry.grants:
            return None
        copy = entry.grants.get(grant.version)
        return None if copy is None else (entry, copy)

    def stored(self, key: bytes, entry: Entry, block: EngineBlock | None) -> None:
        """``entry`` was just published: the events hear of it (``block``: what its writer
        said of it). Called only while :attr:`events` is set."""
        assert self.events is not None
        if block is not None:
            entry.engine = block.hash
        self.events.stored(key, block)

    def remove(self, key: bytes, entry: Entry, now: float, *, immediate: bool = False) -> None:
        """Take an entry out with every copy; their slots retire (or are free at once:
        ``immediate``, no grace)."""
        del self.entries[key]
        self.lru.pop(key, None)
        vacate = self._regions.vacate
        if entry.state is EntryState.PUBLISHED:
            if self.events is not None:
                self.events.removed(key, entry.engine)
            self.image.hide(key)
            for d in entry.copies():
                vacate(key, d, entry.size, now, immediate=immediate)
        for d in (entry.grants or {}).values():
            vacate(key, d, entry.size, now, immediate=immediate)

    def unpublish(self, keys: Sequence[bytes], now: float) -> int:
        removed = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry.state is EntryState.PUBLISHED:
                self.remove(key, entry, now)
                removed += 1
        self._counters["unpublished"] += removed
        return removed

    # -- lookups -----------------------------------------------------------------------

    def lookup_copies(self, keys: Sequence[bytes], now: float) -> Copies:
        # The image answers the leading run in C, its descriptors already in wire form
        # (the reply needs no per-key encoding), and stamps each hit's use there (the LRU
        # learns of it when eviction walks it). With replicas the probe would not find the
        # alternates, and a key that is not 32 bytes names no entry: the loop below answers.
        hits, stop, wires = (
            self.image.prefix(keys, now)
            if self._replicas == 1 and first_bad_key(keys) < 0
            else (0, ImageStop.UNUSABLE, b"")
        )
        entries, touch = self.entries, self.lru.move_to_end
        found: list[Descriptor] = []
        alternates: dict[int, tuple[Descriptor, ...]] = {}
        if hits < len(keys) and stop != ImageStop.MISS:
            # A key the image cannot answer for (its window overflowed; or no image): the
            # entries answer from there on.
            published = EntryState.PUBLISHED
            for key in itertools.islice(keys, hits, None):
                entry = entries.get(key)
                if entry is None or entry.state is not published:
                    break
                entry.last_use = now
                touch(key)
                if entry.alternates:
                    alternates[hits + len(found)] = entry.alternates
                found.append(entry.descriptor)
        counters = self._counters
        counters["lookups"] += 1
        counters["lookup_keys"] += len(keys)
        counters["prefix_hits"] += hits + len(found)
        if not hits:
            return Copies(descriptors=found, alternates=alternates)
        if found:
            wires += b"".join(d.to_bytes() for d in found)
        return Copies(descriptors=PackedDescriptors(wires), alternates=alternates)

    def resolve_copies(self, keys: Sequence[bytes], now: float) -> Copies:
        out: list[Descriptor | None] = []
        alternates: dict[int, tuple[Descriptor, ...]] = {}
        for i, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is None or entry.state is not EntryState.PUBLISHED:
                out.append(None)
                continue
            self.touch_entry(key, entry, now)
            if entry.alternates:
                alternates[i] = entry.alternates
            out.append(entry.descriptor)
        self._counters["resolves"] += 1
        self._counters["resolve_hits"] += sum(d is not None for d in out)
        return Copies(descriptors=out, alternates=alternates)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._counters["exists_calls"] += 1
        probe = self._replicas == 1 and first_bad_key(keys) < 0
        states = self.image.exists(keys) if probe else b""
        if states and ImageStop.UNKNOWN not in states:
            return [state == ImageStop.HIT for state in states]
        published = EntryState.PUBLISHED
        return [(e := self.entries.get(k)) is not None and e.state is published for k in keys]

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Clients used these keys (lookups answered without asking the index)."""
        if first_bad_key(keys) >= 0:
            keys = [k for k in keys if type(k) is bytes]  # the others name no entry
        # Keys in the image are stamped there in C; those it cannot tell of (spilled) are
        # touched one by one.
        states = self.image.exists(keys, used_at=now)
        if ImageStop.UNKNOWN in states:
            entries, published = self.entries, EntryState.PUBLISHED
            for key, state in zip(keys, states, strict=True):
                entry = entries.get(key) if state == ImageStop.UNKNOWN else None
                if entry is not None and entry.state is published:
                    self.touch_entry(key, entry, now)
        self._counters["touches"] += 1
        self._counters["touched_keys"] += len(keys)

    # -- how much ----------------------------------------------------------------------

    def stored_payload_bytes(self) -> int:
        """Every published copy's payload."""
        return sum(
            (1 + len(e.alternates)) * e.descriptor.length
            for e in map(self.entries.__getitem__, self.lru)
        )
