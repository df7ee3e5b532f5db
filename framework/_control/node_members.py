"""The data nodes a controller knows: registration, heartbeats, restores, departures.

A node registers (a name it keeps across restarts, an incarnation per start), heartbeats
with its counters, reports the records it still holds after a controller restart
(``RESTORE`` ... ``RESTORE_DONE``) and deregisters when it stops. A node silent for
``node_timeout`` is dropped with all its entries. ``generation`` grows whenever a node
registers or leaves; every reply carries it, so clients relearn the nodes (a new
incarnation, a replaced node) within one round trip.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from kvfabric._control.refusal import Handler, Refusal
from kvfabric._runtime.codec import Reader, Writer
from kvfabric._wire import member_bodies as mb
from kvfabric._wire.protocol import ErrorCode, MsgType
from kvfabric.spi.index import IndexPlugin, NodeInfo

__all__ = ["NodeMembers"]

log = logging.getLogger("kvfabric._control.controller")


class NodeMembers:
    """The controller's side of node membership; ``handlers`` serve the nodes' requests."""

    def __init__(self, index: IndexPlugin, node_timeout: float, counters: Counter[str]) -> None:
        self._index = index
        self.node_timeout = node_timeout
        self._counters = counters
        self._last_seen: dict[int, float] = {}
        self._node_stats: dict[int, dict[str, int]] = {}
        self.generation = 0
        self.handlers: dict[int, Handler] = {
            MsgType.REGISTER_NODE: self._register_node,
            MsgType.HEARTBEAT: self._heartbeat,
            MsgType.DEREGISTER_NODE: self._deregister_node,
            MsgType.RESTORE: self._restore,
            MsgType.RESTORE_DONE: self._restore_done,
        }

    def drop_silent(self) -> None:
        """Drop every node silent for longer than ``node_timeout``, with its entries."""
        now = time.monotonic()
        for node, seen in list(self._last_seen.items()):
            if now - seen > self.node_timeout:
                dropped = self._drop(node)
                self._counters["nodes_dropped"] += 1
                log.warning(
                    "node %d missed heartbeats for %.1fs: dropped with %d entries",
                    node,
                    now - seen,
                    dropped,
                )

    def stats_scopes(self) -> dict[str, dict[str, int]]:
        """Each node's counters as of its last heartbeat, by ``node ID NAME``."""
        names = {n.id: n.name for n in self._index.nodes()}
        return {
            f"node {node} {names.get(node, '?')}": counters
            for node, counters in sorted(self._node_stats.items())
        }

    def _drop(self, node: int) -> int:
        dropped = self._index.remove_node(node)
        self.generation += 1
        self._last_seen.pop(node, None)
        self._node_stats.pop(node, None)
        return dropped

    def _register_node(self, r: Reader) -> Callable[[], bytes]:
        offered = NodeInfo.read_from(r)

        def apply() -> bytes:
            self._refuse_takeover(offered)
            info = self._index.register_node(offered)
            self._last_seen[info.id] = time.monotonic()
            self.generation += 1
            log.info(
                "node %d (%s) registered: incarnation %d, %d regions%s",
                info.id,
                info.name,
                info.incarnation,
                len(info.regions),
                ", restoring its records" if info.restoring else "",
            )
            return info.to_bytes()

        return apply

    def _refuse_takeover(self, offered: NodeInfo) -> None:
        """A live node's name is its own: another process may take it only once it is gone."""
        known = next((n for n in self._index.nodes() if n.name == offered.name), None)
        if known is None or known.instance == offered.instance or known.id not in self._last_seen:
            return
        silent = time.monotonic() - self._last_seen[known.id]
        if silent <= self.node_timeout:
            self._counters["takeovers_refused"] += 1
            raise Refusal(
                ErrorCode.NAME_IN_USE,
                f"node name {offered.name!r} belongs to a live node (heard from {silent:.1f}s "
                f"ago); it is released {self.node_timeout:g}s after that node falls silent",
            )

    def _registration(self, node: int, incarnation: int) -> NodeInfo:
        known = next((n for n in self._index.nodes() if n.id == node), None)
        if known is None or node not in self._last_seen or known.incarnation != incarnation:
            raise Refusal(
                ErrorCode.UNKNOWN_NODE, f"node {node} incarnation {incarnation} is not registered"
            )
        return known

    def _heartbeat(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation, counters = mb.read_heartbeat(r)

        def apply() -> bytes:
            self._registration(node, incarnation)
            self._last_seen[node] = time.monotonic()
            self._node_stats[node] = counters
            return b""

        return apply

    def _restore(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation, records = mb.read_restore(r)

        def apply() -> bytes:
            self._registration(node, incarnation)
            self._last_seen[node] = time.monotonic()
            return Writer().u32(self._index.restore(node, records)).getvalue()

        return apply

    def _restore_done(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation = mb.read_node_ref(r)

        def apply() -> bytes:
            known = self._registration(node, incarnation)
            self._index.restore_done(node)
            log.info("node %d (%s) restored its records", node, known.name)
            return b""

        return apply

    def _deregister_node(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation = mb.read_deregister(r)

        def apply() -> bytes:
            known = self._registration(node, incarnation)
            dropped = self._drop(node)
            self._counters["nodes_deregistered"] += 1
            log.info(
                "node %d (%s) deregistered: dropped with %d entries", node, known.name, dropped
            )
            return b""

        return apply
