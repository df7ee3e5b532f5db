"""One authenticated connection from a ``tcp`` client to a node, and the frames it carries.

Opening a connection runs the handshake (:mod:`kvfabric.transports.tcp.auth`): the node's
greeting, TLS when the node offers it (and only then: a client with ``tcp.tls`` set refuses
a node that does not offer it, and one without refuses a node that does), the client's
proof, and the node's proof checked in turn.

Over plain tcp a frame is one native call (``kvfabric._runtime.native.request_reply``): the
request (a write's payloads in it), the reply's status table, then a read's accepted
payloads, each read record's CRC32C taken as its bytes land, with the GIL released once. A
checksummed write is two (the sources' CRCs in one native call first: the records' headers,
made from them, travel in the same frame). Beside a busy Python thread each return of the
GIL waits out the switch interval, so the count is what matters. With TLS, Python's ``ssl``
moves the bytes and takes the GIL back per call: about one per 16 KiB TLS record received,
one per send.
"""

from __future__ import annotations

import hmac
import socket
import ssl
import time
from collections.abc import Callable, Sequence

import attrs

from kvfabric.errors import ProtocolError
from kvfabric.spi import Segment, SegmentStatus
from kvfabric.transports.tcp.auth import (
    FLAG_TLS,
    GREETING_SIZE,
    PROOF_SIZE,
    client_proof,
    new_nonce,
    server_proof,
    unpack_greeting,
)
from kvfabric.transports.tcp.stream import HOLD_GIL, Lane, PeerClosed, Stream, TlsStream
from kvfabric.transports.tcp.tuning import tune
from kvfabric.transports.tcp.wire import (
    ENTRY,
    HEADER,
    MAGIC,
    VERSION,
    Op,
    code_text,
    pack_header,
)

__all__ = ["Connection", "Frame", "Link", "Refused", "check_reply", "pack_table", "reply_statuses"]

_OK = SegmentStatus.OK
_MAX_STATUS = max(SegmentStatus)


class Refused(Exception):
    """The node refused this client (an error reply, or a handshake that cannot succeed)."""


@attrs.frozen(kw_only=True)
class Link:
    """How this client's connections are made: the secret, TLS, the reply spin, the send
    buffer (:mod:`kvfabric.transports.tcp.tuning`), the lanes of a large read."""

    key: bytes
    tls: ssl.SSLContext | None
    busy_poll: float
    send_buffer: int
    read_lanes: int = 1


class Frame:
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
        self.table = pack_table(segments)
        self.crc_spans = crc_spans
        self.trailer = trailer
        self.trailer_start = trailer_start


class Connection:
    """One authenticated stream to a node; used by one call at a time (the pool hands it out)."""

    __slots__ = ("_next_id", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._next_id = 1

    @classmethod
    def open(cls, address: tuple[str, int], link: Link, deadline: float) -> Connection:
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

    def exchange(self, op: Op, frame: Frame, deadline: float) -> tuple[bytes, list[int]]:
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
        head = pack_header(Op.READ, 0, count, rid) + pack_table(segments)
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
                check_reply(reply, op, rid, count)
            raise
        return reply_statuses(reply, op, rid, count), crcs

    def read_lane(self, frame: Frame) -> tuple[Lane, int]:
        """``frame`` as a read for :func:`~kvfabric.transports.tcp.stream.exchange_lanes`,
        and its request id."""
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


def _handshake(sock: socket.socket, host: str, link: Link, deadline: float) -> Stream:
    """Run the client's side of the handshake on a fresh connection; the stream to use."""
    key, tls = link.key, link.tls
    stream = Stream(sock, link.busy_poll)
    greeting = memoryview(bytearray(HEADER.size + GREETING_SIZE))
    stream.recv_exact(greeting, deadline)
    check_reply(greeting, Op.GREETING, 0, GREETING_SIZE)
    flags, server_nonce = unpack_greeting(bytes(greeting[HEADER.size :]))
    offered = bool(flags & FLAG_TLS)
    if offered != (tls is not None):
        if offered:
            raise Refused("the node requires TLS: set tcp.tls=true (and tcp.tls_ca)")
        raise Refused("the node does not offer TLS and tcp.tls=true: refusing a plain link")
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
    check_reply(reply, Op.HELLO, 0, PROOF_SIZE)
    stream.recv_exact(reply[HEADER.size :], deadline)
    expected = server_proof(key, flags, server_nonce, client_nonce)
    if not hmac.compare_digest(bytes(reply[HEADER.size :]), expected):
        raise Refused("the node could not prove it holds the secret (a different secret?)")
    return stream


def reply_statuses(reply: memoryview, op: Op, rid: int, count: int) -> bytes:
    """The status table of a whole reply to frame ``rid`` (``count`` segments)."""
    check_reply(reply, op, rid, count)
    table = bytes(reply[HEADER.size :])
    # A status the client does not know also made the native call skip that payload:
    # the stream is out of step, and the connection is closed.
    if table and max(table) > _MAX_STATUS:
        raise ProtocolError("unknown segment status in reply")
    return table


def check_reply(buf: bytearray | memoryview, op: Op, rid: int, count: int) -> None:
    magic, version, r_op, code, r_count, r_rid = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError("the peer does not speak the kvfabric tcp protocol")
    if version != VERSION:
        raise ProtocolError(f"the node speaks tcp wire version {version}; this client {VERSION}")
    if code:
        raise Refused(f"refused: {code_text(code)}")
    if (r_op, r_count, r_rid) != (op, count, rid):
        raise ProtocolError("reply does not match its request")


def pack_table(segments: Sequence[Segment]) -> bytes:
    return b"".join([ENTRY.pack(s.region, s.rkey, s.offset, s.buffer.nbytes) for s in segments])
