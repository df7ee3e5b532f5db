"""The client side every transport shares: one peer table, planned batches, one error boundary.

A transport's client subclasses :class:`PeerClient` with its own per-node state ``P`` and
writes the primitives (fsspec style): ``open_peer`` / ``close_peer`` for one node, and
``read_segments`` / ``write_segments`` for one node's planned :class:`~kvfabric.spi.Batch`.
It inherits the API the framework calls (``connect``, ``reachable``, ``read``, ``write``,
``disconnect``, ``close``): the table of nodes, the checks of every segment before anything
moves (:func:`~kvfabric.spi.plan_batch`), the call's deadline, and the mapping of native
exceptions (``native_errors``) at each primitive.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar

from kvfabric.errors import TransportError
from kvfabric.spi.boundary import SOCKET_ERRORS, ExceptionMapping, map_exceptions
from kvfabric.spi.segments import Batch, plan_batch
from kvfabric.spi.transport import (
    NodeEndpoint,
    RegionHandle,
    Segment,
    TransportClient,
    TransportConfig,
)

__all__ = ["PeerClient"]

log = logging.getLogger("kvfabric")

P = TypeVar("P")


class _Entry(Generic[P]):
    """One connected node: its endpoint, its regions by id, the transport's state, and the
    error boundary its calls run in (stateless, so made once and shared by every call)."""

    __slots__ = ("boundary", "endpoint", "regions", "state", "where")

    def __init__(
        self, endpoint: NodeEndpoint, state: P, where: str, errors: ExceptionMapping
    ) -> None:
        self.endpoint = endpoint
        self.regions: dict[int, RegionHandle] = {h.region: h for h in endpoint.regions}
        self.state = state
        self.where = where
        self.boundary = map_exceptions(errors, where=where)


class PeerClient(TransportClient, Generic[P]):
    """A transport client that writes its primitives and inherits the rest; thread-safe.

    The table maps node id → the transport's state for it. ``connect`` with the endpoint a
    node already has is a no-op; with another endpoint (the node re-registered elsewhere, or
    with other regions) it opens new state and closes the old. Primitives run without the
    table's lock, for several nodes and several calls at once.
    """

    native_errors: ClassVar[ExceptionMapping] = SOCKET_ERRORS
    """Exceptions the primitives may raise, and what each becomes (first match wins)."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._peers: dict[int, _Entry[P]] = {}
        self._table_lock = threading.Lock()
        self._closed = False

    # -- primitives ---------------------------------------------------------------------

    @abc.abstractmethod
    def open_peer(self, endpoint: NodeEndpoint) -> P:
        """State for talking to one node (connections, mappings, keys); raise if unusable."""

    def close_peer(self, peer: P) -> None:
        """Release what :meth:`open_peer` made; calls in flight on it may then fail."""

    @abc.abstractmethod
    def read_segments(self, peer: P, batch: Batch) -> None:
        """Land every segment of ``batch`` in its buffer by ``batch.deadline``.

        The segments are checked already. Raise when the node as a whole cannot be used
        (a native exception is mapped by ``native_errors``); call ``batch.refuse(i, why)``
        for a segment the node itself refused.
        """

    @abc.abstractmethod
    def write_segments(self, peer: P, batch: Batch) -> None:
        """Store every segment's buffer in the node's memory; same contract as reads."""

    def describe(self, endpoint: NodeEndpoint) -> str:
        """How errors name the node (e.g. with its address)."""
        return f"node {endpoint.node}"

    # -- what the framework calls -------------------------------------------------------

    def connect(self, endpoint: NodeEndpoint) -> None:
        with self._table_lock:
            self._check_open()
            known = self._peers.get(endpoint.node)
            if known is not None and known.endpoint == endpoint:
                return
        where = self.describe(endpoint)
        with map_exceptions(self.native_errors, where=f"{where}: cannot connect"):
            state = self.open_peer(endpoint)
        entry = _Entry(endpoint, state, where, self.native_errors)
        with self._table_lock:
            current = self._peers.get(endpoint.node)
            installed = not self._closed and (current is None or current.endpoint != endpoint)
            if installed:
                self._peers[endpoint.node] = entry
        # Not installed: the client was closed meanwhile, or a concurrent connect to the same
        # endpoint won; either way ours is surplus.
        stale = current if installed else entry
        if stale is not None:
            self._release(stale)
        self._check_open()

    def read(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        entry, batch = self._plan(node, segments, into_buffers=True)
        if batch.segments:
            with entry.boundary:
                self.read_segments(entry.state, batch)
        return batch.errors

    def write(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        entry, batch = self._plan(node, segments, into_buffers=False)
        if batch.segments:
            with entry.boundary:
                self.write_segments(entry.state, batch)
        return batch.errors

    def disconnect(self, node: int) -> None:
        with self._table_lock:
            entry = self._peers.pop(node, None)
        if entry is not None:
            self._release(entry)

    def close(self) -> None:
        """Close every peer; subclasses that hold more extend this and call it first."""
        with self._table_lock:
            self._closed = True
            entries, self._peers = list(self._peers.values()), {}
        for entry in entries:
            self._release(entry)

    # -- the shared work ----------------------------------------------------------------

    def _plan(
        self, node: int, segments: Sequence[Segment], *, into_buffers: bool
    ) -> tuple[_Entry[P], Batch]:
        deadline = time.monotonic() + self.config.timeout
        entry = self._peers.get(node)  # one dict read is atomic; the lock orders changes
        if entry is None:
            raise TransportError(f"not connected to node {node}")
        batch = plan_batch(
            node, segments, entry.regions, into_buffers=into_buffers, deadline=deadline
        )
        return entry, batch

    def _release(self, entry: _Entry[P]) -> None:
        try:
            with entry.boundary:
                self.close_peer(entry.state)
        except TransportError as exc:
            # The node is being forgotten either way; a failed release must not stop the
            # caller from forgetting the others.
            log.warning("kvfabric: closing %s failed: %s", entry.where, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this transport client is closed")
