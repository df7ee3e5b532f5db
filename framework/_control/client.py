"""The client side of the control protocol: request/reply over ZeroMQ, bounded in time.

Each calling thread gets its own DEALER socket (ZeroMQ sockets are not thread-safe), so
concurrent lookups do not queue behind each other. A call that finds no connected controller
fails at once; one that gets no reply within ``timeout`` fails, its socket is replaced (so a
late reply or a queued request cannot surface later), and further calls fail fast for
``retry_interval`` before the next attempt. ZeroMQ reconnects on its own, so a restarted
controller is picked up without recreating anything; the reply's epoch tells that it restarted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import zmq

from kvfabric._control.security import Credentials
from kvfabric._wire.protocol import REPLY_BIT, ErrorCode, MsgType, decode_header, encode, read_error
from kvfabric.errors import ControllerUnavailableError, ProtocolError, RemoteError
from kvfabric.spi.codec import Reader

__all__ = ["ControlClient", "UnknownNodeError"]


class UnknownNodeError(RemoteError):
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
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.epoch = 0
        self._credentials = credentials
        self.on_epoch_change = on_epoch_change
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._local = threading.local()
        self._sockets: set[zmq.Socket[bytes]] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self._closed = False

    def _socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] | None = getattr(self._local, "socket", None)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.linger = 0
            sock.immediate = True  # never queue requests for a controller that is not there
            sock.reconnect_ivl = 100
            sock.reconnect_ivl_max = 1000
            if self._credentials is not None:
                self._credentials.secure_client(sock)
            sock.connect(self.endpoint)
            with self._lock:
                if self._closed:
                    sock.close()
                    raise ControllerUnavailableError("control client is closed")
                self._sockets.add(sock)
            self._local.socket = sock
        return sock

    def _drop_socket(self) -> None:
        sock: zmq.Socket[bytes] | None = getattr(self._local, "socket", None)
        if sock is not None:
            self._local.socket = None
            with self._lock:
                self._sockets.discard(sock)
            sock.close(linger=0)

    def call(self, msg_type: MsgType, body: bytes = b"") -> Reader:
        """Send one request and return a reader over the reply body."""
        now = time.monotonic()
        if now < self._down_until:
            raise ControllerUnavailableError(f"controller {self.endpoint} is down (retrying)")
        request_id = next(self._ids)
        deadline = now + self.timeout
        sock = self._socket()
        frame = encode(msg_type, request_id, body)
        try:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                # Not connected (yet): the socket never queues for an absent controller.
                if not sock.poll(self._remaining_ms(deadline), zmq.POLLOUT):
                    raise ControllerUnavailableError(f"no controller at {self.endpoint}") from None
                sock.send(frame, zmq.NOBLOCK)
            while True:
                if not sock.poll(self._remaining_ms(deadline), zmq.POLLIN):
                    raise ControllerUnavailableError(
                        f"controller {self.endpoint} did not answer within {self.timeout:g}s"
                    )
                frame = sock.recv(zmq.NOBLOCK)
                header, reader = decode_header(frame)
                if header.request_id == request_id:
                    break  # anything else is a late reply to an abandoned request
        except (ControllerUnavailableError, zmq.ZMQError) as exc:
            self._drop_socket()
            self._down_until = time.monotonic() + self.retry_interval
            if isinstance(exc, ControllerUnavailableError):
                raise
            raise ControllerUnavailableError(f"controller {self.endpoint}: {exc}") from exc
        self._down_until = 0.0
        self._note_epoch(header.epoch)
        if header.type == MsgType.ERROR:
            code, message = read_error(reader)
            if code == ErrorCode.UNKNOWN_NODE:
                raise UnknownNodeError(message)
            raise RemoteError(f"controller refused {msg_type.name}: {message} (code {code})")
        if header.type != msg_type | REPLY_BIT:
            raise ProtocolError(f"reply of type {header.type} to a {msg_type.name} request")
        return reader

    def _note_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            previous, self.epoch = self.epoch, epoch
            if previous and self.on_epoch_change is not None:
                self.on_epoch_change(epoch)

    @staticmethod
    def _remaining_ms(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            sock.close(linger=0)
