"""The client side every transport shares: one peer table, planned batches, one error boundary.

A transport's client subclasses :class:`PeerClient` with its own per-node state ``P`` and
writes the primitives (fsspec style): ``open_peer`` / ``close_peer`` for one node, and
``read_segments`` / ``write_segments`` for one node's planned :class:`~kvfabric.spi.Batch`.
It inherits the API the framework calls (``connect``, ``reachable``, ``read``, ``write``,
``read_checksummed``, ``write_checksummed``, ``disconnect``, ``close``): the table of nodes,
the checks of every segment before anything moves (:func:`~kvfabric.spi.plan_batch`), the
call's deadline, the mapping of native exceptions (``native_errors``) at each primitive,
and the CRC32C of every record a batch moves: taken by the primitive while bytes move where
it can (``Batch.crcs``), else in one native call for the batch.
"""

from __future__ import annotations

import abc
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, TypeVar

from kvfabric._runtime.buffers import byte_view
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
    checksums_writes: ClassVar[bool] = False
    """``write_segments`` sets ``batch.crcs`` (the CRC32C of each span's source bytes) as it
    writes, when the batch has ``crc_spans``. A checksummed write then stores the payloads
    in one call and the trailer (the headers, made from those CRCs) in a second; otherwise
    the CRCs come first, in one native call, and one call stores payloads and trailer."""
    streams_trailers: ClassVar[bool] = False
    """A checksummed write is one ``write_segments`` call whose batch has a ``trailer``
    (see :class:`~kvfabric.spi.Batch`): the primitive checksums the payloads while it
    sends them, then sends the trailer made from those CRCs in the same request (one
    round trip, no pass of its own over the payloads for their CRCs)."""

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
        for a segment the node itself refused. When ``batch.crc_spans`` is set, a primitive
        that can checksum while bytes land sets ``batch.crcs``; one that does not leaves it
        None and the batch is checksummed after it returns.
        """

    @abc.abstractmethod
    def write_segments(self, peer: P, batch: Batch) -> None:
        """Store every segment's buffer in the node's memory; same contract as reads.

        With :attr:`checksums_writes`, set ``batch.crcs`` when ``batch.crc_spans`` is set.
        """

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
        entry = self._entry(node)
        batch = self._plan(entry, segments, into_buffers=True)
        self._move(entry, batch, self.read_segments)
        return batch.errors

    def write(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        entry = self._entry(node)
        batch = self._plan(entry, segments, into_buffers=False)
        self._move(entry, batch, self.write_segments)
        return batch.errors

    def read_checksummed(
        self, node: int, segments: Sequence[Segment], crc_spans: Sequence[tuple[int, int]]
    ) -> tuple[list[TransportError | None], list[int]]:
        entry = self._entry(node)
        batch = self._plan(entry, segments, into_buffers=True, crc_spans=crc_spans)
        self._move(entry, batch, self.read_segments)
        return batch.errors, batch.crcs if batch.crcs is not None else batch.checksum()

    def write_checksummed(
        self,
        node: int,
        segments: Sequence[Segment],
        crc_spans: Sequence[tuple[int, int]],
        trailer: Callable[[list[int]], Sequence[Segment]],
    ) -> tuple[list[TransportError | None], list[int]]:
        entry = self._entry(node)
        batch = self._plan(entry, segments, into_buffers=False, crc_spans=crc_spans)
        if self.checksums_writes:
            self._move(entry, batch, self.write_segments)
            crcs = batch.crcs if batch.crcs is not None else batch.checksum()
            # A second call: the trailer is stored only once every payload byte is.
            tail = self._plan(entry, trailer(crcs), into_buffers=False, deadline=batch.deadline)
            self._move(entry, tail, self.write_segments)
            return batch.errors + tail.errors, crcs
        if self.streams_trailers:
            return self._write_streamed(entry, batch, trailer)
        crcs = batch.checksum()
        tail = self._plan(entry, trailer(crcs), into_buffers=False, deadline=batch.deadline)
        both = _joined(batch, tail)
        self._move(entry, both, self.write_segments)
        return both.errors, crcs

    def _write_streamed(
        self, entry: _Entry[P], batch: Batch, trailer: Callable[[list[int]], Sequence[Segment]]
    ) -> tuple[list[TransportError | None], list[int]]:
        """One call: the trailer is planned from placeholder CRCs (its places and sizes do
        not depend on them) and made for real by the primitive, once it has the CRCs."""
        spans = batch.crc_spans or []
        placeholder = self._plan(
            entry, trailer([0] * len(spans)), into_buffers=False, deadline=batch.deadline
        )
        both = _joined(batch, placeholder)
        both.crc_spans = batch.crc_spans
        both.trailer_start = len(batch.segments)
        both.trailer = functools.partial(_trailer_buffers, trailer, placeholder)
        self._move(entry, both, self.write_segments)
        crcs = both.crcs
        if crcs is None:
            raise TransportError(f"{entry.where}: the write did not report its checksums")
        return both.errors, crcs

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

    def _entry(self, node: int) -> _Entry[P]:
        entry = self._peers.get(node)  # one dict read is atomic; the lock orders changes
        if entry is None:
            raise TransportError(f"not connected to node {node}")
        return entry

    def _plan(
        self,
        entry: _Entry[P],
        segments: Sequence[Segment],
        *,
        into_buffers: bool,
        crc_spans: Sequence[tuple[int, int]] | None = None,
        deadline: float | None = None,
    ) -> Batch:
        return plan_batch(
            entry.endpoint.node,
            segments,
            entry.regions,
            into_buffers=into_buffers,
            deadline=time.monotonic() + self.config.timeout if deadline is None else deadline,
            crc_spans=crc_spans,
        )

    @staticmethod
    def _move(entry: _Entry[P], batch: Batch, primitive: Callable[[P, Batch], None]) -> None:
        if batch.segments:
            with entry.boundary:
                primitive(entry.state, batch)

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


def _trailer_buffers(
    trailer: Callable[[list[int]], Sequence[Segment]], planned: Batch, crcs: list[int]
) -> list[memoryview]:
    """The buffers of the trailer made from ``crcs``, for the segments planning accepted;
    each must land where its placeholder was planned, with the same size."""
    made = trailer(crcs)
    buffers: list[memoryview] = []
    for seg, position in zip(planned.segments, planned.positions, strict=True):
        real = made[position]
        view = byte_view(real.buffer)
        if (real.region, real.rkey, real.offset, view.nbytes) != (
            seg.region,
            seg.rkey,
            seg.offset,
            seg.buffer.nbytes,
        ):
            raise ValueError(
                f"trailer segment {position} changed with its CRCs ({real!r}, planned as "
                f"{seg!r}): a trailer's places and sizes must not depend on them"
            )
        buffers.append(view)
    return buffers


def _joined(first: Batch, second: Batch) -> Batch:
    """One batch of ``first``'s segments then ``second``'s (whose CRCs are known already)."""
    offset = len(first.errors)
    return Batch(
        first.node,
        first.segments + second.segments,
        first.positions + [p + offset for p in second.positions],
        first.errors + second.errors,
        first.deadline,
    )
