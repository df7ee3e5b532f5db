"""``example``: a minimal kvfabric transport, written against ``kvfabric.spi`` only.

The worked example of docs/writing-a-transport.md. It is small but real: bytes move over a
TCP socket, the data node's thread serving each request (two-sided). What it writes:

- the class's data: ``name``, ``capabilities``, ``preference`` (above ``tcp``, so a client
  picks it for a node serving both) and one option, ``example.max_segments``;
- the server: a listener, a thread per connection, and a ``RegionTable`` that checks every
  request with the rules clients apply;
- the client's primitives: ``open_peer``/``close_peer`` (one connection per node) and
  ``read_segments``/``write_segments`` for a batch ``PeerClient`` has already planned.

Everything else (the peer table, the checks before bytes move, mapping ``OSError`` and
``TimeoutError`` to kvfabric's errors, the call's deadline) is inherited.

Wire format (little-endian): a request is ``op u8 | count u32``, then ``count`` entries of
``region u32 | rkey u64 | offset u64 | length u64``, then for a write each segment's bytes.
The reply is ``count`` status bytes (``kvfabric.spi.SegmentStatus``), then for a read the
bytes of each accepted segment. There is no authentication: the node refuses to start when
given a token (see the ``tcp`` transport for a handshake that checks one).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

from kvfabric.errors import ConfigError, NotSupportedError
from kvfabric.spi import (
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
)

__all__ = ["ExampleTransport"]

_READ, _WRITE = 1, 2
_REQUEST = struct.Struct("<BI")
_ENTRY = struct.Struct("<IQQQ")
# What a server accepts in one request; more is a client it does not understand.
_MAX_SEGMENTS = 65536
_MAX_BYTES = 1 << 32
_DRAIN = 64 * 1024
_COUNTERS = (
    "read_requests",
    "write_requests",
    "segments_read",
    "segments_written",
    "bytes_read",
    "bytes_written",
)


def _positive_int(text: str) -> int:
    value = int(text)
    if not 0 < value <= _MAX_SEGMENTS:
        raise ConfigError(f"must be between 1 and {_MAX_SEGMENTS}")
    return value


class ExampleTransport(Transport):
    name = "example"
    # Above tcp (20), below shm (30): chosen over tcp for a node that serves both.
    preference = 25
    capabilities = Capabilities(
        one_sided=False,
        local_only=False,
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.FILE}),
    )
    options = (
        OptionSpec(
            name="max_segments",
            parse=_positive_int,
            default=1024,
            help="segments per request; a larger batch goes as several requests",
        ),
    )

    @classmethod
    def create_server(cls, config: TransportConfig) -> TransportServer:
        return _Server(config)

    @classmethod
    def create_client(cls, config: TransportConfig) -> TransportClient:
        return _Client(config)


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(ExampleTransport.name, ExampleTransport)


# -- both sides ---------------------------------------------------------------------------


def _recv_into(
    sock: socket.socket, view: memoryview, deadline: float | None = None, *, eof_ok: bool = False
) -> bool:
    """Fill ``view``; False if the peer closed before sending anything and ``eof_ok``."""
    got = 0
    while got < view.nbytes:
        if deadline is not None:
            sock.settimeout(_remaining(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionResetError("the connection closed in the middle of a message")
        got += n
    return True


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's timeout passed")
    return left


# -- server (on the data node) --------------------------------------------------------------


class _Server(TransportServer):
    def __init__(self, config: TransportConfig) -> None:
        if config.token:
            raise NotSupportedError("example: no authentication; run it without a secret")
        self._regions = RegionTable()
        self._counters = Counters(_COUNTERS)
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._listener = socket.create_server((config.host, config.port))
        host, port = self._listener.getsockname()[:2]
        self._address = f"{config.advertise or host}:{port}".encode()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
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
            self._closed = True
            connections = dict(self._connections)
        # shutdown() wakes a thread blocked in accept() or recv(); each then exits, and no
        # thread touches region memory once close() returns (the node frees it next).
        for sock in (self._listener, *connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in (self._acceptor, *connections.values()):
            thread.join(5.0)
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # close() shut the listener down
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while self._serve_one(conn):
                pass
        except OSError:
            pass  # the client went away, or close() shut the connection down
        finally:
            conn.close()
            with self._lock:
                self._connections.pop(conn, None)

    def _serve_one(self, conn: socket.socket) -> bool:
        """Serve one request; False when the client hung up or sent what we do not serve."""
        request = bytearray(_REQUEST.size)
        if not _recv_into(conn, memoryview(request), eof_ok=True):
            return False
        op, count = _REQUEST.unpack(request)
        if op not in (_READ, _WRITE) or count > _MAX_SEGMENTS:
            return False
        table = bytearray(count * _ENTRY.size)
        _recv_into(conn, memoryview(table))
        entries = list(_ENTRY.iter_unpack(table))
        if sum(entry[3] for entry in entries) > _MAX_BYTES:
            return False
        # The same checks the client made: a client is not trusted.
        statuses, views = self._regions.check_all(entries)
        accepted = [view for view in views if view is not None]
        moved = sum(view.nbytes for view in accepted)
        if op == _WRITE:
            for (_, _, _, length), view in zip(entries, views, strict=True):
                if view is not None:
                    _recv_into(conn, view)
                else:
                    _drain(conn, length)  # a refused segment's bytes still arrive
            conn.sendall(statuses)
            self._counters.update(
                write_requests=1, segments_written=len(accepted), bytes_written=moved
            )
        else:
            conn.sendall(statuses)
            for view in accepted:
                conn.sendall(view)
            self._counters.update(read_requests=1, segments_read=len(accepted), bytes_read=moved)
        return True


def _drain(conn: socket.socket, length: int) -> None:
    scratch = memoryview(bytearray(min(length, _DRAIN)))
    while length > 0:
        chunk = min(length, scratch.nbytes)
        _recv_into(conn, scratch[:chunk])
        length -= chunk


# -- client -------------------------------------------------------------------------------


class _Node:
    """The client's state for one node: its address and one connection, one call at a time."""

    def __init__(self, address: bytes) -> None:
        host, _, port = address.decode().rpartition(":")
        self.address = (host, int(port))
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def connection(self, deadline: float) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=_remaining(deadline))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.sock

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _Client(PeerClient[_Node]):
    # PeerClient maps OSError and TimeoutError (what sockets raise) to TransportError and
    # TransportTimeoutError around every primitive: nothing to catch here.

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._max_segments = int(ExampleTransport.parse_options(config.options)["max_segments"])

    def open_peer(self, endpoint: NodeEndpoint) -> _Node:
        return _Node(endpoint.address)

    def close_peer(self, peer: _Node) -> None:
        with peer.lock:
            peer.drop()

    def read_segments(self, peer: _Node, batch: Batch) -> None:
        self._call(peer, _READ, batch)

    def write_segments(self, peer: _Node, batch: Batch) -> None:
        self._call(peer, _WRITE, batch)

    def _call(self, peer: _Node, op: int, batch: Batch) -> None:
        with peer.lock:
            try:
                sock = peer.connection(batch.deadline)
                for start in range(0, len(batch.segments), self._max_segments):
                    frame = batch.segments[start : start + self._max_segments]
                    statuses = _exchange(sock, op, frame, batch.deadline)
                    for i, status in enumerate(statuses):
                        if status != SegmentStatus.OK:
                            batch.refuse(start + i, SegmentStatus(status).describe())
            except BaseException:
                peer.drop()  # what is left on the stream is unknown: never reuse it
                raise


def _exchange(sock: socket.socket, op: int, segments: list[Segment], deadline: float) -> bytes:
    """One request and its reply; returns the status of each segment."""
    table = b"".join(_ENTRY.pack(s.region, s.rkey, s.offset, s.buffer.nbytes) for s in segments)
    sock.settimeout(_remaining(deadline))
    sock.sendall(_REQUEST.pack(op, len(segments)) + table)
    if op == _WRITE:
        for seg in segments:
            sock.settimeout(_remaining(deadline))
            sock.sendall(seg.buffer)
    statuses = bytearray(len(segments))
    _recv_into(sock, memoryview(statuses), deadline)
    if op == _READ:
        for seg, status in zip(segments, statuses, strict=True):
            if status == SegmentStatus.OK:
                _recv_into(sock, seg.buffer, deadline)
    return bytes(statuses)
