"""The ``tcp`` client: pooled, authenticated connections that move planned batches.

A :class:`~kvfabric.spi.PeerClient` (peer table, segment checks and error mapping are
inherited). Per node it keeps a few idle connections (``tcp.pool``, default 8), so
concurrent calls do not serialize and the handshake is paid per connection, not per call.
A batch of more than ``MAX_COUNT`` segments goes as several frames on one connection.
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

import hmac
import socket
import ssl
import threading
import time
from collections.abc import Sequence

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
from kvfabric.transports.tcp_stream import Stream, TlsStream, Truncated
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
_STATUSES = frozenset(SegmentStatus)
# The client never drains: a status it did not ask for is a protocol error.
_NO_SCRATCH = memoryview(b"")


class _Refused(Exception):
    """The node refused this client (an error reply, or a handshake that cannot succeed)."""


def _tune(sock: socket.socket) -> None:
    # Each request and reply is written whole and then waited on: Nagle would only hold back
    # its last partial packet for an ACK. SO_SNDBUF/SO_RCVBUF are deliberately left alone:
    # setting them turns off the kernel's window autotuning (which grows to tcp_rmem's
    # maximum, 32 MiB here) and is clamped to net.core.rmem_max (208 KiB on many hosts); on
    # loopback fixed 1-16 MiB buffers measured no faster than autotuning.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _parse_address(address: bytes) -> tuple[str, int]:
    host, sep, port = address.decode(errors="replace").rpartition(":")
    if not sep or not port.isdigit():
        raise ProtocolError(f"tcp: not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


class _Connection:
    """One authenticated stream to a node; used by one call at a time (the pool hands it out)."""

    __slots__ = ("_next_id", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._next_id = 1

    @classmethod
    def open(
        cls, address: tuple[str, int], key: bytes, tls: ssl.SSLContext | None, deadline: float
    ) -> _Connection:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed before connecting")
        sock = socket.create_connection(address, timeout=remaining)
        try:
            _tune(sock)
            stream = _handshake(sock, address[0], key, tls, deadline)
        except BaseException:
            sock.close()
            raise
        return cls(stream)

    def exchange(self, op: Op, table: bytes, segments: Sequence[Segment], deadline: float) -> bytes:
        """One request/reply for up to ``MAX_COUNT`` segments; returns the status table."""
        rid = self._next_id
        self._next_id += 1
        head = pack_header(op, 0, len(segments), rid) + table
        if op == Op.WRITE:
            self.stream.send_all([head, *(seg.buffer for seg in segments)], deadline)
        else:
            self.stream.send_all([head], deadline)
        statuses = self._reply_statuses(op, rid, len(segments), deadline)
        if op == Op.READ:
            landing = (seg.buffer for seg, ok in zip(segments, statuses, strict=True) if ok == _OK)
            self.stream.recv_targets(landing, _NO_SCRATCH, deadline)
        return statuses

    def _reply_statuses(self, op: Op, rid: int, count: int, deadline: float) -> bytes:
        """Read a reply header and its status table, checking both against the request."""
        buf = bytearray(HEADER.size + count)
        view = memoryview(buf)
        got = 0
        # Header and table usually arrive together: one recv when they do. The header is
        # checked first because an error reply has no table (and the node then closes).
        while got < len(buf):
            # The first receive waits for the node to answer; the rest take what is left.
            receive = self.stream.recv_some if got else self.stream.recv_awaited
            n = receive(view[got:], deadline)
            if n == 0:
                raise Truncated("node closed the connection")
            got += n
            if got >= HEADER.size and got - n < HEADER.size:
                _check_reply(buf, op, rid, count)
        statuses = bytes(view[HEADER.size :])
        if not set(statuses) <= _STATUSES:
            raise ProtocolError("unknown segment status in reply")
        return statuses

    def close(self) -> None:
        self.stream.close()


def _handshake(
    sock: socket.socket, host: str, key: bytes, tls: ssl.SSLContext | None, deadline: float
) -> Stream:
    """Run the client's side of the handshake on a fresh connection; the stream to use."""
    stream = Stream(sock)
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

    def __init__(self, raw: bytes, pool_size: int, key: bytes, tls: ssl.SSLContext | None) -> None:
        self.address = _parse_address(raw)
        self.key = key
        self.tls = tls
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
        return _Connection.open(self.address, self.key, self.tls, deadline)


class TcpClient(PeerClient[_Peer]):
    # Truncated is a ConnectionError; _Refused: the node answered with an error code, or
    # the handshake cannot succeed (TLS on one side only, a node without the secret).
    native_errors = {**SOCKET_ERRORS, ProtocolError: TransportError, _Refused: TransportError}

    def __init__(self, config: TransportConfig, pool: int, tls: ssl.SSLContext | None) -> None:
        super().__init__(config)
        self._pool_size = pool
        self._tls = tls

    def describe(self, endpoint: NodeEndpoint) -> str:
        return f"tcp: node {endpoint.node} at {endpoint.address.decode(errors='replace')}"

    def open_peer(self, endpoint: NodeEndpoint) -> _Peer:
        return _Peer(endpoint.address, self._pool_size, self.config.token, self._tls)

    def close_peer(self, peer: _Peer) -> None:
        peer.close()

    def read_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, Op.READ, batch)

    def write_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, Op.WRITE, batch)


def _call(peer: _Peer, op: Op, batch: Batch) -> None:
    """Move a planned batch, in frames of at most ``MAX_COUNT`` segments."""
    segments = batch.segments
    frames = [segments[i : i + MAX_COUNT] for i in range(0, len(segments), MAX_COUNT)]
    tables = [_pack_table(frame) for frame in frames]
    statuses = _exchange(peer, op, tables, frames, batch.deadline)
    if statuses.count(_OK) != len(statuses):
        for i, status in enumerate(statuses):
            if status != _OK:
                batch.refuse(i, SegmentStatus(status).describe())


def _exchange(
    peer: _Peer, op: Op, tables: list[bytes], frames: list[list[Segment]], deadline: float
) -> bytes:
    """Send every frame and collect the status tables, on a pooled or fresh connection."""
    conn = peer.take()
    if conn is not None:
        try:
            return _run(peer, conn, op, tables, frames, deadline)
        except ConnectionError:
            # The node closed or reset a pooled connection (it restarted, shut down, or
            # closed it for idling): its idle siblings may be as stale. Reads and writes
            # are idempotent, so one retry on a fresh connection is safe.
            peer.drop_idle()
    return _run(peer, peer.open(deadline), op, tables, frames, deadline)


def _run(
    peer: _Peer,
    conn: _Connection,
    op: Op,
    tables: list[bytes],
    frames: list[list[Segment]],
    deadline: float,
) -> bytes:
    try:
        statuses = b"".join(
            conn.exchange(op, table, frame, deadline)
            for table, frame in zip(tables, frames, strict=True)
        )
    except BaseException:
        conn.close()  # its stream state is unknown: never reuse it
        raise
    peer.give_back(conn)
    return statuses


def _pack_table(segments: Sequence[Segment]) -> bytes:
    return b"".join([ENTRY.pack(s.region, s.rkey, s.offset, s.buffer.nbytes) for s in segments])
