"""The record I/O layer: moving whole records between caller buffers and data-node slots.

It owns everything between "these descriptors" and "these values": routing (which transport
reaches which node, :mod:`~kvfabric._client.routes`), framing (a record is a header segment
and one segment per payload piece, written once here for reads and writes alike), landing
(nodes in parallel, one transport call per node, or a few at once for a large write to a
transport with ``write_lanes``) and validation (magic, key, version, length, CRC32C). It
never talks to the index: the store learns membership and hands it over with
:meth:`RecordIO.set_nodes`. A node that fails as a whole (a timeout, a failed connection)
is held off for a while by :mod:`~kvfabric._client.node_breaker`: its records are skipped,
not waited for, until a probe finds it answering again.

Reads land straight in the caller's buffers (or in one fresh allocation per batch), writes
gather straight from the caller's buffers. The GIL is taken back a bounded number of times
per node batch, not per record or segment: every wait beside a busy Python thread costs a
switch interval. So each node's records move in one transport call that also returns each
payload's CRC32C (``read_checksummed`` / ``write_checksummed``: taken while the bytes move
where the transport can, else in one native call for the batch), and the per-record work
here (framing, header checks) is Python that keeps the GIL. Writes store every payload
before any header. Failures are reported per record, never raised: the store turns them
into misses and counters.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs
import numpy as np

from kvfabric._client.node_breaker import NodeBreaker
from kvfabric._client.routes import Routes
from kvfabric._runtime import forks
from kvfabric._runtime.buffers import byte_view, writable_view
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric._runtime.record import HEADER_SIZE, pack_headers, validate_record
from kvfabric.descriptor import Descriptor
from kvfabric.errors import NotSupportedError, TransportError, ValidationError
from kvfabric.spi.index import NodeInfo
from kvfabric.spi.transport import Segment, TransportClient

__all__ = ["ReadReport", "RecordIO", "WriteReport", "value_pieces"]

log = logging.getLogger("kvfabric")
T = TypeVar("T")
K = TypeVar("K")

LANE_MIN_BYTES = 8 << 20
"""A node's write below this goes as one call whatever the transport's ``write_lanes``: a
second thread's hand-off costs more than it saves on a small batch."""

NODE_BACKOFF = 1.0
"""Seconds a node that failed as a whole is held off, by default (option ``node_backoff``)."""


@attrs.frozen(kw_only=True)
class ReadReport:
    """What a batch of reads came to, one entry per requested record."""

    values: list[memoryview | None]
    """The landed, validated value (a view of its buffer), or None."""
    invalid: list[int]
    """Indices of records that landed but failed validation (stale or foreign bytes)."""
    payload_bytes: int
    """Payload bytes that landed (validated or not)."""
    failed_nodes: int
    """Nodes that could not be used at all (unreachable, timed out): their records are None."""
    refused: int = 0
    """Records a node or transport refused (unknown region, bad rkey, out of bounds): the
    route may be stale (the node restarted), so the store relearns the nodes."""
    unreachable: list[int] = attrs.field(factory=list)
    """Indices of records that did not land: their node failed, refused them or is held
    off (where another copy of the value exists, the store reads that one)."""
    skipped: int = 0
    """Records not read because their node is held off (:mod:`~kvfabric._client.node_breaker`)."""
    backed_off: int = 0
    """Nodes whose failure in this batch began or lengthened their holding off."""


@attrs.frozen(kw_only=True)
class WriteReport:
    """What a batch of writes came to, one entry per record."""

    crcs: list[int | None]
    """The payload CRC32C written with each record, or None where the write failed."""
    failed_nodes: int
    skipped: int = 0
    """Records not written because their node is held off (their CRC is None)."""
    backed_off: int = 0
    """Nodes whose failure in this batch began or lengthened their holding off."""


class _Read:
    """One record being read: where it lands and whether it made it."""

    __slots__ = ("descriptor", "header", "index", "key", "pieces", "refused", "result")

    def __init__(
        self,
        index: int,
        key: bytes,
        descriptor: Descriptor,
        header: memoryview,
        pieces: list[memoryview],
    ) -> None:
        self.index = index
        self.key = key
        self.descriptor = descriptor
        self.header = header
        self.pieces = pieces
        """Where the payload lands, in order (usually one buffer)."""
        self.refused = False
        """The node refused the read (bad rkey, out of bounds): a miss, not an invalid record."""
        self.result: memoryview | None = None


class RecordIO:
    """Reads and writes records on the data nodes a store knows; thread-safe.

    Public for tools and tests (``Store.records``): :meth:`read_slot` and :meth:`write_slot`
    move raw bytes of one record's slot; :meth:`reaches` and :meth:`transport_of` say
    whether and over which transport a node is reached. The rest is the store's.
    """

    def __init__(
        self,
        clients: Mapping[str, TransportClient],
        preference: Sequence[str],
        *,
        node_backoff: float = NODE_BACKOFF,
    ) -> None:
        """``clients``: a transport client per name; ``preference``: names, most preferred
        first; ``node_backoff``: seconds a node that failed as a whole is held off at first
        (0: never)."""
        self._generation = forks.generation()
        self._routes = Routes(clients, preference)
        self.breaker = NodeBreaker(node_backoff)
        """The nodes held off (lookups consult it too). Tests may set its ``clock``."""
        self._lock = threading.Lock()
        self._io_pool: ThreadPoolExecutor | None = None
        # One line a minute per node and kind of failure, however many calls fail meanwhile.
        self._limited = LimitedLog(log)

    # -- membership ----------------------------------------------------------------------

    def set_nodes(self, nodes: Sequence[NodeInfo]) -> None:
        """Make the known data nodes exactly ``nodes`` (connects new ones, forgets gone ones)."""
        self.breaker.forget(self._routes.replace_nodes(nodes))

    def reaches(self, nodes: Iterable[int]) -> bool:
        """Whether every one of ``nodes`` has a route."""
        return self._routes.knows_all(nodes)

    def transport_of(self, node: int) -> str | None:
        """The transport this client uses for ``node`` (None if no route)."""
        return self._routes.transport_of(node)

    # -- records -------------------------------------------------------------------------

    def read(
        self,
        keys: Sequence[bytes],
        descriptors: Sequence[Descriptor | None],
        into: Sequence[Any] | None = None,
    ) -> ReadReport:
        """Land and validate the record of each key that has a descriptor.

        ``into``: per key, a writable buffer or a list of buffers filled in order; a value
        that does not fit is a miss. Without ``into``, values land in one new allocation.
        """
        values: list[memoryview | None] = [None] * len(keys)
        per_node = _plan_reads(keys, descriptors, into, self._limited)
        if not per_node:
            return ReadReport(values=values, invalid=[], payload_bytes=0, failed_nodes=0)
        breaker = self.breaker
        held_off = breaker.skipped(per_node)
        started = breaker.now()
        refused = skipped = backed_off = 0
        outcomes = (
            self._per_node(
                {
                    n: functools.partial(self._read_node, n, items)
                    for n, items in per_node.items()
                    if n not in held_off
                }
            )
            if len(held_off) < len(per_node)
            else {}
        )
        invalid: list[int] = []
        unreachable: list[int] = []
        landed = 0
        failed_nodes = 0
        for node, items in per_node.items():
            if node in held_off:
                skipped += len(items)
                unreachable += [item.index for item in items]
                continue
            outcome = outcomes[node]
            if isinstance(outcome, BaseException):
                self._limited.warning(
                    ("read", node), "kvfabric: read from node %d failed (%s): misses", node, outcome
                )
                failed_nodes += 1
                unreachable += [item.index for item in items]
                if isinstance(outcome, TransportError):
                    backed_off += breaker.failed(node, started)
                continue
            breaker.succeeded(node)
            landed += outcome
            for item in items:
                if item.result is not None:
                    values[item.index] = item.result
                elif item.refused:
                    refused += 1
                    unreachable.append(item.index)
                else:
                    invalid.append(item.index)
        return ReadReport(
            values=values,
            invalid=invalid,
            payload_bytes=landed,
            failed_nodes=failed_nodes,
            refused=refused,
            unreachable=unreachable,
            skipped=skipped,
            backed_off=backed_off,
        )

    def write(
        self, descriptors: Sequence[Descriptor], values: Sequence[Sequence[memoryview]]
    ) -> WriteReport:
        """Checksum and write each record (the value's pieces, then its header) into its slot.

        Nodes are written in parallel (one node's checksums overlap another's transfer), one
        transport call per node, or ``write_lanes`` calls at once for a node's write of at
        least ``LANE_MIN_BYTES``; the CRC is of the caller's buffers, taken while they are
        copied where the transport can (``shm``), else in one native call right before.
        """
        crcs: list[int | None] = [None] * len(descriptors)
        per_node: dict[int, list[int]] = {}
        for i, d in enumerate(descriptors):
            per_node.setdefault(d.node, []).append(i)
        breaker = self.breaker
        held_off = breaker.skipped(per_node)
        started = breaker.now()
        skipped = sum(len(per_node.pop(node)) for node in held_off)
        if not per_node:
            return WriteReport(crcs=crcs, failed_nodes=0, skipped=skipped)
        per_lane: dict[tuple[int, int], list[int]] = {}
        for node, indices in per_node.items():
            lanes = self._routes.client_for(node).write_lanes
            for lane, part in enumerate(_split_by_bytes(indices, descriptors, lanes)):
                per_lane[node, lane] = part

        def job(node: int, indices: list[int]) -> list[int | None]:
            items = [(descriptors[i], values[i]) for i in indices]
            return self._write_node(node, items)

        outcomes = self._per_node(
            {key: functools.partial(job, key[0], idx) for key, idx in per_lane.items()}
        )
        failed: set[int] = set()
        backed_off = 0
        for key, indices in per_lane.items():
            node, outcome = key[0], outcomes[key]
            if isinstance(outcome, BaseException):
                if node not in failed:
                    self._limited.warning(
                        ("write", node),
                        "kvfabric: write to node %d failed (%s): not stored",
                        node,
                        outcome,
                    )
                    if isinstance(outcome, TransportError):
                        backed_off += breaker.failed(node, started)
                failed.add(node)
                continue
            for i, crc in zip(indices, outcome, strict=True):
                crcs[i] = crc
        if breaker.engaged:
            for node in per_node.keys() - failed:
                breaker.succeeded(node)
        return WriteReport(
            crcs=crcs, failed_nodes=len(failed), skipped=skipped, backed_off=backed_off
        )

    def wipe(self, descriptors: Sequence[Descriptor]) -> int:
        """Zero the headers of records this client wrote into slots still its own but whose
        publish is not known to have been served: no read validates them and no scan of a
        node finds them, so a controller that restarts never restores them. How many were
        wiped (a node that fails keeps its records: best effort)."""
        per_node: dict[int, list[Descriptor]] = {}
        for d in descriptors:
            if self._routes.knows_all([d.node]):
                per_node.setdefault(d.node, []).append(d)
        if not per_node:
            return 0
        zeros = memoryview(bytes(HEADER_SIZE))

        def job(node: int, records: list[Descriptor]) -> int:
            segments = [Segment(d.region, d.rkey, d.offset, zeros) for d in records]
            errors = self._routes.client_for(node).write(node, segments)
            return sum(error is None for error in errors)

        outcomes = self._per_node(
            {node: functools.partial(job, node, records) for node, records in per_node.items()}
        )
        return sum(n for n in outcomes.values() if isinstance(n, int))

    # -- raw slot access (tools and tests) -----------------------------------------------

    def read_slot(self, descriptor: Descriptor, at: int, buffer: Any) -> None:
        """Land ``len(buffer)`` raw bytes of ``descriptor``'s record, ``at`` bytes from its start.

        The header is at 0 and the payload at :data:`~kvfabric._runtime.record.HEADER_SIZE`;
        nothing is validated. Raises :class:`TransportError` if the node refuses or cannot
        be reached (call ``Store.ping()`` first to learn a node that joined later).
        """
        self._slot_io(descriptor, at, writable_view(buffer), write=False)

    def write_slot(self, descriptor: Descriptor, at: int, buffer: Any) -> None:
        """Store ``buffer`` as raw bytes into ``descriptor``'s record, ``at`` bytes from its start.

        Behind the index's back and without a new checksum: for tests that corrupt records.
        Same errors as :meth:`read_slot`.
        """
        self._slot_io(descriptor, at, byte_view(buffer), write=True)

    def _slot_io(self, d: Descriptor, at: int, view: memoryview, *, write: bool) -> None:
        if self._generation != forks.generation():
            raise NotSupportedError(
                "this record I/O layer was made before a fork and its transport clients "
                "are the parent's: take Store.records again in this process"
            )
        if at < 0 or at + view.nbytes > HEADER_SIZE + d.length:
            raise ValueError(
                f"bytes [{at}, {at + view.nbytes}) lie outside a record of "
                f"{HEADER_SIZE + d.length} bytes"
            )
        client = self._routes.client_for(d.node)
        segments = [Segment(d.region, d.rkey, d.offset + at, view)]
        errors = client.write(d.node, segments) if write else client.read(d.node, segments)
        if errors[0] is not None:
            raise errors[0]

    def close(self) -> None:
        """Wait for work in flight, then disconnect every node and close the transports."""
        with self._lock:
            pool, self._io_pool = self._io_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._routes.close()

    # -- internals -----------------------------------------------------------------------

    def _per_node(self, jobs: Mapping[K, Callable[[], T]]) -> dict[K, T | BaseException]:
        """Run one job per node (or per lane of a node's write), concurrently when there
        are several; errors are returned.

        A batch for a single node runs inline, so the common case adds no thread hand-off.
        ``jobs`` is not empty.
        """
        (first_key, first_job), *rest = jobs.items()
        if not rest:
            return {first_key: _call(first_job)}
        with self._lock:
            if self._io_pool is None:
                self._io_pool = ThreadPoolExecutor(8, thread_name_prefix="kvfabric-io")
            pool = self._io_pool
        futures = {key: pool.submit(_call, job) for key, job in rest}
        # The calling thread runs one job itself rather than only waiting: one hand-off
        # fewer, and its own GIL returns are those of one job.
        outcomes = {first_key: _call(first_job)}
        outcomes.update((key, future.result()) for key, future in futures.items())
        return outcomes

    def _read_node(self, node: int, items: list[_Read]) -> int:
        """Land one node's records and validate them; returns payload bytes landed.

        One transport call lands the batch with each payload's CRC32C, so the batch takes
        the GIL back once and the payload is not read a second time to check it.
        """
        client = self._routes.client_for(node)
        segments: list[Segment] = []
        spans: list[tuple[int, int]] = []
        for item in items:
            start = len(segments) + 1  # the payload follows the header
            _frame(item.descriptor, item.header, item.pieces, segments)
            spans.append((start, len(segments)))
        errors, crcs = client.read_checksummed(node, segments, spans)
        landed = 0
        for item, (start, stop), crc in zip(items, spans, crcs, strict=True):
            if any(e is not None for e in errors[start - 1 : stop]):
                item.refused = True
                continue
            landed += item.descriptor.length
            try:
                validate_record(
                    item.header, item.pieces, item.descriptor, item.key, payload_crc=crc
                )
            except ValidationError as exc:
                self._limited.info(
                    ("invalid", node),
                    "kvfabric: record for key %s invalid (%s): miss",
                    item.key.hex(),
                    exc,
                )
                continue
            item.result = item.pieces[0]
        return landed

    def _write_node(
        self, node: int, items: list[tuple[Descriptor, Sequence[memoryview]]]
    ) -> list[int | None]:
        client = self._routes.client_for(node)
        payloads: list[Segment] = []
        spans: list[tuple[int, int]] = []
        for d, pieces in items:
            start = len(payloads)
            offset = d.offset + HEADER_SIZE
            for piece in pieces:
                payloads.append(Segment(d.region, d.rkey, offset, piece))
                offset += piece.nbytes
            spans.append((start, len(payloads)))

        keys = [d.key for d, _ in items]
        versions = [d.version for d, _ in items]
        lengths = [d.length for d, _ in items]

        def headers(crcs: list[int]) -> list[Segment]:
            # All of them in one native call; each segment lands one slice of the block.
            block = memoryview(pack_headers(keys, versions, lengths, crcs))
            return [
                Segment(d.region, d.rkey, d.offset, block[at : at + HEADER_SIZE])
                for (d, _), at in zip(items, range(0, len(block), HEADER_SIZE), strict=True)
            ]

        errors, crcs = client.write_checksummed(node, payloads, spans, headers)
        heads = errors[len(payloads) :]
        return [
            crc if heads[i] is None and all(e is None for e in errors[start:stop]) else None
            for i, ((start, stop), crc) in enumerate(zip(spans, crcs, strict=True))
        ]


def _split_by_bytes(
    indices: list[int], descriptors: Sequence[Descriptor], lanes: int
) -> list[list[int]]:
    """``indices`` in at most ``lanes`` runs, in order, of about equal payload bytes."""
    total = sum(descriptors[i].length for i in indices)
    if lanes <= 1 or len(indices) < 2 or total < LANE_MIN_BYTES:
        return [indices]
    lanes = min(lanes, len(indices))
    runs: list[list[int]] = [[]]
    done = 0
    for i in indices:
        # Start the next run once this one holds its share (never leaving a run empty).
        if runs[-1] and len(runs) < lanes and done >= total * len(runs) / lanes:
            runs.append([])
        runs[-1].append(i)
        done += descriptors[i].length
    return runs


# -- framing -------------------------------------------------------------------------------


def _frame(
    d: Descriptor, head: memoryview, pieces: Sequence[memoryview], out: list[Segment]
) -> None:
    """Append one record's segments to read: its header, then each payload piece."""
    out.append(Segment(d.region, d.rkey, d.offset, head))
    offset = d.offset + HEADER_SIZE
    for piece in pieces:
        out.append(Segment(d.region, d.rkey, offset, piece))
        offset += piece.nbytes


def _plan_reads(
    keys: Sequence[bytes],
    descriptors: Sequence[Descriptor | None],
    into: Sequence[Any] | None,
    limited: LimitedLog,
) -> dict[int, list[_Read]]:
    """Where each record lands, grouped by node (records without a descriptor are skipped)."""
    headers = memoryview(bytearray(HEADER_SIZE * len(keys)))
    per_node: dict[int, list[_Read]] = {}
    arena: memoryview | None = None
    used = 0
    if into is None:
        # One uninitialised allocation for the batch: a bytearray per value would be
        # zero-filled page by page while holding the GIL, and a malloc per value costs
        # an mmap each; here the first touch of each page is the GIL-free copy.
        arena = np.empty(sum(d.length for d in descriptors if d), dtype=np.uint8).data
    for i, d in enumerate(descriptors):
        if d is None:
            continue
        if arena is not None:
            pieces = [arena[used : used + d.length]]
            used += d.length
        else:
            assert into is not None
            landing = _landing_pieces(into[i], d.length)
            if landing is None:
                limited.warning(
                    "short buffer",
                    "kvfabric: buffers for key %d hold less than %d bytes: miss",
                    i,
                    d.length,
                )
                continue
            pieces = landing
        header = headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
        per_node.setdefault(d.node, []).append(_Read(i, keys[i], d, header, pieces))
    return per_node


def value_pieces(value: Any) -> list[memoryview]:
    """A value as flat views: one buffer, or a list of buffers concatenated."""
    if isinstance(value, list | tuple):
        return [byte_view(piece) for piece in value]
    return [byte_view(value)]


def _landing_pieces(target: Any, length: int) -> list[memoryview] | None:
    """The views a value of ``length`` bytes lands in: one buffer, or several in order.

    None when they hold less than ``length`` bytes.
    """
    buffers = target if isinstance(target, list | tuple) else (target,)
    pieces: list[memoryview] = []
    need = length
    for buffer in buffers:
        if need == 0:
            break
        view = writable_view(buffer)
        take = min(view.nbytes, need)
        pieces.append(view[:take])
        need -= take
    if need or not buffers:
        return None
    if not pieces:  # an empty value still lands "somewhere", for a uniform read path
        pieces.append(writable_view(buffers[0])[:0])
    return pieces


def _call(job: Callable[[], T]) -> T | BaseException:
    try:
        return job()
    except Exception as exc:
        return exc
