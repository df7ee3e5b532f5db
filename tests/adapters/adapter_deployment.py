"""Which kvfabric deployment the adapter tests run against, chosen by an environment variable.

``KVFABRIC_ADAPTER_INDEX`` unset (or ``controller``): a controller and data-node processes,
as the adapters' own docs deploy them. ``redis``: data nodes registered with the ``redis``
index on one Redis server, no controller; ``redis-cluster``: the same on 3 masters with a
replica each. Only the store URL the engines are given changes (``kvfabric://HOST:PORT
?index=redis&...``); the few checks that count a controller's RPCs, or rely on its lookup
image, ask here what to expect (:data:`LOOKUP_RPCS`, :func:`controller_rpcs`) and take the
index down and up through :class:`Deployment`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvfabric.testing import Cluster

__all__ = ["INDEX", "LOOKUP_RPCS", "SHARED", "Deployment", "controller_rpcs", "deployment"]

INDEX = os.environ.get("KVFABRIC_ADAPTER_INDEX", "controller")
if INDEX not in ("controller", "redis", "redis-cluster"):
    raise ValueError(f"KVFABRIC_ADAPTER_INDEX={INDEX!r}: controller, redis or redis-cluster")
SHARED = INDEX != "controller"
LOOKUP_RPCS = 1 if SHARED else 0
"""Control calls one lookup costs: none where the controller's lookup image answers it, one
round to Redis otherwise."""


class Deployment:
    """A :class:`Cluster`, and for a Redis-backed one the Redis servers under it."""

    def __init__(self, cluster: Cluster, redis: Any = None) -> None:
        self.cluster = cluster
        self.redis = redis

    def kill_index(self) -> None:
        """The index goes away: the controller, or every Redis server (kill -9)."""
        if self.redis is None:
            self.cluster.kill_controller()
            return
        for server in self.redis.servers:
            if server.alive:
                self.redis.kill(server.port)

    def start_index(self) -> None:
        """The index comes back empty: the controller, or the Redis server restarted (the
        nodes register again and report their records either way)."""
        if self.redis is None:
            self.cluster.start_controller()
        else:
            self.redis.restart(self.redis.servers[0].port)


@contextmanager
def deployment(
    nodes: int = 1, *, single_redis: bool = False, **options: Any
) -> Iterator[Deployment]:
    """The deployment ``KVFABRIC_ADAPTER_INDEX`` names, with ``nodes`` data nodes
    (``options``: more :class:`Cluster` arguments, ``node_ttl`` for Redis only (default
    10 s); ``single_redis``: one Redis server even where a cluster is asked for, for a test
    that restarts it)."""
    if not SHARED:
        options.pop("node_ttl", None)
        with Cluster(nodes=nodes, **options) as cluster:
            yield Deployment(cluster)
        return
    from redis_servers import RedisDeployment

    if INDEX == "redis" or single_redis:
        redis = RedisDeployment.single()
    else:
        redis = RedisDeployment.cluster(masters=3, replicas=1)
    # A liveness TTL well above a stalled engine's start-up on a busy machine.
    node_ttl = options.pop("node_ttl", "10s")
    with redis, Cluster(nodes=nodes, redis=redis.url, node_ttl=node_ttl, **options) as cluster:
        yield Deployment(cluster, redis)


def controller_rpcs(cluster: Cluster) -> int:
    """Client RPCs the controller served so far (0 without one: the clients' own counters
    say what Redis was asked)."""
    if cluster.redis:
        return 0
    return cluster.stats()["controller"]["rpcs"]
