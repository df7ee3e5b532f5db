"""An entry's copies in the memory index: losing one, adding one, promoting another.

With ``replicas=k`` each value is granted on up to k distinct data nodes (see
:mod:`kvfabric.indexes.memory_grants`). A published entry then holds its copies: the one
read first (its descriptor) and the others (*alternates*), each with a slot and a version of
its own, each in the lookup image (the others under alternate keys). A lost node or an
invalid record costs only that copy: another is promoted to be read first, and the entry
goes only with its last copy. Copies come back by a put of the key (the grants repair it)
or from a restoring node that reports one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory_entries import Entry, EntryState, EntryTable
from kvfabric.indexes.memory_regions import Regions
from kvfabric.spi import GrantRef

__all__ = ["Replicas"]


class Replicas:
    """Changes to entries' sets of copies; not thread-safe (the index's lock guards it)."""

    def __init__(
        self, *, table: EntryTable, regions: Regions, wanted: int, counters: dict[str, int]
    ) -> None:
        """``wanted``: copies of each value, on distinct data nodes."""
        self.wanted = wanted
        self._table = table
        self._regions = regions
        self._counters = counters

    def set_copies(self, key: bytes, entry: Entry, copies: Sequence[Descriptor]) -> None:
        """A published entry's copies changed (one lost, or one added)."""
        if copies[0] is not entry.descriptor:
            self._counters["promotions"] += 1
        entry.descriptor, entry.alternates = copies[0], tuple(copies[1:])
        self._table.image.show(key, entry.descriptor, entry.alternates)

    def forget_copy(self, key: bytes, entry: Entry, node: int, region: int) -> bool:
        """Take the entry's copy in (node, region) out of it (its slot is not touched: the
        caller owns it); True when that was the last copy and the entry went."""
        if entry.grants:
            for version, d in list(entry.grants.items()):
                if (d.node, d.region) == (node, region):
                    del entry.grants[version]
            entry.grants = entry.grants or None
        if entry.state is EntryState.PENDING:
            if entry.grants:
                entry.descriptor = next(iter(entry.grants.values()))
                return False
            del self._table.entries[key]
            return True
        copies = entry.copies()
        kept = tuple(d for d in copies if (d.node, d.region) != (node, region))
        if len(kept) == len(copies):
            return False
        self._counters["replicas_dropped"] += 1
        if not kept:
            table = self._table
            del table.entries[key]
            table.lru.pop(key, None)
            if table.events is not None:
                table.events.removed(key, entry.engine)
            table.image.hide(key)
            return True
        self.set_copies(key, entry, kept)
        return False

    def takes_restored(self, entry: Entry, node: int, size: int) -> bool:
        """Whether a copy of a stored key that a restoring node reports is one more copy
        (the entry has fewer than it wants, none on that node) rather than a duplicate."""
        copies = entry.copies()
        return not (
            entry.state is not EntryState.PUBLISHED
            or entry.grants
            or len(copies) >= self.wanted
            or any(d.node == node for d in copies)
            or entry.size != size
        )

    def drop_invalid(self, records: Sequence[GrantRef], now: float) -> int:
        """Readers found these published records invalid: unpublish each that is still
        the published version of its copy, so the next put of its key stores it again (a
        key with another copy keeps it, promoted if need be)."""
        dropped = 0
        for record in records:
            entry = self._table.entries.get(record.key)
            if entry is None or entry.state is not EntryState.PUBLISHED:
                continue
            copies = entry.copies()
            bad = next((d for d in copies if d.version == record.version), None)
            if bad is None:
                continue
            dropped += 1
            if len(copies) == 1:
                self._table.remove(record.key, entry, now)
                continue
            self._regions.vacate(record.key, bad, entry.size, now)
            self._counters["replicas_dropped"] += 1
            self.set_copies(record.key, entry, [d for d in copies if d is not bad])
        self._counters["invalid_reports"] += dropped
        return dropped
