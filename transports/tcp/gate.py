"""The ``tcp`` node's front door: accepts connections and runs every handshake on one thread.

A connection that has not proved it holds the key costs the node a socket and a few
hundred bytes here, never a thread or a buffer sized by the peer: one thread multiplexes
every pending handshake with a selector (the handshake's messages have fixed sizes, read
into a fixed buffer). Three bounds keep strangers from starving clients:

- a handshake deadline (``tcp.handshake_timeout``) from the moment of accept; TLS, when on,
  runs inside it;
- at most ``tcp.max_pending`` handshakes at once, separate from (and far below) the cap on
  authenticated connections: a new connection past it closes the oldest pending one, so a
  client that answers its challenge at once gets through a flood of idle strangers;
- no frame but the handshake before it completes: a READ or WRITE is refused (rkeys are
  honoured only on an authenticated connection).

A connection that completes the handshake is handed to :class:`Admission` (the server),
which gives it a serving thread or answers BUSY.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import hmac
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Protocol, cast

from kvfabric.spi import Counters
from kvfabric.transports.tcp.auth import (
    FLAG_TLS,
    HELLO_SIZE,
    NONCE_SIZE,
    client_proof,
    new_nonce,
    pack_greeting,
    server_proof,
)
from kvfabric.transports.tcp.stream import Stream, TlsStream
from kvfabric.transports.tcp.wire import HEADER, MAGIC, VERSION, Code, Op, pack_header

__all__ = ["GATE_COUNTERS", "Admission", "Gate"]

log = logging.getLogger(__name__)

GATE_COUNTERS = (
    "connections",
    "handshakes",
    "handshake_timeouts",
    "pending_evicted",
    "auth_failures",
    "bad_frames",
    "tls_failures",
    "connections_refused",
)
# While descriptors run out, the listener is left alone this long (instead of spinning).
_ACCEPT_PAUSE = 0.1


class Admission(Protocol):
    """Where authenticated connections go (the server's connection table)."""

    def reserve(self) -> object | None:
        """A slot for one more connection, or None when the node is at its limit."""

    def start(self, slot: object, stream: Stream, key: int) -> None:
        """Serve ``stream`` in the reserved slot from now on; ``key``: which key the client
        proved (0: the node's own, ``i``: the i-th tenant key)."""

    def release(self, slot: object) -> None:
        """Give back a slot whose connection failed before :meth:`start`."""


class _Phase(enum.Enum):
    GREETING = enum.auto()
    TLS = enum.auto()
    HELLO = enum.auto()
    REPLY = enum.auto()


class _Pending:
    """One connection between accept and the end of its handshake."""

    __slots__ = ("deadline", "got", "inbox", "key", "nonce", "out", "phase", "slot", "sock")

    def __init__(self, sock: socket.socket, deadline: float, greeting: bytes, nonce: bytes):
        self.sock = sock
        self.deadline = deadline
        self.phase = _Phase.GREETING
        self.nonce = nonce
        self.out = memoryview(greeting)
        self.inbox = bytearray(HEADER.size + HELLO_SIZE)
        self.got = 0
        self.key = 0
        self.slot: object | None = None


class _Refuse(Exception):
    def __init__(self, code: Code, counter: str) -> None:
        super().__init__(code.name)
        self.code = code
        self.counter = counter


class Gate:
    """Owns the listening socket and one thread: accept, handshake, hand over."""

    def __init__(
        self,
        listener: socket.socket,
        *,
        key: bytes,
        tls: ssl.SSLContext | None,
        tenant_keys: tuple[bytes, ...] = (),
        max_pending: int,
        handshake_timeout: float,
        admission: Admission,
        counters: Counters,
    ) -> None:
        self._listener = listener
        # A tenant's client proves its tenant's key instead of the deployment's (only where
        # the node has a key at all: a node without one admits anyone).
        self._keys = (key, *tenant_keys) if key else (key,)
        self._tls = tls
        self._flags = FLAG_TLS if tls is not None else 0
        self._max_pending = max(1, max_pending)
        self._handshake_timeout = handshake_timeout
        self._admission = admission
        self._counters = counters
        # In accept order, so the first is both the oldest and the next to time out.
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = False
        self._accept_paused_until = 0.0
        listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="kvfabric-tcp-gate", daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Stop accepting, drop every pending handshake, and wait for the thread."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout)

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._wait()):
                    if key.fileobj is self._listener:
                        self._accept_all()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        pending: _Pending = key.data
                        if self._pending.get(pending.sock.fileno()) is pending:
                            self._step(pending)
                self._expire()
        except Exception:
            log.exception("kvfabric tcp: the accept loop failed; the node accepts no more")
        finally:
            for fd in list(self._pending):
                self._drop(self._pending[fd])
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _wait(self) -> float | None:
        now = time.monotonic()
        waits = []
        if self._pending:
            waits.append(next(iter(self._pending.values())).deadline - now)
        if self._accept_paused_until:
            waits.append(self._accept_paused_until - now)
        return max(0.0, min(waits)) if waits else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                break
            self._counters.add("handshake_timeouts")
            self._drop(oldest)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _accept_all(self) -> None:
        # At most max_pending per turn: handshakes already under way get their turn between
        # bursts, however fast strangers connect.
        for _ in range(self._max_pending):
            if self._closed:
                return
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._out_of_descriptors()
                return  # an aborted connection, or no descriptors: the selector says when
            self._counters.add("connections")
            if len(self._pending) >= self._max_pending:
                self._counters.add("pending_evicted")
                self._drop(next(iter(self._pending.values())))
            self._admit(sock)

    def _out_of_descriptors(self) -> None:
        if self._pending:
            # The oldest pending handshake gives its descriptor to whoever is waiting.
            self._counters.add("pending_evicted")
            self._drop(next(iter(self._pending.values())))
            return
        self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        nonce = new_nonce()
        body = pack_greeting(self._flags, nonce)
        greeting = pack_header(Op.GREETING, Code.OK, len(body), 0) + body
        pending = _Pending(sock, time.monotonic() + self._handshake_timeout, greeting, nonce)
        self._pending[sock.fileno()] = pending
        self._selector.register(sock, selectors.EVENT_WRITE, pending)
        self._step(pending)

    # -- one connection's handshake -----------------------------------------------------

    def _step(self, pending: _Pending) -> None:
        """Advance ``pending`` as far as its socket allows, then wait for the next event."""
        try:
            event = self._advance(pending)
        except _Refuse as refusal:
            self._counters.add(refusal.counter)
            self._refuse(pending, refusal.code)
            return
        except ssl.SSLError:
            self._counters.add("tls_failures")
            self._drop(pending)
            return
        except OSError:
            self._drop(pending)  # the peer went away
            return
        if event is None:
            self._hand_over(pending)
        else:
            self._selector.modify(pending.sock, event, pending)

    def _advance(self, pending: _Pending) -> int | None:
        """Run phases until one must wait: the event to wait for, or None when done."""
        while True:
            if pending.phase is _Phase.GREETING or pending.phase is _Phase.REPLY:
                if not self._flush(pending):
                    return selectors.EVENT_WRITE
                if pending.phase is _Phase.REPLY:
                    return None
                pending.phase = _Phase.HELLO if self._tls is None else _Phase.TLS
                if self._tls is not None:
                    self._start_tls(pending)
            elif pending.phase is _Phase.TLS:
                try:
                    cast(ssl.SSLSocket, pending.sock).do_handshake()
                except ssl.SSLWantReadError:
                    return selectors.EVENT_READ
                except ssl.SSLWantWriteError:
                    return selectors.EVENT_WRITE
                pending.phase = _Phase.HELLO
            elif not self._receive_hello(pending):
                return selectors.EVENT_READ

    def _flush(self, pending: _Pending) -> bool:
        while pending.out.nbytes:
            try:
                sent = pending.sock.send(pending.out)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return False
            pending.out = pending.out[sent:]
        return True

    def _start_tls(self, pending: _Pending) -> None:
        assert self._tls is not None
        self._selector.unregister(pending.sock)
        # wrap_socket moves the descriptor to a new object: register that one instead.
        pending.sock = self._tls.wrap_socket(
            pending.sock, server_side=True, do_handshake_on_connect=False
        )
        self._selector.register(pending.sock, selectors.EVENT_READ, pending)

    def _receive_hello(self, pending: _Pending) -> bool:
        """Read the client's HELLO as it arrives; True once it is in and answered."""
        view = memoryview(pending.inbox)
        while pending.got < len(pending.inbox):
            try:
                n = pending.sock.recv_into(view[pending.got :])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            if n == 0:
                raise ConnectionError("closed during the handshake")
            before, pending.got = pending.got, pending.got + n
            if before < HEADER.size <= pending.got:
                _check_hello_header(pending.inbox)
        body = pending.inbox[HEADER.size :]
        client_nonce, proof = bytes(body[:NONCE_SIZE]), bytes(body[NONCE_SIZE:])
        proved = next(
            (
                number
                for number, key in enumerate(self._keys)
                if hmac.compare_digest(
                    proof, client_proof(key, self._flags, pending.nonce, client_nonce)
                )
            ),
            None,
        )
        if proved is None:
            raise _Refuse(Code.AUTH_FAILED, "auth_failures")
        pending.key = proved
        pending.slot = self._admission.reserve()
        if pending.slot is None:
            raise _Refuse(Code.BUSY, "connections_refused")
        ours = server_proof(self._keys[proved], self._flags, pending.nonce, client_nonce)
        pending.out = memoryview(pack_header(Op.HELLO, Code.OK, len(ours), 0) + ours)
        pending.phase = _Phase.REPLY
        return True

    # -- leaving the gate ---------------------------------------------------------------

    def _hand_over(self, pending: _Pending) -> None:
        self._forget(pending)
        slot, pending.slot = pending.slot, None
        assert slot is not None
        self._counters.add("handshakes")
        stream = TlsStream(pending.sock) if self._tls is not None else Stream(pending.sock)
        self._admission.start(slot, stream, pending.key)

    def _refuse(self, pending: _Pending, code: Code) -> None:
        """Best effort: one non-blocking send of the error header, then close."""
        with contextlib.suppress(OSError):
            pending.sock.send(pack_header(Op.HELLO, code, 0, 0))
        self._drop(pending)

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending)
        if pending.slot is not None:
            self._admission.release(pending.slot)
            pending.slot = None
        pending.sock.close()

    def _forget(self, pending: _Pending) -> None:
        fd = pending.sock.fileno()
        if self._pending.get(fd) is pending:
            del self._pending[fd]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)


def _check_hello_header(inbox: bytearray) -> None:
    magic, version, op, code, count, _ = HEADER.unpack_from(inbox)
    if magic != MAGIC or version != VERSION or code:
        raise _Refuse(Code.BAD_FRAME, "bad_frames")
    if op in (Op.READ, Op.WRITE):
        raise _Refuse(Code.AUTH_REQUIRED, "auth_failures")
    if op != Op.HELLO or count != HELLO_SIZE:
        raise _Refuse(Code.BAD_FRAME, "bad_frames")
