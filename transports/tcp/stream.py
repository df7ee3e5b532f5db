"""Socket I/O for the ``tcp`` transport, every call bounded by a deadline.

Both sides move bytes through a :class:`Stream`: kvfabric's native loops
(``kvfabric._runtime.native``) move a whole list of buffers straight between the socket and the
caller's memory (``sendmsg`` gathers, ``recvmsg`` scatters, ``IOV_MAX`` buffers per system
call) and release the GIL once for the call. Why once: a thread that takes the GIL back
beside a busy Python thread waits out the interpreter's switch interval (5 ms by default),
so a loop that takes it back per receive, per send and per CRC piece slows down with the
number of pieces beside such a thread (docs/performance.md). A client's request and its
reply, with the read's payloads and their CRC32Cs, are one call
(:meth:`Stream.request_reply`).

A :class:`TlsStream` does the same over an ``ssl`` socket, in Python: the standard library's
``ssl`` has no gather or scatter and each of its calls takes the GIL back (one per TLS
record received, at most 16 KiB, and one per send and per wait). It receives into each
buffer in turn and coalesces small sends, so a 64-byte record header does not become a TLS
record of its own.

The socket is non-blocking and a call waits in ``poll`` only when the kernel has nothing
for it. Every method takes a deadline (``time.monotonic()``; None for none) that bounds
the whole call, so a frame is bounded however slowly its bytes trickle in
(``TimeoutError``). The peer closing in the middle of a transfer raises
:class:`~kvfabric._runtime.native.PeerClosed` (``received``: the bytes this call received).
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import attrs

from kvfabric._runtime.native import (
    IOV_MAX,
    PeerClosed,
    crc32c_many,
    recv_into_all,
    request_reply,
    request_reply_lanes,
    send_checksummed,
)
from kvfabric._runtime.native import send_all as native_send_all
from kvfabric.spi import byte_view

__all__ = [
    "HOLD_GIL",
    "IOV_MAX",
    "Lane",
    "PeerClosed",
    "Stream",
    "Target",
    "TlsStream",
    "exchange_lanes",
    "wake",
]

# Buffers per native call when a list is built lazily (a 65,536-segment frame): each costs
# a view and an iovec while the call runs, so a connection holds at most this many.
VIEWS_PER_CALL = 4096
# The first receive of a size the peer announced (a frame's table): memory then grows with
# what actually arrived, never with what a header announced. A page: a thousand
# connections that announce the largest table and send nothing hold 4 MiB.
_GROW_FIRST = 4096
# TLS: sends smaller than this are copied together into one record.
_COALESCE_BELOW = 16 * 1024
_COALESCE_FLUSH = 256 * 1024
_IN = select.POLLIN
_OUT = select.POLLOUT

# What a receive target is: a buffer to fill, or a count of bytes to read and drop.
Target = memoryview | int
A = TypeVar("A")
T = TypeVar("T")
Spans = Sequence[tuple[int, int]]


def wake(sock: socket.socket) -> None:
    """Wake a thread waiting on ``sock`` (it sees EOF), without closing the descriptor.

    The base class's ``shutdown``: ``SSLSocket.shutdown`` would also drop the TLS state a
    waiting reader is still using. (Closing would let the descriptor's number be reused
    under a native call still running on it.)
    """
    # OSError: already shut down, or never connected.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def peer_closed(received: int, what: str) -> PeerClosed:
    """A :class:`PeerClosed` raised from Python (TLS), with ``received`` set as the native
    loops set it."""
    exc = PeerClosed(f"the peer closed the connection {what}, after {received} bytes")
    exc.received = received
    return exc


HOLD_GIL = 0.001
"""Seconds a small READ frame (a lookup's image buckets, a read under 256 KiB) waits for its
reply with the GIL held before letting it go (the client passes it to
:meth:`Stream.request_reply` for reads). Beside a busy Python thread (an engine's
scheduler), taking the GIL back costs about one switch interval, 5 ms: a reply within this
costs none, and the busy thread waits only until it comes (at most this long). Long enough
for a round trip to a server that must be woken first, short against the switch interval
(docs/performance.md has the round trips and what the hold saves)."""


class Stream:
    """One connected socket, made non-blocking; used by one thread at a time."""

    __slots__ = ("busy_poll", "sock")
    tls: ClassVar[bool] = False

    def __init__(self, sock: socket.socket, busy_poll: float = 0.0) -> None:
        sock.setblocking(False)
        self.sock = sock
        # Seconds request_reply spins for a reply before sleeping (plain tcp only).
        self.busy_poll = busy_poll

    def close(self) -> None:
        self.sock.close()

    # -- what both sides call ---------------------------------------------------------

    def recv_first(self, buf: memoryview, deadline: float | None) -> bool:
        """Wait for the first byte of the next message, into ``buf[0]``; False when the
        peer closed (or was woken by :func:`wake`) before sending one."""
        try:
            recv_into_all(self.sock, [buf[:1]], deadline)
        except PeerClosed:
            return False
        return True

    def recv_exact(self, buf: memoryview, deadline: float | None) -> None:
        recv_into_all(self.sock, [buf], deadline)

    def recv_into(self, buffers: Sequence[memoryview], deadline: float | None) -> None:
        """Fill every buffer in order (one native call)."""
        recv_into_all(self.sock, buffers, deadline)

    def send_all(self, buffers: Iterable[Any], deadline: float | None) -> None:
        """Send every buffer in order: a list or tuple in one native call; any other
        iterable is pulled lazily, :data:`VIEWS_PER_CALL` buffers per call."""
        if isinstance(buffers, (list, tuple)):
            self._send(buffers, deadline)
            return
        source = iter(buffers)
        while chunk := list(itertools.islice(source, VIEWS_PER_CALL)):
            self._send(chunk, deadline)

    def _send(self, buffers: Sequence[Any], deadline: float | None) -> None:
        native_send_all(self.sock, buffers, deadline)

    def send_checksummed(
        self, buffers: Sequence[Any], deadline: float | None, crc_spans: Spans
    ) -> list[int]:
        """Send every buffer in order with the CRC32C of each span of them, taken as the
        bytes go (one native call: :func:`kvfabric._runtime.native.send_checksummed`)."""
        return send_checksummed(self.sock, buffers, deadline, crc_spans)

    def recv_growing(self, size: int, deadline: float | None) -> bytearray:
        """``size`` bytes the peer announced, held only as they arrive: the buffer starts at
        ``_GROW_FIRST`` and at most doubles per receive, so it is never more than twice what
        arrived (a handful of calls for the largest table)."""
        data = bytearray(min(size, _GROW_FIRST))
        self.recv_exact(memoryview(data), deadline)
        while len(data) < size:
            have = len(data)
            data += bytes(min(size - have, have))
            self.recv_exact(memoryview(data)[have:], deadline)
        return data

    def recv_targets(
        self, targets: Iterable[Target], scratch: memoryview, deadline: float | None
    ) -> None:
        """Fill each buffer in order; an int target reads that many bytes into ``scratch``
        (repeatedly) and drops them. Targets are pulled lazily, and each call is given at
        most :data:`VIEWS_PER_CALL` buffers, so a drain of any length holds no more."""
        pending: list[memoryview] = []
        room = VIEWS_PER_CALL
        for target in targets:
            if isinstance(target, int):
                whole, rest = divmod(target, scratch.nbytes)
                while whole:
                    take = min(whole, room - len(pending))
                    pending += itertools.repeat(scratch, take)
                    whole -= take
                    if len(pending) == room:
                        self.recv_into(pending, deadline)
                        pending = []
                if not rest:
                    continue
                target = scratch[:rest]
            pending.append(target)
            if len(pending) == room:
                self.recv_into(pending, deadline)
                pending = []
        if pending:
            self.recv_into(pending, deadline)

    # -- the client's frame -----------------------------------------------------------

    def request_reply(
        self,
        request: Sequence[Any],
        reply: memoryview,
        payloads: Sequence[memoryview],
        deadline: float | None,
        *,
        status_offset: int,
        crc_spans: Spans | None,
        hold_gil: float = 0.0,
    ) -> list[int]:
        """Send ``request``, fill ``reply``, then each payload whose status byte
        (``reply[status_offset + i]``) is 0, checksumming ``crc_spans`` of the payloads as
        they land; one release of the GIL (:func:`kvfabric._runtime.native.request_reply`), and none
        when a small frame's reply comes within ``hold_gil`` (:data:`HOLD_GIL`)."""
        return request_reply(
            self.sock,
            request,
            reply,
            payloads,
            deadline,
            status_offset=status_offset,
            crc_spans=crc_spans,
            busy_poll=self.busy_poll,
            hold_gil=hold_gil,
        )


@attrs.frozen
class Lane:
    """One request and its reply, as :meth:`Stream.request_reply` takes them, for
    :func:`exchange_lanes`."""

    stream: Stream
    request: Sequence[Any]
    reply: memoryview
    payloads: Sequence[memoryview]
    status_offset: int
    crc_spans: Spans | None


def exchange_lanes(lanes: Sequence[Lane], deadline: float | None) -> list[list[int]]:
    """Each lane's :meth:`Stream.request_reply` at once, each on its own plain stream, the
    calling thread running the first and a native helper thread each other, in one release
    of the GIL (:func:`kvfabric._runtime.native.request_reply_lanes`); each lane's CRCs.

    After an error every lane's stream is in an unknown state: close them all."""
    if any(lane.stream.tls for lane in lanes):
        raise ValueError("exchange_lanes: TLS streams move their bytes in Python, one by one")
    return request_reply_lanes(
        [
            (
                lane.stream.sock,
                lane.request,
                lane.reply,
                lane.payloads,
                lane.status_offset,
                lane.crc_spans,
            )
            for lane in lanes
        ],
        deadline,
        busy_poll=lanes[0].stream.busy_poll if lanes else 0.0,
    )


class TlsStream(Stream):
    """:class:`Stream` over an ``ssl.SSLSocket``, in Python (``ssl`` has no native loop).

    TLS may need to read while sending or write while receiving (handshakes, key updates):
    each call waits for whichever its ``SSLWant*`` error names. Every ``ssl`` call releases
    and takes back the GIL: a receive per TLS record (at most 16 KiB), a send per buffer
    (small ones coalesced), a wait per time the socket is not ready.
    """

    __slots__ = ("_events", "_poll")
    tls = True

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), _IN)
        self._events = _IN

    def _wait(self, events: int, deadline: float | None) -> None:
        """Wait until the socket is ready for ``events``; TimeoutError at the deadline."""
        if events != self._events:
            self._poll.modify(self.sock.fileno(), events)
            self._events = events
        if deadline is None:
            self._poll.poll()
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._poll.poll(remaining * 1000.0):
            raise TimeoutError("deadline passed")

    def _call(self, call: Callable[[A], T], arg: A, deadline: float | None) -> T:
        """``call(arg)`` once TLS can serve it; ``_Eof`` when the peer closed TLS."""
        while True:
            try:
                return call(arg)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait(_IN, deadline)
            except ssl.SSLWantWriteError:
                self._wait(_OUT, deadline)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
                raise _Eof from exc

    def _fill(self, buf: memoryview, deadline: float | None, before: int = 0) -> None:
        """Fill ``buf``; PeerClosed (``before`` + what arrived) if the peer closes first."""
        got = 0
        while got < buf.nbytes:
            try:
                n = self._call(self.sock.recv_into, buf[got:], deadline)
            except _Eof:
                n = 0
            if n == 0:
                raise peer_closed(before + got, "in the middle of a message")
            got += n

    def recv_first(self, buf: memoryview, deadline: float | None) -> bool:
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket)
        # Bytes TLS already decrypted are no event for poll: take those first.
        if not sock.pending():
            self._wait(_IN, deadline)
        try:
            return self._call(sock.recv_into, buf[:1], deadline) == 1
        except _Eof:
            return False  # the peer closed TLS between messages

    def recv_exact(self, buf: memoryview, deadline: float | None) -> None:
        self._fill(buf, deadline)

    def recv_into(self, buffers: Sequence[memoryview], deadline: float | None) -> None:
        for buf in buffers:
            self._fill(byte_view(buf), deadline)

    def _send(self, buffers: Sequence[Any], deadline: float | None) -> None:
        for view in _coalesced(buffers):
            sent = 0
            while sent < view.nbytes:
                # After an SSLWant* error, the same bytes are offered again (as OpenSSL
                # requires): ``sent`` only moves on a completed write.
                try:
                    sent += self._call(self.sock.send, view[sent:], deadline)
                except _Eof:
                    raise peer_closed(0, "while this side was sending") from None

    def send_checksummed(
        self, buffers: Sequence[Any], deadline: float | None, crc_spans: Spans
    ) -> list[int]:
        """As :meth:`Stream.send_checksummed`, in Python; the CRCs in one native call after
        the bytes went."""
        self.send_all(buffers, deadline)
        return crc32c_many([[buffers[i] for i in range(a, b)] for a, b in crc_spans])

    def request_reply(
        self,
        request: Sequence[Any],
        reply: memoryview,
        payloads: Sequence[memoryview],
        deadline: float | None,
        *,
        status_offset: int,
        crc_spans: Spans | None,
        hold_gil: float = 0.0,
    ) -> list[int]:
        """As :meth:`Stream.request_reply`, in Python; the CRCs in one native call after
        the payloads landed. ``hold_gil`` changes nothing here: each ``ssl`` call releases
        the GIL anyway."""
        self.send_all(request, deadline)
        self._fill(reply, deadline)
        received = reply.nbytes
        status = reply[status_offset : status_offset + len(payloads)]
        for i, payload in enumerate(payloads):
            if status[i] == 0:
                self._fill(payload, deadline, received)
                received += payload.nbytes
        if not crc_spans:
            return []
        return crc32c_many(
            [[payloads[i] for i in range(a, b) if status[i] == 0] for a, b in crc_spans]
        )

    def handshake(self, deadline: float | None) -> None:
        """Run the TLS handshake of a socket wrapped with ``do_handshake_on_connect=False``."""
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            self._call(_handshake_step, sock, deadline)
        except _Eof:
            raise peer_closed(0, "during the TLS handshake") from None


class _Eof(Exception):
    """The peer closed TLS (close_notify, or a bare EOF)."""


def _handshake_step(sock: ssl.SSLSocket) -> None:
    sock.do_handshake()


def _coalesced(buffers: Iterable[Any]) -> Iterator[memoryview]:
    """The buffers' bytes in order: small ones copied together, large ones as they are."""
    staged = bytearray()
    for buf in buffers:
        view = byte_view(buf)
        if view.nbytes < _COALESCE_BELOW:
            staged += view
            if len(staged) < _COALESCE_FLUSH:
                continue
        if staged:
            yield memoryview(staged)
            staged = bytearray()
        if view.nbytes >= _COALESCE_BELOW:
            yield view
    if staged:
        yield memoryview(staged)
