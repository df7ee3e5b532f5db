"""The ``tcp`` client: pooled, authenticated connections that move planned batches.

A :class:`~kvfabric.spi.PeerClient` (peer table, segment checks and error mapping are
inherited). Per node it keeps a few idle connections (``tcp.pool``, default 8), so
concurrent calls do not serialize and the handshake is paid per connection, not per call.
A batch of more than ``MAX_COUNT`` segments goes as several frames on one connection. A
read of at least ``READ_LANE_MIN`` bytes goes as one frame per lane (``tcp.read_lanes``)
on as many connections at once, in one native call (``request_reply_lanes``).

Over plain tcp a frame is one native call (``kvfabric._runtime.native.request_reply``): the request
(a write's payloads in it), the reply's status table, then a read's accepted payloads,
each read record's CRC32C taken as its bytes land (``Batch.crcs``), with the GIL released
once. A 64 x 4 MiB read or write takes it back once; a checksummed write twice (the
sources' CRCs in one native call first: the records' headers, made from them, travel in
the same frame). Beside a busy Python thread each return waits out the switch interval
(5 ms), so the count is what matters. With TLS, Python's ``ssl`` moves the bytes and takes
the GIL back per call: about one per 16 KiB TLS record received (a 64 x 4 MiB read,
~17,000), one per send.
Every call is bounded by ``config.timeout`` as a whole, connecting included; a connection
that failed or timed out is closed, never reused. A pooled connection the node closed (it
restarted, shut down, or closed it for idling) is retried once on a fresh one: reads and
writes are idempotent.

Opening a connection runs the handshake (``kvfabric.transports.tcp_auth``): the node's
greeting, TLS when the node offers it (and only then: a client with ``tcp.tls`` set refuses
a node that does not offer it, and one without refuses a node that does), the client's
proof, and the node's proof checked in turn.
"""

from __future__ import annotations

import bisect
import hmac
import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from kvfabric.errors import ProtocolError, TransportError
from kvfabric.spi import (
    SOCKET_ERRORS,
    Batch,
    NodeEndpoint,
    PeerClient,
    Segment,
    SegmentStatus,
    TransportConfig,
)
from kvfabric.transports.tcp_auth import (
    FLAG_TLS,
    GREETING_SIZE,
    PROOF_SIZE,
    client_proof,
    new_nonce,
    server_proof,
    unpack_greeting,
)
from kvfabric.transports.tcp_stream import (
    HOLD_GIL,
    Lane,
    PeerClosed,
    Stream,
    TlsStream,
    exchange_lanes,
)
from kvfabric.transports.tcp_tuning import AUTO, tune
from kvfabric.transports.tcp_wire import (
    ENTRY,
    HEADER,
    MAGIC,
    MAX_COUNT,
    VERSION,
    Op,
    code_text,
    pack_header,
)

__all__ = ["TcpClient"]

_OK = SegmentStatus.OK
_MAX_STATUS = max(SegmentStatus)
T = TypeVar("T")

READ_LANE_MIN = 8 << 20
"""A read of this many bytes or more to one node moves over ``tcp.read_lanes`` connections
at once; a smaller one goes as one frame on one connection (a lane's thread and connection
cost more than they save on a small read: the same floor as ``write_lanes``)."""


class _Refused(Exception):
    """The node refused this client (an error reply, or a handshake that cannot succeed)."""


def _parse_address(address: bytes) -> tuple[str, int]:
    host, sep, port = address.decode(errors="replace").rpartition(":")
    if not sep or not port.isdigit():
        raise ProtocolError(f"tcp: not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


@attrs.frozen(kw_only=True)
class _Link:
    """How this client's connections are made: the secret, TLS, the reply spin, the send
    buffer (``tcp_tuning``)."""

    key: bytes
    tls: ssl.SSLContext | None
    busy_poll: float
    send_buffer: int
    read_lanes: int = 1


class _Connection:
    """One authenticated stream to a node; used by one call at a time (the pool hands it out)."""

    __slots__ = ("_next_id", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._next_id = 1

    @classmethod
    def open(cls, address: tuple[str, int], link: _Link, deadline: float) -> _Connection:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed before connecting")
        sock = socket.create_connection(address, timeout=remaining)
        try:
            tune(sock, link.send_buffer)
            stream = _handshake(sock, address[0], link, deadline)
        except BaseException:
            sock.close()
            raise
        return cls(stream)

    def exchange(self, op: Op, frame: _Frame, deadline: float) -> tuple[bytes, list[int]]:
        """One request/reply for up to ``MAX_COUNT`` segments, in one native call (one
        release of the GIL, plain tcp): returns the status table and, for a read with
        ``crc_spans`` (ranges of ``segments``), the CRC32C of each span's landed bytes.

        A write with a trailer is two: the payloads go with their CRCs taken as they are
        sent, then the trailer made from them goes and the reply comes back. The node sees
        one frame either way."""
        rid = self._next_id
        self._next_id += 1
        segments = frame.segments
        count = len(segments)
        head = pack_header(op, 0, count, rid) + frame.table
        buffers = [seg.buffer for seg in segments]
        crc_spans = frame.crc_spans
        trailer = frame.trailer
        request: list[bytes | memoryview]
        payloads: list[memoryview]
        sent_crcs: list[int] | None = None
        if trailer is not None:
            start = frame.trailer_start
            # The frame's header and table go first: the spans are shifted past them.
            shifted = [(a + 1, b + 1) for a, b in crc_spans or ()]
            sent_crcs = self.stream.send_checksummed([head, *buffers[:start]], deadline, shifted)
            request, payloads, crc_spans = [*trailer(sent_crcs)], [], None
        elif op == Op.WRITE:
            request, payloads = [head, *buffers], []
        else:
            request, payloads = [head], buffers
        statuses, crcs = self._request(op, rid, count, request, payloads, deadline, crc_spans)
        return statuses, crcs if sent_crcs is None else sent_crcs

    def read_small(self, segments: Sequence[Segment], deadline: float) -> bool:
        """:meth:`exchange` of one read frame without CRCs, with less to do: whether every
        segment landed."""
        rid = self._next_id
        self._next_id += 1
        count = len(segments)
        head = pack_header(Op.READ, 0, count, rid) + _pack_table(segments)
        payloads = [seg.buffer for seg in segments]
        statuses, _ = self._request(Op.READ, rid, count, [head], payloads, deadline, None)
        return statuses.count(_OK) == count

    def _request(
        self,
        op: Op,
        rid: int,
        count: int,
        request: Sequence[bytes | memoryview],
        payloads: Sequence[memoryview],
        deadline: float,
        crc_spans: Sequence[tuple[int, int]] | None,
    ) -> tuple[bytes, list[int]]:
        """Send the request and take the reply of frame ``rid`` (``count`` segments), then
        each payload the node accepted: the status table and the CRCs of ``crc_spans``."""
        reply = memoryview(bytearray(HEADER.size + count))
        try:
            crcs = self.stream.request_reply(
                request,
                reply,
                payloads,
                deadline,
                status_offset=HEADER.size,
                crc_spans=crc_spans,
                # Reads only: a node serves small READ frames in C, without the GIL, even one
                # in this process (an embedded store's); a WRITE it serves in Python, which a
                # hold here would keep waiting.
                hold_gil=HOLD_GIL if op == Op.READ else 0.0,
            )
        except PeerClosed as closed:
            # An error reply is a bare header, then the node closes: read what it says.
            if closed.received >= HEADER.size:
                _check_reply(reply, op, rid, count)
            raise
        return _statuses(reply, op, rid, count), crcs

    def read_lane(self, frame: _Frame) -> tuple[Lane, int]:
        """``frame`` as a read for :func:`exchange_lanes`, and its request id."""
        rid = self._next_id
        self._next_id += 1
        count = len(frame.segments)
        lane = Lane(
            stream=self.stream,
            request=[pack_header(Op.READ, 0, count, rid) + frame.table],
            reply=memoryview(bytearray(HEADER.size + count)),
            payloads=[seg.buffer for seg in frame.segments],
            status_offset=HEADER.size,
            crc_spans=frame.crc_spans,
        )
        return lane, rid

    def close(self) -> None:
        self.stream.close()


def _handshake(sock: socket.socket, host: str, link: _Link, deadline: float) -> Stream:
    """Run the client's side of the handshake on a fresh connection; the stream to use."""
    key, tls = link.key, link.tls
    stream = Stream(sock, link.busy_poll)
    greeting = memoryview(bytearray(HEADER.size + GREETING_SIZE))
    stream.recv_exact(greeting, deadline)
    _check_reply(greeting, Op.GREETING, 0, GREETING_SIZE)
    flags, server_nonce = unpack_greeting(bytes(greeting[HEADER.size :]))
    offered = bool(flags & FLAG_TLS)
    if offered != (tls is not None):
        if offered:
            raise _Refused("the node requires TLS: set tcp.tls=true (and tcp.tls_ca)")
        raise _Refused("the node does not offer TLS and tcp.tls=true: refusing a plain link")
    if tls is not None:
        stream = TlsStream(
            tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
        )
        stream.handshake(deadline)
    client_nonce = new_nonce()
    proof = client_proof(key, flags, server_nonce, client_nonce)
    stream.send_all([pack_header(Op.HELLO, 0, len(proof) * 2, 0), client_nonce, proof], deadline)
    reply = memoryview(bytearray(HEADER.size + PROOF_SIZE))
    stream.recv_exact(reply[: HEADER.size], deadline)
    _check_reply(reply, Op.HELLO, 0, PROOF_SIZE)
    stream.recv_exact(reply[HEADER.size :], deadline)
    expected = server_proof(key, flags, server_nonce, client_nonce)
    if not hmac.compare_digest(bytes(reply[HEADER.size :]), expected):
        raise _Refused("the node could not prove it holds the secret (a different secret?)")
    return stream


def _statuses(reply: memoryview, op: Op, rid: int, count: int) -> bytes:
    """The status table of a whole reply to frame ``rid`` (``count`` segments)."""
    _check_reply(reply, op, rid, count)
    statuses = bytes(reply[HEADER.size :])
    # A status the client does not know also made the native call skip that payload:
    # the stream is out of step, and the connection is closed.
    if statuses and max(statuses) > _MAX_STATUS:
        raise ProtocolError("unknown segment status in reply")
    return statuses


def _check_reply(buf: bytearray | memoryview, op: Op, rid: int, count: int) -> None:
    magic, version, r_op, code, r_count, r_rid = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError("the peer does not speak the kvfabric tcp protocol")
    if version != VERSION:
        raise ProtocolError(f"the node speaks tcp wire version {version}; this client {VERSION}")
    if code:
        raise _Refused(f"refused: {code_text(code)}")
    if (r_op, r_count, r_rid) != (op, count, rid):
        raise ProtocolError("reply does not match its request")


class _Peer:
    """A node's address and its idle connections (the client's state per node)."""

    def __init__(self, raw: bytes, pool_size: int, link: _Link) -> None:
        self.address = _parse_address(raw)
        self.link = link
        self._pool_size = pool_size
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> _Connection | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop_idle()

    def open(self, deadline: float) -> _Connection:
        return _Connection.open(self.address, self.link, deadline)


class TcpClient(PeerClient[_Peer]):
    # PeerClosed is a ConnectionError; _Refused: the node answered with an error code, or
    # the handshake cannot succeed (TLS on one side only, a node without the secret).
    native_errors = {**SOCKET_ERRORS, ProtocolError: TransportError, _Refused: TransportError}
    # A checksummed write checksums its payloads as they are sent and sends the records'
    # headers, made from those CRCs, after them in the same frame (one round trip, and no
    # pass over the payloads of its own for the CRCs: 64 x 4 MiB took 20 ms of it).
    streams_trailers = True
    # 64 x 4 MiB put over loopback: 3.4-3.5 GB/s on one connection, 4.3-4.5 on two (the
    # client's sending thread, copying and checksumming, was the bottleneck; the node's
    # receiving thread had a third of its time to spare).
    write_lanes = 2

    def __init__(
        self,
        config: TransportConfig,
        pool: int,
        tls: ssl.SSLContext | None,
        busy_poll: float,
        send_buffer: int = AUTO,
        read_lanes: int = 1,
    ) -> None:
        super().__init__(config)
        self._pool_size = pool
        self._link = _Link(
            key=config.token,
            tls=tls,
            busy_poll=busy_poll,
            send_buffer=send_buffer,
            read_lanes=read_lanes,
        )

    def describe(self, endpoint: NodeEndpoint) -> str:
        return f"tcp: node {endpoint.node} at {endpoint.address.decode(errors='replace')}"

    def open_peer(self, endpoint: NodeEndpoint) -> _Peer:
        return _Peer(endpoint.address, self._pool_size, self._link)

    def close_peer(self, peer: _Peer) -> None:
        peer.close()

    def read_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, Op.READ, batch)

    def write_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, Op.WRITE, batch)

    def read_small(self, node: int, segments: Sequence[Segment]) -> bool:
        """One frame, made here: no batch planned. The node checks each segment as it
        checks any (region, rkey, bounds) and lands only those it accepted; the buffers
        are the caller's, sized by it. Over tcp, planning and framing a batch in Python
        took ~20 us of a ~45 us image read: the lookup then outlasted the node's spin and
        paid its wake-up too (a lookup of 64 keys, 100-110 us here, takes 50-55 this way).
        """
        if len(segments) > MAX_COUNT:
            return super().read_small(node, segments)
        entry = self._entry(node)
        deadline = time.monotonic() + self.config.timeout
        with entry.boundary:
            return _on_connection(
                entry.state, lambda conn: conn.read_small(segments, deadline), deadline
            )


class _Frame:
    """Up to ``MAX_COUNT`` segments of a batch, their entry table, and (a read with CRCs)
    the spans that fall inside them, as ranges of the frame's segments; (a write with a
    trailer) where the trailer starts and what makes its buffers from the CRCs."""

    __slots__ = ("crc_spans", "segments", "table", "trailer", "trailer_start")

    def __init__(
        self,
        segments: Sequence[Segment],
        crc_spans: list[tuple[int, int]] | None,
        trailer: Callable[[list[int]], list[memoryview]] | None = None,
        trailer_start: int = 0,
    ) -> None:
        self.segments = segments
        self.table = _pack_table(segments)
        self.crc_spans = crc_spans
        self.trailer = trailer
        self.trailer_start = trailer_start


def _call(peer: _Peer, op: Op, batch: Batch) -> None:
    """Move a planned batch, in frames of at most ``MAX_COUNT`` segments.

    A read with ``crc_spans`` gets each span's CRC from the frame that lands it (frames
    are cut between spans); where a span is longer than a frame, the batch's CRCs are
    left to PeerClient (one more native call).
    """
    segments = batch.segments
    if op == Op.WRITE and batch.trailer is not None:
        _write_with_trailer(peer, batch)
        return
    spans = batch.crc_spans if op == Op.READ else None
    if op == Op.READ and peer.link.read_lanes > 1 and peer.link.tls is None:
        cuts = _lane_cuts(segments, spans, peer.link.read_lanes)
        if cuts is not None:
            _read_in_lanes(peer, batch, cuts)
            return
    bounds, framed = _frame_bounds(len(segments), spans)
    frames = []
    for (start, stop), frame_spans in zip(bounds, framed, strict=True):
        frames.append(_Frame(segments[start:stop], frame_spans))
    statuses, crcs = _exchange(peer, op, frames, batch.deadline)
    if spans is not None and framed[0] is not None:
        batch.crcs = crcs
    _refuse(batch, statuses)


def _lane_cuts(
    segments: Sequence[Segment], spans: list[tuple[int, int]] | None, lanes: int
) -> list[int] | None:
    """Where a read splits into up to ``lanes`` lanes of about equal bytes: each lane's
    first segment after the first's, never inside a span (each span's CRC comes from one
    lane). None for a read under ``READ_LANE_MIN`` bytes, one no cut splits, or one whose
    lanes would not each fit one frame."""
    sizes = [seg.buffer.nbytes for seg in segments]
    total = sum(sizes)
    if total < READ_LANE_MIN or len(sizes) < 2:
        return None
    starts = [a for a, _ in spans] if spans else []
    cuts: list[int] = []
    done = 0
    for cut, size in enumerate(sizes[:-1], start=1):
        done += size
        if len(cuts) == lanes - 1 or done * lanes < total * (len(cuts) + 1):
            continue
        k = bisect.bisect_right(starts, cut) - 1
        if spans and k >= 0 and starts[k] < cut < spans[k][1]:
            continue  # inside a span: the next cut
        cuts.append(cut)
    bounds = [0, *cuts, len(sizes)]
    if not cuts or any(b - a > MAX_COUNT for a, b in itertools.pairwise(bounds)):
        return None
    return cuts


def _read_in_lanes(peer: _Peer, batch: Batch, cuts: list[int]) -> None:
    """A large read as one frame per lane, at once, each on a connection of its own: the
    segments up to the first cut on the first, and so on; one native call."""
    segments, spans = batch.segments, batch.crc_spans
    bounds = [0, *cuts, len(segments)]
    framed: list[list[tuple[int, int]]] = [[] for _ in range(len(cuts) + 1)]
    owner = 0  # the lane of the span at hand
    for start, stop in spans or ():
        while stop > bounds[owner + 1]:
            owner += 1  # spans are in order, and none crosses a cut
        framed[owner].append((start - bounds[owner], stop - bounds[owner]))
    frames = [
        _Frame(segments[a:b], None if spans is None else framed[i])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]

    def run(conns: list[_Connection]) -> tuple[bytes, list[int]]:
        prepared = [conn.read_lane(f) for conn, f in zip(conns, frames, strict=True)]
        try:
            crcs = exchange_lanes([lane for lane, _ in prepared], batch.deadline)
        except PeerClosed:
            # A node's error reply is a bare header, then it closes: read what it says.
            for lane, rid in prepared:
                if HEADER.unpack_from(lane.reply)[0] == MAGIC:
                    _check_reply(lane.reply, Op.READ, rid, len(lane.payloads))
            raise
        statuses = b"".join(
            _statuses(lane.reply, Op.READ, rid, len(lane.payloads)) for lane, rid in prepared
        )
        return statuses, [crc for lane_crcs in crcs for crc in lane_crcs]

    statuses, crcs = _on_connections(peer, len(frames), run, batch.deadline)
    if spans is not None:
        batch.crcs = crcs
    _refuse(batch, statuses)


def _write_with_trailer(peer: _Peer, batch: Batch) -> None:
    """A checksummed write: in one frame, the payloads checksummed as they are sent; in
    several (more than ``MAX_COUNT`` segments), the CRCs first and the trailer filled in."""
    trailer = batch.trailer
    assert trailer is not None
    segments = batch.segments
    start = batch.trailer_start
    if len(segments) <= MAX_COUNT:
        frame = _Frame(segments, batch.crc_spans, trailer, start)
        statuses, crcs = _exchange(peer, Op.WRITE, [frame], batch.deadline)
    else:
        crcs = batch.checksum()
        tail = [
            Segment(seg.region, seg.rkey, seg.offset, buffer)
            for seg, buffer in zip(segments[start:], trailer(crcs), strict=True)
        ]
        whole = [*segments[:start], *tail]
        bounds, _ = _frame_bounds(len(whole), None)
        frames = [_Frame(whole[a:b], None) for a, b in bounds]
        statuses, _ = _exchange(peer, Op.WRITE, frames, batch.deadline)
    batch.crcs = crcs
    _refuse(batch, statuses)


def _refuse(batch: Batch, statuses: bytes) -> None:
    if statuses.count(_OK) != len(statuses):
        for i, status in enumerate(statuses):
            if status != _OK:
                batch.refuse(i, SegmentStatus(status).describe())


def _frame_bounds(
    count: int, spans: list[tuple[int, int]] | None
) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]] | None]]:
    """Where frames start and stop, and each frame's spans (None: no CRCs to take).

    A frame holds at most ``MAX_COUNT`` segments and ends where a span starts rather than
    inside one, so every span lies in one frame; a span too long for any frame drops the
    CRCs of the whole batch (None for every frame).
    """
    if count <= MAX_COUNT:
        return [(0, count)], [spans]
    starts = [a for a, _ in spans] if spans else []
    bounds: list[tuple[int, int]] = []
    whole = spans is not None
    start = 0
    while start < count:
        stop = min(start + MAX_COUNT, count)
        if spans and stop < count:
            k = bisect.bisect_right(starts, stop) - 1
            if k >= 0 and starts[k] < stop < spans[k][1]:
                if starts[k] > start:
                    stop = starts[k]
                else:
                    whole = False
        bounds.append((start, stop))
        start = stop
    if not whole or spans is None:
        return bounds, [None] * len(bounds)
    framed: list[list[tuple[int, int]] | None] = []
    k = 0
    for start, stop in bounds:
        mine: list[tuple[int, int]] = []
        while k < len(spans) and spans[k][1] <= stop:
            a, b = spans[k]
            mine.append((a - start, b - start))
            k += 1
        framed.append(mine)
    return bounds, framed


def _exchange(
    peer: _Peer, op: Op, frames: list[_Frame], deadline: float
) -> tuple[bytes, list[int]]:
    """Send every frame and collect the status tables, on a pooled or fresh connection."""

    def run(conn: _Connection) -> tuple[bytes, list[int]]:
        statuses: list[bytes] = []
        crcs: list[int] = []
        for frame in frames:
            frame_statuses, frame_crcs = conn.exchange(op, frame, deadline)
            statuses.append(frame_statuses)
            crcs += frame_crcs
        return b"".join(statuses), crcs

    return _on_connection(peer, run, deadline)


def _on_connection(peer: _Peer, work: Callable[[_Connection], T], deadline: float) -> T:
    """``work`` on a pooled connection, or on a fresh one: :func:`_on_connections` of one."""
    return _on_connections(peer, 1, lambda conns: work(conns[0]), deadline)


def _on_connections(
    peer: _Peer, count: int, work: Callable[[list[_Connection]], T], deadline: float
) -> T:
    """``work`` on ``count`` connections at once, pooled ones first, then fresh ones; they go
    back to the pool after it, or are closed if it raised (their stream states are
    unknown)."""
    conns: list[_Connection] = []
    pooled = False
    try:
        while len(conns) < count:
            conn = peer.take()
            pooled |= conn is not None
            conns.append(conn if conn is not None else peer.open(deadline))
    except BaseException:
        for conn in conns:
            peer.give_back(conn)
        raise
    if pooled:
        try:
            return _run_all(peer, conns, work)
        except ConnectionError:
            # The node closed or reset a pooled connection (it restarted, shut down, or
            # closed it for idling): its idle siblings may be as stale. Reads and writes
            # are idempotent, so one retry on fresh connections is safe.
            peer.drop_idle()
        conns = []
    try:
        while len(conns) < count:
            conns.append(peer.open(deadline))
    except BaseException:
        for conn in conns:
            conn.close()
        raise
    return _run_all(peer, conns, work)


def _run_all(peer: _Peer, conns: list[_Connection], work: Callable[[list[_Connection]], T]) -> T:
    try:
        result = work(conns)
    except BaseException:
        for conn in conns:
            conn.close()  # their stream states are unknown: never reuse them
        raise
    for conn in conns:
        peer.give_back(conn)
    return result


def _pack_table(segments: Sequence[Segment]) -> bytes:
    return b"".join([ENTRY.pack(s.region, s.rkey, s.offset, s.buffer.nbytes) for s in segments])
