"""Blocking socket I/O for the ``tcp`` transport, every call bounded by a deadline.

Both sides move bytes through a :class:`Stream`: straight between the socket and the
caller's buffers (``sendmsg`` gathers, ``recvmsg_into`` scatters, at most ``IOV_MAX``
buffers per call, so a batch of any size never asks the kernel for more), with no copy
beyond the kernel's own. A :class:`TlsStream` does the same over an ``ssl`` socket, which
has neither call: it receives into each buffer in turn and coalesces small sends, so a
64-byte record header does not become a TLS record of its own.

Every method takes a deadline (``time.monotonic()``; None for none): each socket call is
bounded by what is left of it, so a whole frame is, however slowly its bytes trickle in.
The peer closing in the middle of a transfer raises :class:`Truncated`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from kvfabric.spi import byte_view

__all__ = ["IOV_MAX", "Stream", "Target", "TlsStream", "Truncated", "arm", "wake"]

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

# What a receive target is: a buffer to fill, or a count of bytes to read and drop.
Target = memoryview | int


class Truncated(ConnectionError):
    """The peer closed the connection in the middle of a transfer."""


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next socket call by what is left of the deadline (None: block)."""
    if deadline is None:
        sock.settimeout(None)
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)


def wake(sock: socket.socket) -> None:
    """Wake a thread blocked on ``sock`` (it sees EOF), without closing the descriptor.

    The base class's ``shutdown``: ``SSLSocket.shutdown`` would also drop the TLS state a
    blocked reader is still using.
    """
    # OSError: already shut down, or never connected.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Stream:
    """One connected socket in blocking mode; used by one thread at a time."""

    __slots__ = ("sock",)
    tls: ClassVar[bool] = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()

    def recv_some(self, buf: memoryview, deadline: float | None) -> int:
        """One receive into ``buf``; 0 when the peer closed."""
        arm(self.sock, deadline)
        return self.sock.recv_into(buf)

    def recv_exact(self, buf: memoryview, deadline: float | None) -> None:
        got = 0
        while got < buf.nbytes:
            n = self.recv_some(buf[got:], deadline)
            if n == 0:
                raise Truncated(f"connection closed after {got} of {buf.nbytes} bytes")
            got += n

    def recv_growing(self, size: int, deadline: float | None) -> bytearray:
        """``size`` bytes the peer announced, held only as they arrive."""
        data = bytearray()
        while len(data) < size:
            arm(self.sock, deadline)
            chunk = self.sock.recv(min(size - len(data), _GROW_CHUNK))
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
            arm(self.sock, deadline)
            n = self.sock.recvmsg_into(pending)[0]
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
                arm(self.sock, deadline)
                _advance(pending, self.sock.sendmsg(pending))


class TlsStream(Stream):
    """:class:`Stream` over an ``ssl.SSLSocket`` (no ``sendmsg``/``recvmsg_into`` there)."""

    __slots__ = ()
    tls = True

    def recv_some(self, buf: memoryview, deadline: float | None) -> int:
        arm(self.sock, deadline)
        try:
            return self.sock.recv_into(buf)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
            raise Truncated("the peer closed the TLS connection") from exc

    def recv_growing(self, size: int, deadline: float | None) -> bytearray:
        try:
            return super().recv_growing(size, deadline)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
            raise Truncated("the peer closed the TLS connection") from exc

    def _recv_views(self, pending: list[memoryview], deadline: float | None) -> None:
        for view in pending:
            self.recv_exact(view, deadline)
        pending.clear()

    def send_all(self, buffers: Iterable[Any], deadline: float | None) -> None:
        try:
            for view in _coalesced(buffers):
                sent = 0
                while sent < view.nbytes:
                    arm(self.sock, deadline)
                    sent += self.sock.send(view[sent:])
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as exc:
            raise Truncated("the peer closed the TLS connection") from exc


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
