"""The data nodes the memory index knows: ids, incarnations, regions, and restores.

A node is known by its name: it keeps its id when it registers again (ids are never reused,
so a client holding routes for a node that is gone never reaches another node under its
id), and each registration is a new incarnation, which its heartbeats must name. Whenever a
node registers or leaves, the nodes' generation grows; the image's header and each extent
leased carry it, so a reader or writer sees that its node changed.

A region that goes (its node left, or registered again without it, or with another rkey or
size) takes its copies with it: an entry with a copy elsewhere stays, that copy promoted.
A node that registers *restoring* reports the records it holds, and its regions take no
grant until it is done: the index is soft state, rebuilt from self-describing records.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.memory_entries import Entry, EntryState, EntryTable
from kvfabric.indexes.memory_extents import Extents
from kvfabric.indexes.memory_regions import Regions
from kvfabric.indexes.memory_replicas import Replicas
from kvfabric.indexes.memory_space import RegionSpace
from kvfabric.spi import SLOT_ALIGN, NodeEndpoint, NodeInfo, record_size

__all__ = ["NodeRegistry"]


class NodeRegistry:
    """The registered data nodes and their regions; not thread-safe (the index's lock
    guards it)."""

    def __init__(
        self,
        *,
        table: EntryTable,
        regions: Regions,
        replicas: Replicas,
        extents: Extents,
        counters: dict[str, int],
    ) -> None:
        self.nodes: dict[int, NodeInfo] = {}
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self._next_incarnation = 0
        self._generation = 0
        """Grows whenever a node registers or leaves."""
        self._table = table
        self._regions = regions
        self._replicas = replicas
        self._extents = extents
        self._counters = counters

    def register(self, info: NodeInfo) -> NodeInfo:
        node_id = self._ids.get(info.name)
        if node_id is None:
            # Ids are never reused: a client holding routes for a node that is gone must
            # never reach another node under its id.
            self._next_id += 1
            node_id = self._ids[info.name] = self._next_id
        self._next_incarnation += 1
        endpoints = tuple(
            NodeEndpoint(node=node_id, transport=e.transport, address=e.address, regions=e.regions)
            for e in info.endpoints
        )
        registered = attrs.evolve(
            info, endpoints=endpoints, id=node_id, incarnation=self._next_incarnation
        )
        self.nodes[node_id] = registered
        self._changed()
        spaces = self._regions.spaces
        wanted = {region.id: region for region in info.regions}
        for (node, region_id), space in list(spaces.items()):
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
            if (node_id, region.id) not in spaces:
                spaces[(node_id, region.id)] = RegionSpace(
                    node_id, region.id, region.rkey, region.size, restoring=info.restoring
                )
        return registered

    def heartbeat(self, node: int, incarnation: int) -> bool:
        known = self.nodes.get(node)
        return known is not None and known.incarnation == incarnation

    def remove(self, node: int) -> int:
        """The node left; returns how many entries went with its regions."""
        if self.nodes.pop(node, None) is None:
            return 0
        self._changed()
        spaces = [s for (n, _), s in self._regions.spaces.items() if n == node]
        return sum(self._drop_region(space) for space in spaces)

    def _changed(self) -> None:
        self._generation = (self._generation + 1) & 0xFFFFFFFF
        self._extents.nodes_generation = self._generation
        self._table.image.set_nodes_generation(self._generation)

    def _drop_region(self, space: RegionSpace) -> int:
        """The region is gone: its copies go; returns how many entries went with them (an
        entry with a copy elsewhere stays, that copy promoted)."""
        self._regions.drop(space)
        self._extents.forget_region(space)
        entries, forget_copy = self._table.entries, self._replicas.forget_copy
        dropped = 0
        for key, _ in space.occupants.values():
            entry = entries.get(key)
            if entry is not None and forget_copy(key, entry, space.node, space.region):
                dropped += 1
        return dropped

    # -- restores ----------------------------------------------------------------------

    def restore(self, node: int, records: Sequence[Descriptor], now: float) -> int:
        """Records a restoring node reports; returns how many were kept."""
        spaces, entries, lru = self._regions.spaces, self._table.entries, self._table.lru
        put = self._table.image.put
        replicas = self._replicas
        kept = 0
        for record in records:
            space = spaces.get((node, record.region))
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
            entry = entries.get(record.key)
            if entry is not None:
                # A key found on two nodes: one more copy while it has fewer than
                # ``replicas`` (and none on this node), else a duplicate.
                if not replicas.takes_restored(entry, node, size):
                    self._counters["restore_duplicates"] += 1
                    continue
                space.occupy(record.offset, size, record.key)
                replicas.set_copies(record.key, entry, (*entry.copies(), descriptor))
                kept += 1
                continue
            entry = Entry(descriptor, size, lease_deadline=0.0)
            entry.state = EntryState.PUBLISHED
            entry.last_use = now
            entries[record.key] = entry
            lru[record.key] = None
            put(descriptor)
            space.occupy(record.offset, size, record.key)
            if self._table.events is not None:
                # Restored from a node's records: what a writer said of it is not kept there.
                self._table.stored(record.key, entry, None)
            kept += 1
        self._counters["restored"] += kept
        return kept

    def restore_done(self, node: int) -> None:
        """The node reported all its records: its regions take grants again."""
        for (owner, _), space in self._regions.spaces.items():
            if owner != node or space.restored is None:
                continue
            keys = self._regions.finish_restore(space)
            for key in keys:
                entry = self._table.entries.get(key)
                if entry is not None:
                    self._replicas.forget_copy(key, entry, space.node, space.region)
            self._counters["restore_overlaps"] += len(keys)
