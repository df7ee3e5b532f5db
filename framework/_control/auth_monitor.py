"""The controller's side of failed handshakes: who was refused, why, and how often.

ZeroMQ refuses a peer whose secret differs (or that has none, or has one where the
controller has none) inside its I/O thread, before any frame reaches the controller's loop;
all the loop would see is nothing. :class:`RefusalMonitor` watches the ROUTER socket's
monitor events on a thread of its own: each refused handshake is counted (``auth_refused``
and ``auth_refused_<reason>`` in the controller's stats) and logged with the peer's address
and the reason, a line a minute per peer host and reason
(:class:`~kvfabric._runtime.log_limit.LimitedLog`).

The peer's address is read from the connection's descriptor when ZeroMQ reports it accepted
(``EVENT_ACCEPTED`` carries only the descriptor; the failure events carry neither, and the
descriptor is closed by the time they are read). A peer that fails its handshake faster than
this thread wakes is logged as ``an unknown address``: the count and the reason stay exact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections import Counter
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvfabric._control.handshake import REASON_WORDS, refusal_reason
from kvfabric._runtime.log_limit import LimitedLog

__all__ = ["REFUSAL_COUNTERS", "RefusalMonitor"]

log = logging.getLogger("kvfabric._control.controller")

REFUSAL_COUNTERS = ("auth_refused", *(f"auth_refused_{r}" for r in REASON_WORDS))
"""The counters this adds to the controller's stats: every refused handshake, and per
reason (``wrong_secret``, ``no_secret``, ``unexpected_secret``, ``other``)."""

# A handshake failing with no detail is a peer hanging up half-way (a port scanner, a
# client stopped, a client's probe reading the greeting): never a secret problem, which
# ZeroMQ reports as a protocol (cryptographic, mechanism) or ZAP failure.
_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _FAILURES
# How often the thread looks up from an idle monitor to see if it should stop.
_POLL_MS = 200
# Accepted connections whose peer is remembered, at most (a flood of strangers that never
# finish their handshake must not grow this without bound).
_MAX_PEERS = 4096


def _peer_of(fd: int) -> str | None:
    """The remote address of the connected socket ``fd``, or None if it is gone."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as sock:
            address = sock.getpeername()
    except OSError:
        return None
    if isinstance(address, tuple):
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(address) or None


class RefusalMonitor:
    """Counts and logs the handshakes a ROUTER socket refuses; call :meth:`close` when done.

    ``secured``: whether the controller has a secret (it words the reasons)."""

    def __init__(self, sock: zmq.Socket[Any], *, secured: bool) -> None:
        self._secured = secured
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._limited = LimitedLog(log)
        self._peers: dict[int, str | None] = {}
        self._failed: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfabric-auth-monitor", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"auth_refused": 0, **self._counts}

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._monitor.poll(_POLL_MS):
                    continue
                event = parse_monitor_message(self._monitor.recv_multipart())
            except zmq.ZMQError:
                return
            self._handle(int(event["event"]), int(event["value"]))

    def _handle(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            if len(self._peers) >= _MAX_PEERS:
                self._peers.clear()
            self._peers[value] = _peer_of(value)
        elif kind & _FAILURES:
            # The descriptor comes with the DISCONNECTED event that follows at once.
            self._failed = refusal_reason(kind, value, secured=self._secured)
        elif kind == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, None)
            reason, self._failed = self._failed, None
            if reason is not None:
                self._refused(peer, reason)

    def _refused(self, peer: str | None, reason: str) -> None:
        word = REASON_WORDS.get(reason, "other")
        with self._lock:
            self._counts["auth_refused"] += 1
            self._counts[f"auth_refused_{word}"] += 1
        host = peer.rpartition(":")[0] if peer else None
        self._limited.warning(
            (host, word),
            "controller: refused a connection from %s: %s",
            peer or "an unknown address",
            reason,
        )

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(zmq.ZMQError):
            self._monitor.close(linger=0)
