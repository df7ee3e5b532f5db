"""The redis index's registry: the data nodes, their arenas, and this client's view of both.

The registry (ids by name, incarnations, arenas, liveness keys with a TTL) is one hash slot
of its own, changed only by the registry functions of ``redis_functions.lua``.
:class:`RegistryView` is what this client last read of it, with the ring computed from it,
read again only when its epoch moved or an arena was found gone. :class:`NodeRegistry`
registers nodes, keeps them alive, removes them, and makes and drops their arenas.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvfabric.errors import (
    ControllerUnavailableError,
    KvfabricError,
    NameInUseError,
    RegistrationInterruptedError,
)
from kvfabric.indexes.redis_calls import ArenaCalls, raise_unexpected
from kvfabric.indexes.redis_layout import Arena, Ring
from kvfabric.spi import SLOT_ALIGN, Counters, NodeEndpoint, NodeInfo

if TYPE_CHECKING:
    from kvfabric.indexes.redis_unpublish import Unpublisher

__all__ = ["EMPTY", "NodeRegistry", "RegistryView", "View"]

# kvf1_init: a round cleared a batch of what an older registry's arena left; rounds at most
# (each clears up to 500 records and 500 entries: millions in all).
_INIT_CLEARING = 2
_INIT_ROUNDS = 10_000


@attrs.frozen(kw_only=True)
class View:
    """The registry as this client last read it, and the ring computed from it."""

    epoch: int
    nodes: dict[int, NodeInfo]
    arenas: dict[int, Arena]
    ring: Ring
    dropped: frozenset[int]
    born: bytes = b"0"
    """When the registry was created: a new one (Redis restarted empty) starts its epochs
    again, and is told apart by this."""


EMPTY = View(epoch=-1, nodes={}, arenas={}, ring=Ring(()), dropped=frozenset())


class RegistryView:
    """This client's copy of the registry, read again when it is known to be out of date."""

    def __init__(self, calls: ArenaCalls, *, namespace: str, counters: Counters) -> None:
        self._calls = calls
        self._ns = namespace
        self._counters = counters
        self._lock = threading.Lock()
        self._view = EMPTY
        self._stale = True

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._view.epoch

    def current(self) -> View:
        """The view, read from Redis first if it is known to be out of date."""
        with self._lock:
            stale, view = self._stale, self._view
        return self.refresh() if stale else view

    def refresh(self, *, force: bool = False) -> View:
        """Read the registry if its epoch moved (one round trip to the registry's master)."""
        with self._lock:
            known = -1 if force else self._view.epoch
            born = self._view.born
        reply = self._calls.registry("kvf1_registry", known, born, read_only=True)
        if len(reply) == 1:
            with self._lock:
                self._stale = False
                return self._view
        epoch, flat_nodes, flat_arenas, dropped, born = reply
        nodes: dict[int, NodeInfo] = {}
        for i in range(0, len(flat_nodes), 3):
            info = NodeInfo.from_bytes(flat_nodes[i + 2])
            nodes[int(flat_nodes[i])] = attrs.evolve(info, incarnation=int(flat_nodes[i + 1]))
        names = {node_id: info.name for node_id, info in nodes.items()}
        arenas = {
            int(flat_arenas[i]): Arena.parse(
                self._ns, int(flat_arenas[i]), flat_arenas[i + 1], names
            )
            for i in range(0, len(flat_arenas), 2)
        }
        view = View(
            epoch=int(epoch),
            nodes=nodes,
            arenas=arenas,
            ring=Ring(sorted(arenas.values(), key=lambda a: a.id)),
            dropped=frozenset(int(a) for a in dropped),
            born=born,
        )
        with self._lock:
            if view.epoch >= self._view.epoch or view.born != self._view.born or force:
                self._view = view
            self._stale = False
            return self._view

    def gone(self) -> None:
        """An arena of the view was gone (replaced, or dropped): read it again next time."""
        with self._lock:
            self._stale = True
        self._counters.update(stale_arenas=1)

    def forget(self) -> None:
        """Back to knowing nothing (the namespace was purged)."""
        with self._lock:
            self._view = EMPTY
            self._stale = True


class NodeRegistry:
    """Data nodes' registration, liveness and removal, and the making and dropping of their
    arenas."""

    def __init__(
        self,
        calls: ArenaCalls,
        view: RegistryView,
        unpublisher: Unpublisher,
        counters: Counters,
        *,
        arena_size: int,
        node_ttl_ms: int,
    ) -> None:
        self._calls = calls
        self._view = view
        self._unpublisher = unpublisher
        self._counters = counters
        self._arena_size = arena_size
        self._node_ttl_ms = node_ttl_ms

    def nodes(self) -> list[NodeInfo]:
        return list(self._view.refresh().nodes.values())

    def register_node(self, info: NodeInfo) -> NodeInfo:
        node_id = int(self._calls.registry("kvf1_node_id", info.name))
        endpoints = tuple(
            NodeEndpoint(node=node_id, transport=e.transport, address=e.address, regions=e.regions)
            for e in info.endpoints
        )
        registered = attrs.evolve(info, endpoints=endpoints, id=node_id, incarnation=0)
        regions: list[Any] = []
        for region in info.regions:
            regions += [region.id, region.size, region.rkey]
        reply = self._calls.registry(
            "kvf1_register",
            node_id,
            1 if info.restoring else 0,
            self._arena_size,
            SLOT_ALIGN,
            self._node_ttl_ms if self._node_ttl_ms > 0 else 0,
            registered.to_bytes(),
            info.instance,
            *regions,
        )
        if reply[0] == b"in-use":
            raise NameInUseError(
                f"node name {info.name!r} belongs to a live node of another process; it is "
                f"released {int(reply[1]) / 1000:.1f}s from now unless that node heartbeats"
            )
        _, incarnation, _, created, dropped = reply
        try:
            view = self._view.refresh()
            self.init_arenas(view, [view.arenas[int(a)] for a in created if int(a) in view.arenas])
            self.drop_arenas([int(a) for a in dropped])
        except KvfabricError as exc:
            # The registry holds the node now, and clients may be writing to it (its arenas
            # can be ready on one shard while another is lost): the node must register again.
            raise RegistrationInterruptedError(
                f"node {node_id} was registered, then Redis was lost before its arenas were "
                f"ready: {exc}"
            ) from exc
        return attrs.evolve(registered, incarnation=int(incarnation))

    def heartbeat(self, node: int, incarnation: int) -> bool:
        return bool(self._calls.registry("kvf1_heartbeat", node, incarnation))

    def remove_node(self, node: int) -> int:
        removed, dropped = self._calls.registry("kvf1_remove", node)
        if not removed:
            return 0
        self._view.refresh()
        return self.drop_arenas([int(a) for a in dropped])

    def expire_silent(self) -> None:
        """Remove the nodes whose liveness key expired (they stopped heartbeating)."""
        for node in self._calls.registry("kvf1_silent", read_only=True):
            if self.remove_node(int(node)):
                self._counters.update(nodes_expired=1)

    def init_arenas(self, view: View, arenas: Sequence[Arena]) -> None:
        """Make ``arenas`` of ``view``'s registry where they are not made yet (idempotent).

        Each carries the registry's birth: an arena an older registry made under the same id
        (a Redis restarted empty gives ids out again, and a client that read the old registry
        can make its arena in the new Redis) is cleared and made again, a batch per round.
        """
        left = list(arenas)
        for _ in range(_INIT_ROUNDS):
            calls = [
                self._calls.call(
                    arena,
                    "kvf1_init",
                    arena.node,
                    arena.region,
                    arena.base,
                    arena.size,
                    arena.rkey,
                    arena.id,
                    arena.id % 4096,
                    1 if arena.restoring else 0,
                    arena.rkey.to_bytes(8, "little"),
                    view.born,
                )
                for arena in left
            ]
            again = []
            for arena, value in zip(left, self._calls.run(calls).values, strict=True):
                raise_unexpected(value)
                if value == _INIT_CLEARING:
                    again.append(arena)
            if not again:
                return
            left = again
        raise ControllerUnavailableError(
            f"arenas {[a.id for a in left]} still hold what an older registry left after "
            f"{_INIT_ROUNDS} rounds of clearing"
        )

    def drop_arenas(self, arena_ids: Sequence[int]) -> int:
        """Delete arenas' keys (a batch per call until none is left); returns the entries that
        went, with entries elsewhere whose records were in these arenas."""
        dropped = 0
        notices: list[Any] = []
        done: list[int] = []
        left = list(arena_ids)
        while left:
            values = self._calls.run([self._calls.call_at(a, "kvf1_drop") for a in left]).values
            still: list[int] = []
            for arena, value in zip(left, values, strict=True):
                if isinstance(value, Exception):
                    continue  # tick drops it later: the registry keeps it among `dropped`
                count, remaining, found = value
                dropped += int(count)
                notices += found
                if int(remaining):
                    still.append(arena)
                else:
                    done.append(arena)
            left = still
        dropped += self._unpublisher.drop_at_homes(notices)
        if done:
            self._calls.registry("kvf1_forget_dropped", *done)
        return dropped

    def purge(self) -> None:
        """Delete everything the namespace holds in Redis (every node, entry and counter)."""
        view = self._view.refresh(force=True)
        for node in list(view.nodes):
            self.remove_node(node)
        view = self._view.refresh(force=True)
        self.drop_arenas(sorted(set(view.arenas) | view.dropped))
        self._calls.registry("kvf1_purge")
        self._view.forget()
