"""The client's data plane: which transport reaches which node, and batches issued per node.

For each node the client uses the first transport, in preference order, that both sides
have and that can reach the node (``shm`` only on the same host). Batches for different
nodes run concurrently on a small thread pool; a batch for a single node runs inline, so
the common case adds no thread hand-off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvfabric.errors import TransportError
from kvfabric.spi.index import NodeInfo
from kvfabric.spi.transport import TransportClient

__all__ = ["DataPlane"]

T = TypeVar("T")


class DataPlane:
    def __init__(self, clients: Mapping[str, TransportClient], preference: Sequence[str]) -> None:
        self._clients = dict(clients)
        self._preference = [t for t in preference if t in self._clients]
        self._routes: dict[int, tuple[str, TransportClient]] = {}
        self._infos: dict[int, NodeInfo] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def add_nodes(self, nodes: Sequence[NodeInfo]) -> None:
        """Connect to nodes not yet known, or known under the same id with other endpoints."""
        for node in nodes:
            with self._lock:
                known = self._infos.get(node.id)
            if known == node:
                continue
            if known is not None:
                self.remove_node(node.id)
            endpoints = {e.transport: e for e in node.endpoints}
            for name in self._preference:
                endpoint = endpoints.get(name)
                client = self._clients[name]
                if endpoint is not None and client.reachable(endpoint):
                    client.connect(endpoint)
                    with self._lock:
                        self._routes[node.id] = (name, client)
                        self._infos[node.id] = node
                    break

    def replace_nodes(self, nodes: Sequence[NodeInfo]) -> None:
        """Make the membership exactly ``nodes`` (after the controller restarted)."""
        current = {n.id for n in nodes}
        with self._lock:
            gone = [n for n in self._infos if n not in current]
        for node in gone:
            self.remove_node(node)
        self.add_nodes(nodes)

    def transport_of(self, node: int) -> str | None:
        with self._lock:
            route = self._routes.get(node)
        return route[0] if route else None

    def remove_node(self, node: int) -> None:
        with self._lock:
            route = self._routes.pop(node, None)
            self._infos.pop(node, None)
        if route is not None:
            route[1].disconnect(node)

    def knows(self, node: int) -> bool:
        with self._lock:
            return node in self._routes

    def route(self, node: int) -> tuple[str, TransportClient]:
        with self._lock:
            route = self._routes.get(node)
        if route is None:
            raise TransportError(f"no transport reaches node {node}")
        return route

    def run_per_node(self, jobs: Mapping[int, Callable[[], T]]) -> dict[int, T | BaseException]:
        """Run one job per node, concurrently when there are several; errors are returned."""
        results: dict[int, T | BaseException] = {}
        if len(jobs) <= 1:
            for node, job in jobs.items():
                results[node] = _call(job)
            return results
        pool = self._executor()
        futures = {node: pool.submit(_call, job) for node, job in jobs.items()}
        for node, future in futures.items():
            results[node] = future.result()
        return results

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvfabric-io")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            routes = dict(self._routes)
            self._routes.clear()
            self._infos.clear()
        if pool is not None:
            pool.shutdown(wait=True)
        for node, (_, client) in routes.items():
            client.disconnect(node)
        for client in self._clients.values():
            client.close()


def _call(job: Callable[[], T]) -> T | BaseException:
    try:
        return job()
    except Exception as exc:
        return exc
