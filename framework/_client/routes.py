"""The record I/O layer's routing table: which transport reaches which data node.

For each node the client uses the first transport, in preference order, that both sides
have and that can reach the node (``shm`` only on the same host). Membership comes from
outside (the store asks the index); this table only turns node descriptions into connected
transport clients, and forgets nodes that left.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.errors import KvfabricError, TransportError
from kvfabric.spi.index import NodeInfo
from kvfabric.spi.transport import TransportClient

__all__ = ["Routes"]

log = logging.getLogger("kvfabric")


class Routes:
    """Node id -> (transport name, transport client); thread-safe."""

    def __init__(self, clients: Mapping[str, TransportClient], preference: Sequence[str]) -> None:
        self._clients = dict(clients)
        self._preference = [t for t in preference if t in self._clients]
        self._routes: dict[int, tuple[str, TransportClient]] = {}
        self._infos: dict[int, NodeInfo] = {}
        self._lock = threading.Lock()
        # A node that cannot be connected to is tried at every relearn: a line a minute.
        self._limited = LimitedLog(log)

    def add_nodes(self, nodes: Sequence[NodeInfo]) -> list[int]:
        """Connect to nodes not yet known, or known under the same id with other endpoints;
        returns the ids of those (whether or not the connect succeeded).

        A node no transport can reach (or whose connect fails) stays unrouted: its reads and
        writes fail as transport failures, never as an exception out of a read.
        """
        learned: list[int] = []
        for node in nodes:
            with self._lock:
                known = self._infos.get(node.id)
            if known == node:
                continue
            learned.append(node.id)
            if known is not None:
                self.remove_node(node.id)
            endpoints = {e.transport: e for e in node.endpoints}
            for name in self._preference:
                endpoint = endpoints.get(name)
                client = self._clients[name]
                if endpoint is None or not client.reachable(endpoint):
                    continue
                try:
                    client.connect(endpoint)
                except KvfabricError as exc:
                    self._limited.warning(
                        (name, node.id),
                        "kvfabric: %s cannot connect to node %d (%s)",
                        name,
                        node.id,
                        exc,
                    )
                    continue
                with self._lock:
                    self._routes[node.id] = (name, client)
                    self._infos[node.id] = node
                break
        return learned

    def replace_nodes(self, nodes: Sequence[NodeInfo]) -> list[int]:
        """Make the membership exactly ``nodes`` (nodes left or joined, a new controller);
        returns the ids of the nodes connected anew."""
        current = {n.id for n in nodes}
        with self._lock:
            gone = [n for n in self._infos if n not in current]
        for node in gone:
            self.remove_node(node)
        return self.add_nodes(nodes)

    def remove_node(self, node: int) -> None:
        with self._lock:
            route = self._routes.pop(node, None)
            self._infos.pop(node, None)
        if route is not None:
            route[1].disconnect(node)

    def knows_all(self, nodes: Iterable[int]) -> bool:
        with self._lock:
            return all(n in self._routes for n in nodes)

    def transport_of(self, node: int) -> str | None:
        with self._lock:
            route = self._routes.get(node)
        return route[0] if route else None

    def client_for(self, node: int) -> TransportClient:
        with self._lock:
            route = self._routes.get(node)
        if route is None:
            raise TransportError(f"no transport reaches node {node}")
        return route[1]

    def close(self) -> None:
        """Disconnect every node and close every transport client."""
        with self._lock:
            routes = dict(self._routes)
            self._routes.clear()
            self._infos.clear()
        for node, (_, client) in routes.items():
            client.disconnect(node)
        for client in self._clients.values():
            client.close()
