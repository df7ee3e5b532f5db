"""The tests' deployment of real processes: :class:`Cluster`, a controller and data nodes on
127.0.0.1, or data nodes sharing a Redis index with no controller at all.

``Cluster`` is :class:`kvfabric._tools.local_cluster.LocalCluster` (the processes
``kvfabric bench`` measures against: start, kill, restart, stats) plus what only tests ask
for. ``Cluster(redis=URL)`` runs no controller: its nodes register with the ``redis`` index
at URL (``kvfabric node --index redis``), in a namespace of their own, so tests sharing one
``redis-server`` never see each other's entries, and clients connect with
``kvfabric://HOST:PORT?index=redis`` (:meth:`Cluster.url`). The namespace is purged when the
cluster closes.
"""

from __future__ import annotations

import contextlib
import signal
import uuid
from typing import Any
from urllib.parse import urlsplit

from kvfabric._plugins import plugin_manager
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.errors import ControllerUnavailableError, KvfabricError
from kvfabric.spi import IndexConfig, NodeInfo
from kvfabric.testing.polling import wait_until_stopped

__all__ = ["Cluster"]


class Cluster(LocalCluster):
    """A controller plus ``nodes`` data nodes (or, with ``redis``, nodes sharing the redis
    index); :meth:`url` is what clients connect to."""

    def __init__(self, *, redis: str | None = None, node_ttl: str = "2s", **options: Any) -> None:
        """``redis``: the URL of a Redis deployment whose ``redis`` index the nodes use
        instead of a controller (``node_ttl``: how long one may stay silent before whoever
        ticks the index drops it). ``options`` are :class:`LocalCluster`'s: ``nodes``,
        ``transports``, ``capacity``, ``controller_args``, ``node_args``, ``env``, ``secret``
        and ``backend``."""
        self.redis = redis
        self.namespace = f"c{uuid.uuid4().hex[:12]}" if redis else ""
        self.node_ttl = node_ttl
        self._index: Any = None
        super().__init__(**options)

    def signal_node(self, index: int, sig: int) -> None:
        """Send ``sig`` to node ``index``; after a SIGSTOP, return once every thread of the
        node stopped, not when the signal was sent (see :func:`wait_until_stopped`)."""
        super().signal_node(index, sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.node_pid(index))

    def signal_controller(self, sig: int) -> None:
        """Send ``sig`` to the controller; a SIGSTOP as :meth:`signal_node`."""
        assert self.controller is not None
        self.controller.signal(sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.controller_pid())

    def _address(self) -> tuple[str, int]:
        if not self.redis:
            return super()._address()
        address = urlsplit(self.redis)
        return address.hostname or "127.0.0.1", address.port or 6379

    def _has_controller(self) -> bool:
        return not self.redis

    def _registration_args(self) -> list[str]:
        if not self.redis:
            return super()._registration_args()
        options = {**self.index_options(), "redis.node_ttl": self.node_ttl}
        where = ["--index", "redis"]
        for option, value in options.items():
            where += ["--index-opt", f"{option}={value}"]
        return where

    def _url_options(self) -> dict[str, str]:
        # With redis, clients find the index (its URL and namespace) instead of a controller.
        return {**self.index_options(), "index": "redis"} if self.redis else {}

    def index_options(self) -> dict[str, str]:
        """The redis index's options every process of this cluster uses (none without)."""
        if not self.redis:
            return {}
        return {"redis.url": self.redis, "redis.namespace": self.namespace}

    def index(self) -> Any:
        """The redis index of a ``redis`` cluster, opened once (a ``RedisIndex``)."""
        if self._index is None:
            options = {k.removeprefix("redis."): v for k, v in self.index_options().items()}
            self._index = plugin_manager().index("redis").create(IndexConfig(options=options))
        return self._index

    def node_infos(self) -> list[NodeInfo]:
        """What the controller (or the redis index) knows of each registered node (regions,
        transport endpoints), by name."""
        if not self.redis:
            return super().node_infos()
        try:
            return sorted(self.index().nodes(), key=lambda n: n.name)
        except ControllerUnavailableError:
            return []

    def _reported_nodes(self) -> int:
        if not self.redis:
            return super()._reported_nodes()
        # No one collects nodes' counters: registered is all there is to wait for.
        return len(self.node_infos())

    def stats(self) -> dict[str, dict[str, int]]:
        if not self.redis:
            return super().stats()
        return {"index": self.index().stats()}

    def close(self) -> None:
        super().close()
        if self.redis:
            # What the nodes left in Redis goes (a deployment a test killed keeps it).
            with contextlib.suppress(KvfabricError):
                self.index().purge()
            if self._index is not None:
                self._index.close()
                self._index = None
