"""Socket I/O for the ``tcp`` transport, every call bounded by a deadline.

Both sides move bytes through a :class:`Stream`: straight between the socket and the
caller's buffers (``sendmsg`` gathers, ``recvmsg_into`` scatters, at most ``IOV_MAX``
buffers per call, so a batch of any size never asks the kernel for more), with no copy
beyond the kernel's own. A :class:`TlsStream` does the same over an ``ssl`` socket, which
has neither call: it receives into each buffer in turn and coalesces small sends, so a
64-byte record header does not become a TLS record of its own.

The socket is non-blocking and a call waits in ``poll`` only when the kernel has nothing
for it: bytes that already arrived, or a send that fits, cost one system call. (A Python
socket with a timeout polls before every call, and setting the timeout is a call of its
own.) Every method takes a deadline (``time.monotonic()``; None for none) that bounds each
wait, so a whole frame is bounded however slowly its bytes trickle in. The peer closing in
the middle of a transfer raises :class:`Truncated`.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

from kvfabric.spi import byte_view

__all__ = ["IOV_MAX", "Stream", "Target", "TlsStream", "Truncated", "wake"]

try:
    IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
except (AttributeError, ValueError, OSError):  # pragma: no cover - not Linux
    IOV_MAX = 16
# Bytes asked of the kernel per receive when the size comes from the peer: memory then
# grows with what actually arrived, never with what a header announced.
_GROW_CHUNK = 64 * 1024
# TLS: sends smaller than this are copied together into one record.
_COALESCE_BELOW = 16 * 1024
_COALESCE_FLUSH = 256 * 1024
_IN = select.POLLIN
_OUT = select.POLLOUT

# What a receive target is: a buffer to fill, or a count of bytes to read and drop.
Target = memoryview | int
A = TypeVar("A")
T = TypeVar("T")


class Truncated(ConnectionError):
    """The peer closed the connection in the middle of a transfer."""


def wake(sock: socket.socket) -> None:
    """Wake a thread waiting on ``sock`` (it sees EOF), without closing the descriptor.

    The base class's ``shutdown``: ``SSLSocket.shutdown`` would also drop the TLS state a
    waiting reader is still using.
    """
    # OSError: already shut down, or never connected.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Stream:
    """One connected socket, made non-blocking; used by one thread at a time."""

    __slots__ = ("_events", "_poll", "sock")
    tls: ClassVar[bool] = False

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), _IN)
        self._events = _IN

    def close(self) -> None:
        self.sock.close()

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
        """``call(arg)`` once the kernel can serve it: waits only when it would block."""
        while True:
            try:
                return call(arg)
            except BlockingIOError:
                pass
            self._wait(_IN, deadline)

    def _send_call(self, call: Callable[[A], T], arg: A, deadline: float | None) -> T:
        while True:
            try:
                return call(arg)
            except BlockingIOError:
                pass
            self._wait(_OUT, deadline)

    def recv_some(self, buf: memoryview, deadline: float | None) -> int:
        """One receive into ``buf``; 0 when the peer closed."""
        return self._call(self.sock.recv_into, buf, deadline)

    def recv_awaited(self, buf: memoryview, deadline: float | None) -> int:
        """:meth:`recv_some` where the peer is expected to be still working (the next
        request, a reply): waits first, rather than try a receive that would fail."""
        self._wait(_IN, deadline)
        return self.recv_some(buf, deadline)

    def recv_exact(self, buf: memoryview, deadline: float | None) -> None:
        got = 0
        while got < buf.nbytes:
            n = self.recv_some(buf[got:], deadline)
            if n == 0:
                raise Truncated(f"connection closed after {got} of {buf.nbytes} bytes")
            got += n

    def recv_growing(self, size: int, deadline: float | None) -> bytearray:
        """``size`` bytes the peer announced, held only as they arrive (a buffer of at most
        ``_GROW_CHUNK`` may be made up front)."""
        if size <= _GROW_CHUNK:
            small = bytearray(size)
            self.recv_exact(memoryview(small), deadline)
            return small
        data = bytearray()
        while len(data) < size:
            want = min(size - len(data), _GROW_CHUNK)
            chunk = self._call(self.sock.recv, want, deadline)
            if not chunk:
                raise Truncated(f"connection closed after {len(data)} of {size} bytes")
            data += chunk
        return data

    def recv_targets(
        self, targets: Iterable[Target], scratch: memoryview, deadline: float | None
    ) -> None:
        """Fill each buffer in order; an int target reads that many bytes into ``scratch``
        and drops them. Targets are pulled lazily, at most ``IOV_MAX`` buffers at a time."""
        pending: list[memoryview] = []
        for target in targets:
            if isinstance(target, int):
                self._recv_views(pending, deadline)
                self._drain(target, scratch, deadline)
            elif target.nbytes:
                pending.append(byte_view(target))
                if len(pending) == IOV_MAX:
                    self._recv_views(pending, deadline)
        self._recv_views(pending, deadline)

    def _recv_views(self, pending: list[memoryview], deadline: float | None) -> None:
        """Fill every buffer of ``pending`` (at most ``IOV_MAX``) and empty the list."""
        while pending:
            n = self._call(self.sock.recvmsg_into, pending, deadline)[0]
            if n == 0:
                raise Truncated("connection closed in the middle of a payload")
            _advance(pending, n)

    def _drain(self, size: int, scratch: memoryview, deadline: float | None) -> None:
        while size > 0:
            n = self.recv_some(scratch[: min(size, scratch.nbytes)], deadline)
            if n == 0:
                raise Truncated("connection closed in the middle of a payload")
            size -= n

    def send_all(self, buffers: Iterable[Any], deadline: float | None) -> None:
        """Send every buffer in order, gathering up to ``IOV_MAX`` per ``sendmsg``."""
        source = iter(buffers)
        pending: list[memoryview] = []
        while True:
            for buf in source:
                view = byte_view(buf)
                if view.nbytes:
                    pending.append(view)
                    if len(pending) == IOV_MAX:
                        break
            if not pending:
                return
            while pending:
                _advance(pending, self._send_call(self.sock.sendmsg, pending, deadline))


class TlsStream(Stream):
    """:class:`Stream` over an ``ssl.SSLSocket`` (no ``sendmsg``/``recvmsg_into`` there).

    TLS may need to read while sending or write while receiving (handshakes, key updates):
    each call waits for whichever its ``SSLWant*`` error names.
    """

    __slots__ = ()
    tls = True

    def _call(self, call: Callable[[A], T], arg: A, deadline: float | None) -> T:
        while True:
            try:
                return call(arg)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait(_IN, deadline)
            except ssl.SSLWantWriteError:
                self._wait(_OUT, deadline)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
                raise Truncated("the peer closed the TLS connection") from exc

    def _send_call(self, call: Callable[[A], T], arg: A, deadline: float | None) -> T:
        while True:
            try:
                return call(arg)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._wait(_OUT, deadline)
            except ssl.SSLWantReadError:
                self._wait(_IN, deadline)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
                raise Truncated("the peer closed the TLS connection") from exc

    def recv_awaited(self, buf: memoryview, deadline: float | None) -> int:
        # Bytes TLS already decrypted are no event for poll: take those first.
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket)
        if sock.pending():
            return self.recv_some(buf, deadline)
        return super().recv_awaited(buf, deadline)

    def handshake(self, deadline: float | None) -> None:
        """Run the TLS handshake of a socket wrapped with ``do_handshake_on_connect=False``."""
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket)
        self._call(_handshake_step, sock, deadline)

    def _recv_views(self, pending: list[memoryview], deadline: float | None) -> None:
        for view in pending:
            self.recv_exact(view, deadline)
        pending.clear()

    def send_all(self, buffers: Iterable[Any], deadline: float | None) -> None:
        for view in _coalesced(buffers):
            sent = 0
            while sent < view.nbytes:
                # After an SSLWant* error, the same bytes are offered again (as OpenSSL
                # requires): ``sent`` only moves on a completed write.
                sent += self._send_call(self.sock.send, view[sent:], deadline)


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


def _advance(pending: list[memoryview], n: int) -> None:
    """Drop the ``n`` bytes a partial scatter/gather call moved from the front of ``pending``."""
    done = 0
    while n and n >= pending[done].nbytes:
        n -= pending[done].nbytes
        done += 1
    del pending[:done]
    if n:
        pending[0] = pending[0][n:]
