"""Why every put is ``NO_SPACE`` when the index lists no data node at all.

A store with no data node has no space, so its puts are ``NO_SPACE`` as a full store's
are; the usual cause is a client pointed at another cache than its nodes: another Redis
namespace (``?redis.namespace=`` on the client, ``--index-opt redis.namespace=`` on the
nodes), another Redis, another controller. When a put stores nothing and gets
``NO_SPACE``, :class:`NoSpaceHint` asks the index for its nodes (one call, at most once a
minute, on that path only) and, if there are none, logs a warning that names the index,
the namespace and the fix.
"""

from __future__ import annotations

import logging
import time

from kvfabric._client.index_calls import IndexCalls

__all__ = ["HINT_EVERY", "NoSpaceHint"]

log = logging.getLogger("kvfabric._client.store")

HINT_EVERY = 60.0
"""Seconds between two looks at the index's nodes (and two warnings)."""


class NoSpaceHint:
    def __init__(self, calls: IndexCalls) -> None:
        self._calls = calls
        self._next = 0.0

    def after_no_space(self) -> None:
        """A put stored nothing and got ``NO_SPACE``: warn if the index lists no node."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + HINT_EVERY
        nodes = self._calls.ask(self._calls.index.nodes)
        if nodes is None or len(nodes):
            return  # not reachable (said elsewhere), or really full
        namespace = getattr(self._calls.index, "namespace", None)
        if isinstance(namespace, str):
            log.warning(
                "puts are NO_SPACE: no data node is registered in the index's namespace %r. "
                "Nodes and clients share a cache only within one namespace: give the nodes "
                "`--index-opt redis.namespace=NAME` and the clients `?redis.namespace=NAME` "
                "with the same NAME",
                namespace,
            )
        else:
            log.warning(
                "puts are NO_SPACE: no data node is registered with this store's index "
                "(is `kvfabric node` running, and registered with the same controller?)"
            )
