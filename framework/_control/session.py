"""Large control requests: split into bounded chunks, pipelined on one socket, timed by work.

One request of a hundred thousand keys would hold the controller — one loop serving every
client — for as long as it takes, and every other client's call would wait behind it. A
large request is therefore sent as *chunks* of at most :data:`CHUNK_KEYS` items and
:data:`CHUNK_BYTES` encoded bytes. A :class:`ControlSession` sends them on one socket,
:data:`WINDOW` at a time (the next goes as a reply comes back), and matches each reply to
its request by id. The controller's ROUTER takes one message from each connection in turn,
so other clients' requests are served between a large request's chunks, and one socket
keeps the chunks in order (the records of an extent are published in the order they lie).

How long it waits: a session's exchange of ``n`` items must be answered within
``control_timeout + n x`` :data:`PER_ITEM_ALLOWANCE`, and each reply must come within
``control_timeout`` of the one before (or of the first request): a controller that stops
answering is noticed as soon as for a single call, one that works through a large request
is given the time the work takes. An exchange that timed out after the controller answered
some of its chunks says nothing against the controller, so it does not start the client's
"controller down" back-off; one the controller answered not at all does, as a call does.

A chunk left unanswered may still be served later: the session then closes its socket when
it ends (nothing late can surface on a reused socket), and the caller may first ask on the
same socket what became of it (the controller serves that question after the chunks, since
one connection's requests are served in order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import zmq

from kvfabric._runtime.codec import Reader
from kvfabric._wire.protocol import MsgType, decode_header, encode
from kvfabric.errors import ControllerUnavailableError, ProtocolError, RemoteError

if TYPE_CHECKING:
    from kvfabric._control.client import ControlClient

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_KEYS",
    "PER_ITEM_ALLOWANCE",
    "WINDOW",
    "ControlSession",
    "Reply",
    "chunks",
]

CHUNK_KEYS = 2048
"""Items (keys, grants, records) in one chunk: what the controller serves between two
other clients' requests, so a large batch delays them by one chunk's work at most
(docs/performance.md, "Control plane")."""
CHUNK_BYTES = 256 << 10
"""Encoded bytes of one chunk, at most (a controller's ``--max-frame`` must exceed it)."""
WINDOW = 4
"""Chunks of one exchange in flight at once: the controller always has the next queued."""
PER_ITEM_ALLOWANCE = 250e-6
"""Seconds a request's deadline grows by per item: some twenty times what the costliest
request (allocate) costs an idle controller per key, so a large request is cut short by
neither its size nor a busy host (each chunk must still come within ``control_timeout`` of
the one before, so a controller that stopped is noticed as soon as for one call)."""

Reply: TypeAlias = "Reader | RemoteError | ProtocolError | None"
"""One chunk's outcome: the reply's body, the error it was answered with (the chunk had no
effect), or None: no reply in time (it may or may not have been served)."""


def chunks(count: int, item_bytes: int, *, keys: int = CHUNK_KEYS) -> list[range]:
    """Positions ``0..count`` cut into chunks of at most ``keys`` items and
    :data:`CHUNK_BYTES` bytes of ``item_bytes`` each (at least one item a chunk)."""
    per = max(1, min(keys, CHUNK_BYTES // max(item_bytes, 1)))
    return [range(start, min(start + per, count)) for start in range(0, count, per)] or [range(0)]


def allowance(items: int, timeout: float) -> float:
    """The deadline of a request of ``items`` items, for a client whose calls are bounded
    by ``timeout`` (see the module's docstring)."""
    return timeout + items * PER_ITEM_ALLOWANCE


class ControlSession:
    """Requests on one control socket of a :class:`ControlClient`, pipelined; use as a
    context manager (the socket goes back to the pool, or is closed if a request was left
    unanswered)."""

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        client.check_up()
        self._sock: zmq.Socket[bytes] | None = client.checkout()
        self._unanswered = False
        self._answered = False
        self._sent = False
        self.epochs: set[int] = set()
        """The controller epochs of the replies so far (two: it restarted meanwhile)."""

    def __enter__(self) -> ControlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._unanswered:
            # A late reply, or a request still queued, must never surface on a reused socket.
            sock.close(linger=0)
            if not self._answered:
                self._client.mark_down()
        else:
            self._client.checkin(sock)

    @property
    def answered(self) -> bool:
        """Whether the controller answered any request of this session."""
        return self._answered

    @property
    def silent(self) -> bool:
        """Whether a request of this session went unanswered (timed out or not sent)."""
        return self._unanswered

    def exchange(
        self,
        msg_type: MsgType,
        bodies: Sequence[bytes],
        *,
        items: int,
        enough: Callable[[int, Reader], bool] | None = None,
    ) -> list[Reply]:
        """Send ``bodies`` (chunks of one request of ``items`` items, in order) and collect
        their replies: one :data:`Reply` per body. ``enough(i, reply)``: True when no chunk
        after ``i`` is needed (a lookup that found a gap); those are not sent (None).

        Raises :class:`ControllerUnavailableError` only when nothing of this session
        could be sent (no controller connected): nothing was served.
        """
        sock = self._sock
        if sock is None:
            raise ControllerUnavailableError("control session is closed")
        client = self._client
        now = time.monotonic()
        deadline = now + allowance(items, client.timeout)
        quiet_until = now + client.timeout
        replies: list[Reply] = [None] * len(bodies)
        waiting: dict[int, int] = {}  # request id -> position
        sent = 0
        stop = False
        try:
            while True:
                while not stop and sent < len(bodies) and len(waiting) < WINDOW:
                    request_id = client.next_request_id()
                    if not self._send(sock, encode(msg_type, request_id, bodies[sent]), deadline):
                        self._unanswered = True  # the rest is not sent: not answered either
                        stop = True
                        break
                    waiting[request_id] = sent
                    sent += 1
                if not waiting:
                    break
                if not sock.poll(_remaining_ms(min(deadline, quiet_until)), zmq.POLLIN):
                    break
                try:
                    header, reader = decode_header(sock.recv(zmq.NOBLOCK))
                except ProtocolError:
                    continue  # not a reply to anything: its request stays unanswered
                position = waiting.pop(header.request_id, None)
                if position is None:
                    continue  # a late reply to a request of an earlier exchange
                quiet_until = time.monotonic() + client.timeout
                self._answered = True
                self.epochs.add(header.epoch)
                try:
                    replies[position] = client.answer(msg_type, header, reader)
                except (RemoteError, ProtocolError) as exc:
                    replies[position] = exc
                    continue
                if enough is not None and enough(position, reader):
                    stop = True
        except zmq.ZMQError as exc:
            self._unanswered = True
            if not self._sent:
                raise ControllerUnavailableError(f"controller {client.endpoint}: {exc}") from exc
        finally:
            # Sent and not answered (timed out, or the caller's ``enough`` raised): this
            # socket may still get those replies, so it is never reused.
            if waiting:
                self._unanswered = True
        return replies

    def _send(self, sock: zmq.Socket[bytes], frame: bytes, deadline: float) -> bool:
        """Send one chunk; False when it could not go before the deadline (the rest are
        not sent). Raises when nothing of this session could be sent (no connection up),
        as a call would."""
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            # Not connected (yet), or the pipe is full: the socket never queues for an
            # absent controller.
            if not sock.poll(_remaining_ms(deadline), zmq.POLLOUT):
                if not self._sent:
                    self._unanswered = True
                    raise ControllerUnavailableError(
                        f"no controller at {self._client.endpoint}"
                    ) from None
                return False
            sock.send(frame, zmq.NOBLOCK)
        self._sent = True
        return True


def _remaining_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
