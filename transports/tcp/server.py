"""The ``tcp`` node: serves authenticated connections, a thread each, against its regions.

Connections arrive here from :class:`~kvfabric.transports.tcp.gate.Gate` once their
handshake is done. Each then gets a thread that serves its frames one at a time, every
segment checked again against the regions (``kvfabric.spi.RegionTable``: the client is not
trusted), a refused segment moving no bytes. On a plain connection, READ frames of up to
``SERVE_MAX_COUNT`` (256) entries — a lookup's read of the image, most reads of records —
never reach Python: ``kvfabric._runtime.native.serve_reads`` waits for them, checks them by
the same rules and replies, frame after frame, holding no GIL (and at a fraction of what
serving them in Python cost: docs/performance.md). It hands back anything else with its
header read. Python serves those: bytes go straight between the socket and region memory
(:class:`~kvfabric.transports.tcp.stream.Stream`: kvfabric's native loops, so a frame of up
to 4,096 segments takes the GIL back about twice: once after waiting for the frame, once
after moving its payloads; with TLS, once per ``ssl`` call).

What one peer can hold is bounded:

- time: between frames a connection may sit idle ``tcp.idle_timeout``; a frame, from its
  first byte to the last byte of its reply, must complete within ``tcp.frame_timeout``;
- connections: at most ``tcp.max_connections`` authenticated ones. At the limit a newly
  authenticated client still gets in when some connection is idle (the longest idle one
  is closed: its client reconnects when it next needs it); only when every one is busy is
  it answered BUSY;
- memory: nothing is sized by a number the peer sent until the peer has sent the bytes.
  A frame's table is held as it arrives; a frame of more than 4,096 segments keeps one
  status byte per segment and makes region views 4,096 at a time; refused write payloads
  are read into one scratch buffer and dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator

import attrs

from kvfabric._runtime.native import SERVE_COUNTERS, ServeEnd, serve_reads
from kvfabric.errors import TransportError
from kvfabric.spi import (
    Counters,
    Region,
    RegionHandle,
    RegionTable,
    SegmentStatus,
    TransportConfig,
    TransportServer,
    byte_view,
)
from kvfabric.transports.tcp.gate import GATE_COUNTERS, Gate
from kvfabric.transports.tcp.stream import (
    VIEWS_PER_CALL,
    PeerClosed,
    Stream,
    Target,
    peer_closed,
    wake,
)
from kvfabric.transports.tcp.tenant_reads import tenant_reads
from kvfabric.transports.tcp.tuning import AUTO, tune
from kvfabric.transports.tcp.wire import (
    ENTRY,
    HEADER,
    MAGIC,
    MAX_BATCH_BYTES,
    MAX_COUNT,
    VERSION,
    Code,
    Op,
    pack_header,
)

__all__ = ["ServerLimits", "TcpServer"]

log = logging.getLogger(__name__)

SERVER_COUNTERS = (
    *GATE_COUNTERS,
    "frames",
    "requests",
    "segments_read",
    "segments_written",
    "bytes_read",
    "bytes_written",
    "refused_segments",
    "stalled_frames",
    "idle_timeouts",
    "idle_evicted",
)
# A read of up to this many segments plans them in one pass (their views held at once,
# ~300 bytes each with the native call's own) and sends them in one native call; a larger
# one checks twice rather than hold 65536 views, and sends them this many per call.
_ONE_PASS_MAX = VIEWS_PER_CALL
# Refused write payloads land here and are dropped. One buffer for every connection: what
# concurrent drains write into it is garbage nobody reads.
_SCRATCH = 256 * 1024
_OK = SegmentStatus.OK
_SERVED_OPS = (Op.READ, Op.WRITE)
_LISTEN_BACKLOG = 1024


@attrs.frozen(kw_only=True)
class ServerLimits:
    max_connections: int
    max_pending: int
    handshake_timeout: float
    idle_timeout: float
    """0: none."""
    frame_timeout: float
    busy_poll: float
    """Seconds the native loop spins for a connection's next frame before sleeping."""
    send_buffer: int = AUTO
    """``tcp.send_buffer``: what each connection's reads go out through."""


class _Conn:
    """One authenticated connection (or a slot reserved for one finishing its handshake)."""

    __slots__ = ("_idle", "evicted", "stream", "tag", "thread")

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.thread: threading.Thread | None = None
        # time.monotonic() in ns while the connection waits for a frame, else 0: written by
        # the native loop too (serve_reads), read by admission to pick an idle victim.
        self._idle = memoryview(bytearray(8)).cast("q")
        self.evicted = False
        self.tag: bytes | None = None
        """A tenant's connection: the tag its keys end with (it reads its own records only,
        :mod:`kvfabric.transports.tcp.tenant_reads`)."""

    @property
    def idle_since(self) -> float | None:
        ns = self._idle[0]
        return ns / 1e9 if ns else None

    @idle_since.setter
    def idle_since(self, value: float | None) -> None:
        self._idle[0] = 0 if value is None else max(1, int(value * 1e9))


class _Refused(Exception):
    def __init__(self, op: int, code: Code, counter: str) -> None:
        super().__init__(code.name)
        self.op = op
        self.code = code
        self.counter = counter


class TcpServer(TransportServer):
    def __init__(
        self, config: TransportConfig, limits: ServerLimits, tls: ssl.SSLContext | None
    ) -> None:
        self._limits = limits
        self._regions = RegionTable()
        # The same regions as the native loop takes them: (id, rkey, memory, size).
        self._native_regions: list[tuple[int, int, memoryview, int]] = []
        self._memories: dict[int, memoryview] = {}
        # Tag of the tenant each tenant key admits, by the key's number at the gate.
        self._tenant_tags = {n: tag for n, (_, tag) in enumerate(config.tenant_tokens, 1)}
        self._counters = Counters(SERVER_COUNTERS)
        # What the native loop counts, shared by every connection (atomic adds in C).
        self._native_counts = memoryview(bytearray(8 * len(SERVE_COUNTERS))).cast("Q")
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
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
            self._listener.listen(_LISTEN_BACKLOG)
        except OSError as exc:
            self._listener.close()
            raise TransportError(f"tcp: cannot listen on {config.host}:{config.port}") from exc
        host, port = self._listener.getsockname()[:2]
        # A wildcard bind (0.0.0.0) is not an address a client can use: advertise the one
        # the operator names instead.
        host = config.advertise or host
        self._address = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()
        self._gate = Gate(
            self._listener,
            key=config.token,
            tls=tls,
            tenant_keys=tuple(token for token, _ in config.tenant_tokens),
            max_pending=limits.max_pending,
            handshake_timeout=limits.handshake_timeout,
            admission=self,
            counters=self._counters,
        )

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, region: Region) -> RegionHandle:
        handle = RegionHandle(region=region.id, rkey=region.rkey, size=region.size)
        memory = byte_view(region.view)
        self._regions.add(handle, memory)
        self._memories = {**self._memories, region.id: memory}
        # A new list, not appended to: a connection's native loop holds the one it started
        # with (regions are registered before clients learn of them).
        self._native_regions = [
            *self._native_regions,
            (region.id, region.rkey, memory, region.size),
        ]
        return handle

    def stats(self) -> dict[str, int]:
        counts = self._counters.snapshot()
        for name, value in zip(SERVE_COUNTERS, self._native_counts, strict=True):
            counts[name] += value
        return counts

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + 2.0
        self._gate.close(2.0)
        with self._lock:
            conns = list(self._conns)
        # Waking (not closing) each socket: its thread closes it on the way out.
        for conn in conns:
            if conn.stream is not None:
                wake(conn.stream.sock)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        self._regions.clear()

    # -- admission (called by the gate's thread) ------------------------------------------

    def reserve(self) -> object | None:
        with self._lock:
            if self._closed:
                return None
            live = [conn for conn in self._conns if not conn.evicted]
            if len(live) >= self._limits.max_connections:
                idle = [c for c in live if c.idle_since is not None and c.stream is not None]
                if not idle:
                    return None
                victim = min(idle, key=lambda c: c.idle_since or 0.0)
                victim.evicted = True
                assert victim.stream is not None
                wake(victim.stream.sock)
                self._counters.add("idle_evicted")
            conn = _Conn()
            self._conns.add(conn)
            return conn

    def start(self, slot: object, stream: Stream, key: int = 0) -> None:
        assert isinstance(slot, _Conn)
        slot.tag = self._tenant_tags.get(key)
        try:
            tune(stream.sock, self._limits.send_buffer)
        except OSError:  # the peer is already gone
            self.release(slot)
            stream.close()
            return
        thread = threading.Thread(
            target=self._serve, args=(slot,), name="kvfabric-tcp-conn", daemon=True
        )
        with self._lock:
            if self._closed:
                self._conns.discard(slot)
                stream.close()
                return
            # Idle from now: a thread not yet running holds no frame, so it may make room.
            slot.stream, slot.thread, slot.idle_since = stream, thread, time.monotonic()
        thread.start()

    def release(self, slot: object) -> None:
        assert isinstance(slot, _Conn)
        with self._lock:
            self._conns.discard(slot)

    # -- serving one connection -----------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        stream = conn.stream
        assert stream is not None
        try:
            self._serve_frames(conn, stream)
        except _Refused as refused:
            self._counters.add(refused.counter)
            with contextlib.suppress(OSError, TimeoutError):
                stream.send_all(
                    [pack_header(refused.op, refused.code, 0, 0)], time.monotonic() + 1.0
                )
        except PeerClosed:
            self._counters.add("bad_frames")  # closed in the middle of a frame
        except TimeoutError:
            self._counters.add("stalled_frames")
        except (OSError, ValueError):
            pass  # the peer went away, or close() / an eviction woke this thread
        except Exception:
            log.exception("kvfabric tcp: connection handler failed; closing the connection")
        finally:
            stream.close()
            with self._lock:
                self._conns.discard(conn)

    def _serve_frames(self, conn: _Conn, stream: Stream) -> None:
        header = memoryview(bytearray(HEADER.size))
        idle_timeout = self._limits.idle_timeout
        while True:
            if not stream.tls and conn.tag is None:
                # Small READs (lookups of the image, most reads of records) are served in C
                # without the GIL; the loop hands back what else arrives with its header read.
                if not self._serve_natively(conn, stream, header):
                    return
                deadline = time.monotonic() + self._limits.frame_timeout
            else:
                conn.idle_since = now = time.monotonic()
                try:
                    more = stream.recv_first(header, now + idle_timeout if idle_timeout else None)
                except TimeoutError:
                    self._counters.add("idle_timeouts")
                    return
                if not more or conn.evicted:
                    return
                conn.idle_since = None
                # From a frame's first byte, the whole frame and its reply run on one clock.
                deadline = time.monotonic() + self._limits.frame_timeout
                stream.recv_exact(header[1:], deadline)
            self._counters.add("frames")
            self._serve_frame(stream, header, deadline, conn.tag)

    def _serve_natively(self, conn: _Conn, stream: Stream, header: memoryview) -> bool:
        """Run the native loop; True with a frame's header read for Python to serve, False
        when the connection is done (closed, idle, woken); raises as a frame would."""
        end, err = serve_reads(
            stream.sock,
            self._native_regions,
            self._native_counts,
            conn._idle,
            header,
            idle_timeout=self._limits.idle_timeout,
            frame_timeout=self._limits.frame_timeout,
            max_batch_bytes=MAX_BATCH_BYTES,
            busy_poll=self._limits.busy_poll,
        )
        if end == ServeEnd.HANDOFF:
            conn.idle_since = None
            return not conn.evicted
        if end == ServeEnd.CLOSED:
            return False
        if end == ServeEnd.IDLE:
            self._counters.add("idle_timeouts")
            return False
        if end == ServeEnd.STALLED:
            raise TimeoutError("a frame stalled")
        if end == ServeEnd.TRUNCATED:
            raise peer_closed(0, "in the middle of a frame")
        if end == ServeEnd.TOO_LARGE:
            raise _Refused(Op.READ, Code.TOO_LARGE, "bad_frames")
        raise OSError(err, os.strerror(err))

    def _serve_frame(
        self, stream: Stream, header: memoryview, deadline: float, tag: bytes | None = None
    ) -> None:
        """One frame whose header is read: checked, then served or refused."""
        magic, version, op, code, count, rid = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or code or op not in _SERVED_OPS:
            raise _Refused(op if op in _SERVED_OPS else 0, Code.BAD_FRAME, "bad_frames")
        if count > MAX_COUNT:
            raise _Refused(op, Code.TOO_LARGE, "bad_frames")
        table = stream.recv_growing(count * ENTRY.size, deadline)
        if sum(entry[3] for entry in ENTRY.iter_unpack(table)) > MAX_BATCH_BYTES:
            raise _Refused(op, Code.TOO_LARGE, "bad_frames")
        if op == Op.READ and tag is not None:
            self._serve_tenant_read(stream, rid, count, table, deadline, tag)
        elif op == Op.READ:
            self._serve_read(stream, rid, count, table, deadline)
        else:
            self._serve_write(stream, rid, count, table, deadline)

    def _serve_read(
        self, stream: Stream, rid: int, count: int, table: bytearray, deadline: float
    ) -> None:
        head = pack_header(Op.READ, Code.OK, count, rid)
        if count <= _ONE_PASS_MAX:
            statuses, planned = self._regions.check_all(ENTRY.iter_unpack(table))
            views = [view for view in planned if view is not None]
            served, nbytes = len(views), sum(view.nbytes for view in views)
            reply: Iterable[bytes | memoryview] = [head + statuses, *views]
        else:
            statuses, served, nbytes = self._statuses(table)
            reply = _chain(head + statuses, self._views_again(table, statuses))
        # Counted before replying, so a client holding its reply sees the request counted.
        self._counters.update(
            requests=1,
            segments_read=served,
            bytes_read=nbytes,
            refused_segments=count - served,
        )
        stream.send_all(reply, deadline)

    def _serve_tenant_read(
        self, stream: Stream, rid: int, count: int, table: bytearray, deadline: float, tag: bytes
    ) -> None:
        statuses, pieces = tenant_reads(
            self._regions, self._memories, ENTRY.iter_unpack(table), tag
        )
        self._counters.update(
            requests=1,
            segments_read=len(pieces),
            bytes_read=sum(len(p) for p in pieces),
            refused_segments=count - len(pieces),
        )
        stream.send_all([pack_header(Op.READ, Code.OK, count, rid) + statuses, *pieces], deadline)

    def _statuses(self, table: bytearray) -> tuple[bytearray, int, int]:
        statuses = bytearray()
        served = nbytes = 0
        check = self._regions.check
        for region, rkey, offset, length in ENTRY.iter_unpack(table):
            status = check(region, rkey, offset, length)[0]
            statuses.append(status)
            if status == _OK:
                served += 1
                nbytes += length
        return statuses, served, nbytes

    def _views_again(self, table: bytearray, statuses: bytearray) -> Iterator[memoryview]:
        check = self._regions.check
        for (region, rkey, offset, length), status in zip(
            ENTRY.iter_unpack(table), statuses, strict=True
        ):
            if status == _OK:
                view = check(region, rkey, offset, length)[1]
                if view is None:  # the regions were cleared: the node is closing
                    raise ConnectionAbortedError("the node is closing")
                yield view

    def _serve_write(
        self, stream: Stream, rid: int, count: int, table: bytearray, deadline: float
    ) -> None:
        statuses = bytearray()
        written = [0, 0]  # segments, bytes

        def targets() -> Iterator[Target]:
            check = self._regions.check
            for region, rkey, offset, length in ENTRY.iter_unpack(table):
                status, view = check(region, rkey, offset, length, write=True)
                statuses.append(status)
                if view is not None:
                    written[0] += 1
                    written[1] += length
                    yield view
                elif length:
                    yield length  # read and dropped: the stream stays in step

        stream.recv_targets(targets(), self._scratch, deadline)
        self._counters.update(
            requests=1,
            segments_written=written[0],
            bytes_written=written[1],
            refused_segments=count - written[0],
        )
        stream.send_all([pack_header(Op.WRITE, Code.OK, count, rid) + statuses], deadline)


def _chain(head: bytes, rest: Iterator[memoryview]) -> Iterator[bytes | memoryview]:
    yield head
    yield from rest
