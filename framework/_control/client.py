"""The client side of the control protocol: request/reply over ZeroMQ, bounded in time.

Each call checks a DEALER socket out of a small pool and returns it when done (ZeroMQ sockets
are not thread-safe, and a socket per call would cost a TCP handshake each), so concurrent
lookups do not queue behind each other, and a thread that made a call and ended holds
nothing: the pool keeps at most :data:`IDLE_SOCKETS` idle sockets, closing the rest.
A call that finds no connected controller fails at once; one that gets no reply within
``timeout`` fails, its socket is closed (so a late reply or a queued request cannot surface
later), and further calls fail fast for ``retry_interval`` before the next attempt (a large
request's chunks go through a :meth:`ControlClient.session` instead). ZeroMQ
reconnects on its own, so a restarted controller is picked up without recreating anything;
the reply's epoch tells that it restarted. A client used in a child after ``os.fork()`` makes
its own context and sockets on its first call there.

An ``ERROR`` reply becomes a :class:`ControllerRefusedError` carrying the reply's
:class:`~kvfabric._wire.protocol.ErrorCode` as a field (``UNKNOWN_NODE`` as its subclass
:class:`UnknownNodeError`); callers branch on the code, never on the message.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable

import zmq

from kvfabric._control.handshake import HandshakeProbe
from kvfabric._control.security import Credentials
from kvfabric._control.session import ControlSession
from kvfabric._runtime import forks
from kvfabric._runtime.codec import Reader
from kvfabric._wire.protocol import (
    REPLY_BIT,
    ErrorCode,
    Header,
    MsgType,
    decode_header,
    encode,
    read_error,
)
from kvfabric.errors import (
    AuthenticationError,
    ControllerUnavailableError,
    ProtocolError,
    RemoteError,
)

__all__ = ["IDLE_SOCKETS", "ControlClient", "ControllerRefusedError", "UnknownNodeError"]

IDLE_SOCKETS = 4
"""Idle control sockets a client keeps for the next calls (each holds two fds)."""

_PROBE_AFTER_MS = 200
# A fresh socket normally connects well within this; one that has not is joined by a
# handshake probe, which only words the error (see kvfabric._control.handshake).


class ControllerRefusedError(RemoteError):
    """The controller answered a request with an ``ERROR`` reply; ``code`` says why."""

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        super().__init__(message)
        self.code = code


class UnknownNodeError(ControllerRefusedError):
    """The controller does not know this node (it restarted, or dropped the node)."""


class ControlClient:
    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 1.0,
        retry_interval: float = 1.0,
        credentials: Credentials | None = None,
        on_epoch_change: Callable[[int], None] | None = None,
        on_membership_change: Callable[[int], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.epoch = 0
        self._credentials = credentials
        self.on_epoch_change = on_epoch_change
        self.membership = 0
        self.on_membership_change = on_membership_change
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._idle: list[zmq.Socket[bytes]] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self._down_error: ControllerUnavailableError | None = None
        """Why the last unanswered call got no answer (the probe's finding), repeated by
        the calls that fail fast after it."""
        self._closed = False
        self._generation = forks.generation()

    def _after_fork(self) -> None:
        """First call in a forked child: the context's I/O threads and the idle sockets are
        the parent's (a request on them never gets its reply here). Put them aside
        untouched — closing them from here would reach into the parent's context — and
        start afresh: this process's context, no idle sockets, no memory of the
        controller being down."""
        with forks.rebuild_lock():
            if self._generation == forks.generation():
                return
            forks.abandon((self._context, self._idle))
            self._context = zmq.Context.instance()
            self._idle = []
            self._lock = threading.Lock()
            self._down_until = 0.0
            self._generation = forks.generation()

    def session(self) -> ControlSession:
        """Several requests pipelined on one socket (a large request's chunks, and what
        follows them): see :mod:`kvfabric._control.session`. Raises
        :class:`ControllerUnavailableError` while the controller is taken for down."""
        if self._generation != forks.generation():
            self._after_fork()
        return ControlSession(self)

    def check_up(self) -> None:
        """Raise :class:`ControllerUnavailableError` while the controller is taken for
        down (for ``retry_interval`` after a call it did not answer)."""
        if time.monotonic() < self._down_until:
            down = self._down_error
            if down is None:
                raise ControllerUnavailableError(f"controller {self.endpoint} is down (retrying)")
            raise type(down)(f"{down} (retrying)")

    def mark_down(self) -> None:
        """The controller did not answer: calls fail fast for ``retry_interval``."""
        self._down_until = time.monotonic() + self.retry_interval

    def _wait_connected(self, sock: zmq.Socket[bytes], deadline: float) -> None:
        """Wait until ``sock`` can send, or raise why it cannot: a socket still unconnected
        after a short grace is joined by a probe (see :mod:`kvfabric._control.handshake`)
        that tells a secret the controller refuses (at once, :class:`AuthenticationError`)
        from a controller that is not there."""
        if sock.poll(min(self._remaining_ms(deadline), _PROBE_AFTER_MS), zmq.POLLOUT):
            return
        probe = HandshakeProbe(self._context, self.endpoint, self._credentials)
        try:
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLOUT)
            poller.register(probe.monitor, zmq.POLLIN)
            while (remaining := self._remaining_ms(deadline)) > 0:
                ready = dict(poller.poll(remaining))
                if sock in ready:
                    return
                probe.read()
                if probe.refusal is not None:
                    break
            probe.read()
            kind = ControllerUnavailableError if probe.refusal is None else AuthenticationError
            self._down_error = kind(probe.finding())
            raise self._down_error
        finally:
            probe.close()

    def next_request_id(self) -> int:
        return next(self._ids)

    def checkout(self) -> zmq.Socket[bytes]:
        """A socket of the pool (or a new one), for one caller at a time."""
        return self._checkout()

    def checkin(self, sock: zmq.Socket[bytes]) -> None:
        """Give a socket back after a session whose every request was answered."""
        self._down_until = 0.0
        self._checkin(sock)

    def _checkout(self) -> zmq.Socket[bytes]:
        with self._lock:
            if self._closed:
                raise ControllerUnavailableError("control client is closed")
            if self._idle:
                return self._idle.pop()
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.immediate = True  # never queue requests for a controller that is not there
        sock.reconnect_ivl = 100
        sock.reconnect_ivl_max = 1000
        if self._credentials is not None:
            self._credentials.secure_client(sock)
        sock.connect(self.endpoint)
        return sock

    def _checkin(self, sock: zmq.Socket[bytes]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_SOCKETS:
                self._idle.append(sock)
                return
        sock.close(linger=0)

    def call(
        self,
        msg_type: MsgType,
        body: bytes = b"",
        *,
        timeout: float | None = None,
        wait_connect: bool = True,
    ) -> Reader:
        """Send one request and return a reader over the reply body.

        ``timeout`` bounds this call instead of the client's ``timeout``; with
        ``wait_connect=False`` a call finding no connection up fails at once instead of
        waiting for one. Raises :class:`ControllerUnavailableError` when no reply comes,
        and :class:`ControllerRefusedError` for an ``ERROR`` reply.
        """
        if self._generation != forks.generation():
            self._after_fork()
        self.check_up()
        self._down_error = None
        now = time.monotonic()
        request_id = next(self._ids)
        limit = self.timeout if timeout is None else timeout
        deadline = now + limit
        sock = self._checkout()
        frame = encode(msg_type, request_id, body)
        try:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                # Not connected (yet): the socket never queues for an absent controller.
                if not wait_connect:
                    raise ControllerUnavailableError(f"no controller at {self.endpoint}") from None
                self._wait_connected(sock, deadline)
                sock.send(frame, zmq.NOBLOCK)
            while True:
                if not sock.poll(self._remaining_ms(deadline), zmq.POLLIN):
                    raise ControllerUnavailableError(
                        f"controller {self.endpoint} did not answer within {limit:g}s"
                    )
                frame = sock.recv(zmq.NOBLOCK)
                header, reader = decode_header(frame)
                if header.request_id == request_id:
                    break  # anything else is a late reply to an abandoned request
        except BaseException as exc:
            # This socket may still get the reply (or hold the request): never reuse it.
            sock.close(linger=0)
            if isinstance(exc, ControllerUnavailableError | zmq.ZMQError):
                self.mark_down()
            if isinstance(exc, zmq.ZMQError):
                raise ControllerUnavailableError(f"controller {self.endpoint}: {exc}") from exc
            raise
        self._checkin(sock)
        self._down_until = 0.0
        self._down_error = None
        return self.answer(msg_type, header, reader)

    def answer(self, msg_type: MsgType, header: Header, reader: Reader) -> Reader:
        """The body of a reply to a ``msg_type`` request, its epoch and membership noted;
        :class:`ControllerRefusedError` for an ``ERROR`` reply, ProtocolError for a reply
        of another type."""
        self._note_epoch(header.epoch)
        self._note_membership(header.membership)
        if header.type == MsgType.ERROR:
            code, message = read_error(reader)
            known: ErrorCode | int = code
            with contextlib.suppress(ValueError):
                known = ErrorCode(code)
            error = UnknownNodeError if known == ErrorCode.UNKNOWN_NODE else ControllerRefusedError
            raise error(known, f"controller refused {msg_type.name}: {message} (code {code})")
        if header.type != msg_type | REPLY_BIT:
            raise ProtocolError(f"reply of type {header.type} to a {msg_type.name} request")
        return reader

    def _note_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            previous, self.epoch = self.epoch, epoch
            if previous and self.on_epoch_change is not None:
                self.on_epoch_change(epoch)

    def _note_membership(self, membership: int) -> None:
        # Only a change matters (a new controller starts counting again; its epoch says so).
        if membership != self.membership:
            previous, self.membership = self.membership, membership
            if previous and self.on_membership_change is not None:
                self.on_membership_change(membership)

    @staticmethod
    def _remaining_ms(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def close(self) -> None:
        """Close the idle sockets; a call in flight closes its own when it ends."""
        if self._generation != forks.generation():
            self._after_fork()  # the inherited sockets are the parent's to close
        with self._lock:
            self._closed = True
            sockets, self._idle = self._idle, []
        for sock in sockets:
            sock.close(linger=0)
