"""The ``tcp`` transport: one-sided reads and writes emulated by threads on the data node.

The fallback for nodes no RDMA fabric reaches. A thread per connection on the data node
serves each batch against (region, rkey, offset, length) with no knowledge of the index:
every segment is checked again there (``kvfabric.spi.RegionTable``, the rules the client
already applied: a client is not trusted), and a refused segment moves no bytes. Bytes go
straight between the socket and region memory on the node (``sendmsg`` gathers region
slices, ``recvmsg_into`` scatters into them) and between the socket and the caller's
buffers on the client (the same two calls): no copies beyond the kernel's own, and up to
1024 segments per system call, so 64-byte record headers cost no syscall of their own.

The client (a ``kvfabric.spi.PeerClient``: peer table, segment checks and error mapping
are inherited) keeps a few idle connections per node (``tcp.pool``, default 8), so
concurrent calls do not serialize; a batch of more than 65536 segments goes as several
frames on one connection. Every call is bounded by ``config.timeout`` as a whole; a
connection that failed or timed out is closed, never reused. A pooled connection the node
closed (it restarted or shut down) is retried once on a fresh one: reads and writes are
idempotent.

Wire protocol, version 1 (little-endian ``struct``, never pickle). A connection carries
one request and its reply at a time::

    header   magic b"KVFT" | version u8 | op u8 | code u16 | count u32 | request id u64
    request  READ:  header, count x entry
             WRITE: header, count x entry, then every segment's bytes in entry order
             HELLO: header, then count bytes of token
    entry    region u32 | rkey u64 | offset u64 | length u64
    reply    header (the request's op and id, code 0), then for READ/WRITE count x status u8
             (``kvfabric.spi.SegmentStatus``: 0 accepted, 1 unknown region, 2 bad rkey,
             3 out of bounds), then for READ the
             bytes of every accepted segment in entry order

A request's ``code`` is 0. A frame the server will not serve (bad magic, version, op or
code; more than 65536 entries; lengths adding up to more than 1 TiB; a missing or wrong
token) gets an error reply (header with count 0 and a nonzero code: 1 malformed, 2 too
large, 3 token required, 4 wrong token) and the connection is closed; other connections are
not affected. When the server has a token, the first frame of every connection must be a
HELLO carrying it (at most 4096 bytes); its reply is a bare header.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvfabric.errors import ProtocolError, TransportError
from kvfabric.spi import (
    SOCKET_ERRORS,
    Batch,
    Capabilities,
    Counters,
    MemoryKind,
    NodeEndpoint,
    OptionSpec,
    PeerClient,
    Region,
    RegionHandle,
    RegionTable,
    Registry,
    Segment,
    SegmentStatus,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
    byte_view,
    hookimpl,
    parse_duration,
)

__all__ = ["TcpTransport"]

log = logging.getLogger(__name__)

_MAGIC = b"KVFT"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHIQ")
_ENTRY = struct.Struct("<IQQQ")
_MAX_COUNT = 65536
_MAX_BATCH_BYTES = 1 << 40
_MAX_TOKEN = 4096
# Refused write payloads are read into this and dropped, so the stream stays in sync.
_SCRATCH = 256 * 1024
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):  # pragma: no cover - not Linux
    _IOV_MAX = 16


class _Op(enum.IntEnum):
    READ = 1
    WRITE = 2
    HELLO = 3


class _Code(enum.IntEnum):
    """Per frame, in a reply header; anything but OK is followed by the server closing."""

    OK = 0
    BAD_FRAME = 1
    TOO_LARGE = 2
    AUTH_REQUIRED = 3
    AUTH_FAILED = 4


# Per segment, in a reply's status table: kvfabric.spi.SegmentStatus, the checks every
# transport applies, sent as one byte.
_OK = SegmentStatus.OK
_STATUSES = frozenset(SegmentStatus)
_CODE_TEXT = {
    _Code.BAD_FRAME: "malformed frame",
    _Code.TOO_LARGE: "batch too large",
    _Code.AUTH_REQUIRED: "a token is required",
    _Code.AUTH_FAILED: "wrong token",
}
_OPS = frozenset(op.value for op in _Op)
# A request's table, unpacked: (region, rkey, offset, length) per segment.
_Entries = list[tuple[int, int, int, int]]

_SERVER_COUNTERS = (
    "connections",
    "requests",
    "segments_read",
    "segments_written",
    "bytes_read",
    "bytes_written",
    "refused_segments",
    "bad_frames",
    "auth_failures",
    "stalled_frames",
    "connections_refused",
)


class _Truncated(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


class _Refused(Exception):
    """The node answered a frame with an error code (and closes the connection)."""


# -- socket helpers shared by both sides ---------------------------------------------------


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next socket call by what is left of the deadline (None: block)."""
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)


def _recv_exact(
    sock: socket.socket, buf: bytearray, deadline: float | None = None, *, eof_ok: bool = False
) -> bool:
    """Fill ``buf``; False if the peer closed cleanly before its first byte and ``eof_ok``."""
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        _arm(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return False
            raise _Truncated(f"connection closed after {got} of {len(buf)} bytes")
        got += n
    return True


def _recv_all(
    sock: socket.socket, buffers: Iterable[memoryview], deadline: float | None = None
) -> None:
    """Fill every buffer in order, up to ``_IOV_MAX`` of them per ``recvmsg_into``.

    ``buffers`` may be lazy (the server drains refused writes through repeated scratch
    views), so at most ``_IOV_MAX`` views are alive at a time.
    """
    source = iter(buffers)
    pending: list[memoryview] = []
    while True:
        for buf in source:
            if buf.nbytes:
                pending.append(byte_view(buf))
                if len(pending) == _IOV_MAX:
                    break
        if not pending:
            return
        _arm(sock, deadline)
        n = sock.recvmsg_into(pending)[0]
        if n == 0:
            raise _Truncated("connection closed in the middle of a payload")
        _advance(pending, n)


def _send_all(sock: socket.socket, buffers: list[Any], deadline: float | None = None) -> None:
    """Send every buffer in order, gathering up to ``_IOV_MAX`` per ``sendmsg``."""
    pending = [view for view in map(byte_view, buffers) if view.nbytes]
    while pending:
        _arm(sock, deadline)
        _advance(pending, sock.sendmsg(pending[:_IOV_MAX]))


def _advance(pending: list[memoryview], n: int) -> None:
    """Drop the ``n`` bytes a partial scatter/gather call moved from the front of ``pending``."""
    done = 0
    while n and n >= pending[done].nbytes:
        n -= pending[done].nbytes
        done += 1
    del pending[:done]
    if n:
        pending[0] = pending[0][n:]


def _tune(sock: socket.socket) -> None:
    # Each request and reply is written whole and then waited on: Nagle would only hold back
    # its last partial packet for an ACK. SO_SNDBUF/SO_RCVBUF are deliberately left alone:
    # setting them turns off the kernel's window autotuning (which grows to tcp_rmem's
    # maximum, 32 MiB here) and is clamped to net.core.rmem_max (208 KiB on many hosts); on
    # loopback fixed 1-16 MiB buffers measured no faster than autotuning.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- server -------------------------------------------------------------------------------


class _TcpServer(TransportServer):
    def __init__(self, config: TransportConfig) -> None:
        self._token = config.token
        # Bounds on what one peer can hold: a thread per connection, so a cap on them; and a
        # frame once started must keep arriving, so a half-sent one cannot pin a thread.
        options = TcpTransport.parse_options(config.options)
        self._max_connections = int(options["max_connections"])
        self._frame_timeout = float(options["frame_timeout"])
        self._regions = RegionTable()
        self._counters = Counters(_SERVER_COUNTERS)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self._listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise TransportError(f"tcp: cannot listen on {config.host}:{config.port}") from exc
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(128)
        except OSError as exc:
            self._listener.close()
            raise TransportError(f"tcp: cannot listen on {config.host}:{config.port}") from exc
        host, port = self._listener.getsockname()[:2]
        # A wildcard bind (0.0.0.0) is not an address a client can use: advertise the one
        # the operator names instead.
        host = config.advertise or host
        self._address = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="kvfabric-tcp-accept", daemon=True
        )
        self._acceptor.start()

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, region: Region) -> RegionHandle:
        handle = RegionHandle(region=region.id, rkey=region.rkey, size=region.size)
        self._regions.add(handle, byte_view(region.view))
        return handle

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
            threads = [self._acceptor, *self._threads]
        # shutdown() (unlike close()) wakes a thread blocked in accept() or recv() on Linux;
        # each thread then closes its own socket.
        for sock in (self._listener, *connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 2.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        self._regions.clear()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors or an aborted handshake: retry
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="kvfabric-tcp-conn", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._connections) >= self._max_connections:
                    self._counters.add("connections_refused")  # before the peer sees EOF
                    conn.close()
                    continue
                self._connections.add(conn)
                self._threads.add(thread)
            self._counters.add("connections")
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _tune(conn)
            self._serve_frames(conn)
        except _Truncated:
            self._counters.add("bad_frames")
        except TimeoutError:
            self._counters.add("stalled_frames")
        except OSError:
            pass  # the peer went away, or close() shut the socket down
        except Exception:
            log.exception("kvfabric tcp: connection handler failed; closing the connection")
        finally:
            conn.close()
            with self._lock:
                self._connections.discard(conn)
                self._threads.discard(threading.current_thread())

    def _serve_frames(self, conn: socket.socket) -> None:
        authenticated = not self._token
        header = bytearray(_HEADER.size)
        scratch: memoryview | None = None
        while True:
            conn.settimeout(None)  # an idle pooled connection may wait for its next frame
            if not _recv_exact(conn, header, eof_ok=True):
                return
            conn.settimeout(self._frame_timeout)  # the rest of the frame must keep coming
            magic, version, op, code, count, rid = _HEADER.unpack(header)
            if magic != _MAGIC or version != _VERSION or code or op not in _OPS:
                self._refuse(conn, 0, rid, _Code.BAD_FRAME, "bad_frames")
                return
            if op == _Op.HELLO:
                if not self._hello(conn, count, rid):
                    return
                authenticated = True
                continue
            if not authenticated:
                self._refuse(conn, op, rid, _Code.AUTH_REQUIRED, "auth_failures")
                return
            if count > _MAX_COUNT:
                self._refuse(conn, op, rid, _Code.TOO_LARGE, "bad_frames")
                return
            table = bytearray(count * _ENTRY.size)
            _recv_exact(conn, table)
            entries = list(_ENTRY.iter_unpack(table))
            if sum(entry[3] for entry in entries) > _MAX_BATCH_BYTES:
                self._refuse(conn, op, rid, _Code.TOO_LARGE, "bad_frames")
                return
            if op == _Op.READ:
                self._serve_read(conn, rid, entries)
            else:
                if scratch is None:
                    scratch = memoryview(bytearray(_SCRATCH))
                self._serve_write(conn, rid, entries, scratch)

    def _hello(self, conn: socket.socket, length: int, rid: int) -> bool:
        if length > _MAX_TOKEN:
            self._refuse(conn, _Op.HELLO, rid, _Code.BAD_FRAME, "bad_frames")
            return False
        token = bytearray(length)
        _recv_exact(conn, token)
        if self._token and not hmac.compare_digest(bytes(token), self._token):
            self._refuse(conn, _Op.HELLO, rid, _Code.AUTH_FAILED, "auth_failures")
            return False
        conn.sendall(_HEADER.pack(_MAGIC, _VERSION, _Op.HELLO, _Code.OK, 0, rid))
        return True

    def _refuse(self, conn: socket.socket, op: int, rid: int, code: _Code, counter: str) -> None:
        """Count a frame we will not serve and tell the peer why; the caller then closes."""
        self._counters.add(counter)
        with contextlib.suppress(OSError):
            conn.sendall(_HEADER.pack(_MAGIC, _VERSION, op, code, 0, rid))

    def _serve_read(self, conn: socket.socket, rid: int, entries: _Entries) -> None:
        statuses, planned = self._regions.check_all(entries)
        views = [view for view in planned if view is not None]
        # Counted before replying, so a client holding its reply sees the request counted.
        self._counters.update(
            requests=1,
            segments_read=len(views),
            bytes_read=sum(view.nbytes for view in views),
            refused_segments=len(entries) - len(views),
        )
        head = _HEADER.pack(_MAGIC, _VERSION, _Op.READ, _Code.OK, len(entries), rid)
        _send_all(conn, [head + statuses, *views])

    def _serve_write(
        self,
        conn: socket.socket,
        rid: int,
        entries: _Entries,
        scratch: memoryview,
    ) -> None:
        statuses, planned = self._regions.check_all(entries)
        lengths = [entry[3] for entry in entries]
        _recv_all(conn, _write_targets(planned, lengths, scratch))
        written = [view.nbytes for view in planned if view is not None]
        self._counters.update(
            requests=1,
            segments_written=len(written),
            bytes_written=sum(written),
            refused_segments=len(entries) - len(written),
        )
        head = _HEADER.pack(_MAGIC, _VERSION, _Op.WRITE, _Code.OK, len(entries), rid)
        conn.sendall(head + statuses)


def _write_targets(
    views: list[memoryview | None], lengths: list[int], scratch: memoryview
) -> Iterator[memoryview]:
    """Where each write payload lands: region memory, or scratch views for a refused one."""
    for view, length in zip(views, lengths, strict=True):
        if view is not None:
            yield view
            continue
        while length > 0:
            chunk = min(length, scratch.nbytes)
            yield scratch[:chunk]
            length -= chunk


# -- client -------------------------------------------------------------------------------


def _parse_address(address: bytes) -> tuple[str, int]:
    host, sep, port = address.decode(errors="replace").rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"tcp: not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


def _reply_error(code: int) -> str:
    try:
        return _CODE_TEXT[_Code(code)]
    except (ValueError, KeyError):
        return f"error code {code}"


class _Connection:
    """One socket to a node; used by one call at a time (the pool hands it out)."""

    __slots__ = ("_next_id", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._next_id = 1

    @classmethod
    def open(cls, address: tuple[str, int], token: bytes, deadline: float) -> _Connection:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed before connecting")
        sock = socket.create_connection(address, timeout=remaining)
        conn = cls(sock)
        try:
            _tune(sock)
            if token:
                head = _HEADER.pack(_MAGIC, _VERSION, _Op.HELLO, 0, len(token), 0)
                _send_all(sock, [head + token], deadline)
                conn._reply_statuses(_Op.HELLO, 0, 0, deadline)
        except BaseException:
            sock.close()
            raise
        return conn

    def exchange(
        self, op: _Op, table: bytes, segments: Sequence[Segment], deadline: float
    ) -> bytes:
        """One request/reply for up to ``_MAX_COUNT`` segments; returns the status table."""
        rid = self._next_id
        self._next_id += 1
        head = _HEADER.pack(_MAGIC, _VERSION, op, 0, len(segments), rid) + table
        if op == _Op.WRITE:
            _send_all(self.sock, [head, *(seg.buffer for seg in segments)], deadline)
        else:
            _send_all(self.sock, [head], deadline)
        statuses = self._reply_statuses(op, rid, len(segments), deadline)
        if op == _Op.READ:
            landing = (seg.buffer for seg, ok in zip(segments, statuses, strict=True) if ok == _OK)
            _recv_all(self.sock, landing, deadline)
        return statuses

    def _reply_statuses(self, op: _Op, rid: int, count: int, deadline: float) -> bytes:
        """Read a reply header and its status table, checking both against the request."""
        buf = bytearray(_HEADER.size + count)
        view = memoryview(buf)
        got = 0
        # Header and table usually arrive together: one recv when they do. The header is
        # checked first because an error reply has no table (and the server then closes).
        while got < len(buf):
            _arm(self.sock, deadline)
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise _Truncated("node closed the connection")
            got += n
            if got >= _HEADER.size and got - n < _HEADER.size:
                self._check_header(buf, op, rid, count)
        statuses = bytes(view[_HEADER.size :])
        if not set(statuses) <= _STATUSES:
            raise ProtocolError("unknown segment status in reply")
        return statuses

    @staticmethod
    def _check_header(buf: bytearray, op: _Op, rid: int, count: int) -> None:
        magic, version, r_op, code, r_count, r_rid = _HEADER.unpack_from(buf)
        if magic != _MAGIC or version != _VERSION:
            raise ProtocolError("reply is not a kvfabric tcp frame of version 1")
        if code:
            raise _Refused(f"refused the request: {_reply_error(code)}")
        if (r_op, r_count, r_rid) != (op, count, rid):
            raise ProtocolError("reply does not match its request")

    def close(self) -> None:
        self.sock.close()


class _Peer:
    """A node's address and its idle connections (the client's state per node)."""

    def __init__(self, raw: bytes, pool_size: int, token: bytes) -> None:
        self.address = _parse_address(raw)
        self.token = token
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


class _TcpClient(PeerClient[_Peer]):
    # _Truncated is a ConnectionError; _Refused: the node answered with an error code.
    native_errors = {**SOCKET_ERRORS, ProtocolError: TransportError, _Refused: TransportError}

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._pool_size = int(TcpTransport.parse_options(config.options)["pool"])

    def describe(self, endpoint: NodeEndpoint) -> str:
        return f"tcp: node {endpoint.node} at {endpoint.address.decode(errors='replace')}"

    def open_peer(self, endpoint: NodeEndpoint) -> _Peer:
        return _Peer(endpoint.address, self._pool_size, self.config.token)

    def close_peer(self, peer: _Peer) -> None:
        peer.close()

    def read_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, _Op.READ, batch)

    def write_segments(self, peer: _Peer, batch: Batch) -> None:
        _call(peer, _Op.WRITE, batch)


def _call(peer: _Peer, op: _Op, batch: Batch) -> None:
    """Move a planned batch, in frames of at most ``_MAX_COUNT`` segments."""
    segments = batch.segments
    frames = [segments[i : i + _MAX_COUNT] for i in range(0, len(segments), _MAX_COUNT)]
    tables = [_pack_table(frame) for frame in frames]
    statuses = _exchange(peer, op, tables, frames, batch.deadline)
    if statuses.count(_OK) != len(statuses):
        for i, status in enumerate(statuses):
            if status != _OK:
                batch.refuse(i, SegmentStatus(status).describe())


def _exchange(
    peer: _Peer, op: _Op, tables: list[bytes], frames: list[list[Segment]], deadline: float
) -> bytes:
    """Send every frame and collect the status tables, on a pooled or fresh connection."""
    conn = peer.take()
    if conn is not None:
        try:
            return _run(peer, conn, op, tables, frames, deadline)
        except ConnectionError:
            # The node closed or reset a pooled connection (it restarted, or shut down):
            # its idle siblings are as stale. Reads and writes are idempotent, so one
            # retry on a fresh connection is safe.
            peer.drop_idle()
    conn = _Connection.open(peer.address, peer.token, deadline)
    return _run(peer, conn, op, tables, frames, deadline)


def _run(
    peer: _Peer,
    conn: _Connection,
    op: _Op,
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
    return b"".join([_ENTRY.pack(s.region, s.rkey, s.offset, s.buffer.nbytes) for s in segments])


class TcpTransport(Transport):
    name = "tcp"
    # Any host; the fallback where no one-sided transport reaches.
    preference = 20
    options = (
        OptionSpec(name="pool", parse=int, default=8, help="idle connections kept per node"),
        OptionSpec(
            name="max_connections",
            parse=int,
            default=1024,
            help="connections the node serves at once (a thread each)",
        ),
        OptionSpec(
            name="frame_timeout",
            parse=parse_duration,
            default=30.0,
            help="a frame, once started, must arrive within this",
        ),
    )
    capabilities = Capabilities(
        one_sided=False,
        local_only=False,
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.FILE}),
    )

    @classmethod
    def create_server(cls, config: TransportConfig) -> TransportServer:
        return _TcpServer(config)

    @classmethod
    def create_client(cls, config: TransportConfig) -> TransportClient:
        return _TcpClient(config)


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(TcpTransport.name, TcpTransport)
