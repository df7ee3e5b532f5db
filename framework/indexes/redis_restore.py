"""Restoring the redis index from a data node's own records.

A node that registered with ``restoring`` set reports the records it found in its memory.
The arena holding each record claims its slot (it must fit and overlap nothing claimed), the
key's arena publishes it unless it already has the key (a key found twice is kept once), and
claims of records not published are let go. A record can lie in another arena than its
key's: the key's arena then keeps an entry pointing into the holder. With replicas, a record
held by one of the key's other arenas is that arena's own entry, listed by the home. When the
node is done, its arenas count what no record holds as free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.indexes.redis_calls import ArenaCalls, raise_unexpected
from kvfabric.indexes.redis_layout import PUBLISHED, Arena, version_bytes
from kvfabric.indexes.redis_registry import RegistryView, View
from kvfabric.spi import SLOT_ALIGN, record_size

__all__ = ["Restorer"]


class Restorer:
    """``restore`` and ``restore_done`` of the redis index."""

    def __init__(self, calls: ArenaCalls, view: RegistryView, *, replicas: int) -> None:
        self._calls = calls
        self._view = view
        self._replicas = replicas

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        # Read the registry afresh (once per registration): a view cached before Redis came
        # back empty can list this node's id with its old arenas, whose claims would go to
        # arenas that no longer exist, leaving the node's records out.
        view = self._view.refresh()
        holders = [a for a in view.arenas.values() if a.node == node]
        if not holders or not view.ring:
            return 0
        calls = self._calls
        # 1. The arena holding each record claims its slot (fits, overlaps nothing claimed).
        placed: list[tuple[Descriptor, Arena, Arena]] = []
        for record in records:
            size = record_size(record.length)
            holder = next((a for a in holders if a.holds(record.region, record.offset, size)), None)
            if holder is not None:
                placed.append((record, holder, view.ring.arena_of(record.key)))
        claims = calls.by_arena(
            (holder, [r.offset, record_size(r.length), r.key, home.id, version_bytes(r.version)])
            for r, holder, home in placed
        )
        claimed_flags = calls.flags(claims, "kvf1_claim", SLOT_ALIGN)
        claimed = [p for p, ok in zip(placed, claimed_flags, strict=True) if ok]
        # 2. Each key's arena publishes it unless it already has the key. With replicas, a
        # record held by one of the key's other arenas is that arena's own entry, and the
        # home lists it (step 4).
        targets = [self._restore_target(view, r, holder, home) for r, holder, home in claimed]
        adoptions = calls.by_arena(
            (
                target,
                [
                    r.key,
                    node,
                    r.region,
                    holder.rkey.to_bytes(8, "little"),
                    r.offset,
                    r.length,
                    version_bytes(r.version),
                    r.crc,
                    holder.id,
                ],
            )
            for (r, holder, _), target in zip(claimed, targets, strict=True)
        )
        adopted = calls.flags(adoptions, "kvf1_adopt")
        # 3. Claims of records not published are let go.
        refused = calls.by_arena(
            (holder, [r.offset, r.key])
            for (r, holder, _), ok in zip(claimed, adopted, strict=True)
            if not ok
        )
        batch = [calls.call(arena, "kvf1_unclaim", *args) for arena, _, args in refused]
        # 4. Homes list the copies their keys' other arenas adopted, and those the other
        # arenas of keys a home adopted still hold.
        copies = [
            (home, attrs.evolve(r, node=node, rkey=holder.rkey))
            for (r, holder, home), target, ok in zip(claimed, targets, adopted, strict=True)
            if ok and target.id != home.id
        ]
        if self._replicas > 1:
            adopted_keys = [r.key for (r, _, _), ok in zip(claimed, adopted, strict=True) if ok]
            copies += self._held_elsewhere(view, adopted_keys)
        links = calls.by_arena((home, [d.key, b"", d.to_bytes()]) for home, d in copies)
        batch += [
            calls.call(arena, "kvf1_link", self._replicas - 1, *args) for arena, _, args in links
        ]
        for value in calls.run(batch).values:
            raise_unexpected(value)
        return sum(adopted)

    def _held_elsewhere(self, view: View, keys: Sequence[bytes]) -> list[tuple[Arena, Descriptor]]:
        """Copies of ``keys`` their other arenas hold, with the home that should list each:
        one round of lookups (listing one twice does no harm)."""
        asks: list[tuple[Arena, list[Any]]] = []
        homes: dict[bytes, Arena] = {}
        for key in keys:
            arenas = view.ring.copies_of(key, self._replicas)
            homes[key] = arenas[0]
            asks += [(arena, [key]) for arena in arenas[1:]]
        calls = self._calls
        groups = calls.by_arena(asks)
        batch = [
            calls.call(arena, "kvf1_lookup", *args, read_only=True) for arena, _, args in groups
        ]
        found: list[tuple[Arena, Descriptor]] = []
        for (_, _, args), reply in zip(
            groups, calls.run(batch).values if batch else [], strict=True
        ):
            if isinstance(reply, Exception) or reply[0] is None:
                continue
            for key, entry in zip(args, reply[1], strict=True):
                if entry is not None and entry[DESCRIPTOR_SIZE] == PUBLISHED:
                    found.append((homes[key], Descriptor.from_bytes(entry)))
        return found

    def _restore_target(self, view: View, record: Descriptor, holder: Arena, home: Arena) -> Arena:
        """Where a restored record's entry goes: its holder, when that is one of the arenas
        of the key's copies; else the key's home (an entry pointing into the holder)."""
        if self._replicas == 1 or holder.id == home.id:
            return home
        arenas = view.ring.copies_of(record.key, self._replicas)
        return holder if any(a.id == holder.id for a in arenas) else home

    def restore_done(self, node: int) -> None:
        view = self._view.refresh()  # as in restore: the node's arenas as registered now
        calls = self._calls
        batch = [calls.call(a, "kvf1_restore_done") for a in view.arenas.values() if a.node == node]
        for value in calls.run(batch).values:
            raise_unexpected(value)
        info = view.nodes.get(node)
        if info is not None and info.restoring:
            # The registry too (it listed the node and its arenas as restoring for good).
            record = attrs.evolve(info, restoring=False, incarnation=0).to_bytes()
            calls.registry("kvf1_restored", node, info.incarnation, record)
