"""Why a control-plane handshake failed, as both sides can tell it.

ZeroMQ refuses a peer whose secret differs (or that has none, or has one where the
controller has none) in its I/O thread, before any frame reaches either side's code: the
client's requests simply never leave, which looks the same as a controller that is not
there. Both sides can still learn what happened from their socket's monitor events:

- the controller (:mod:`kvfabric._control.auth_monitor`) sees a handshake fail with a
  *cryptographic* error (the client's secret differs) or a *mechanism mismatch* (one side
  has a secret and the other none; the controller knows which side it is);
- a client whose call finds no connection up makes a :class:`HandshakeProbe`: one
  short-lived socket with a monitor connects as the client's own sockets do, and the events
  it sees name the cause — the connection refused or never made (no controller there), the
  handshake failing (the secret: the call fails at once, naming it), or succeeding (the
  controller is there but did not answer).

A probe is made only by a call still unconnected after a short grace, and at most once per
retry interval of the client (calls fail fast in between): never on a call that finds its
connection up.
"""

from __future__ import annotations

import itertools
import socket
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvfabric._control.security import Credentials

__all__ = [
    "NO_SECRET",
    "OTHER",
    "REASON_WORDS",
    "UNEXPECTED_SECRET",
    "WRONG_SECRET",
    "HandshakeProbe",
    "refusal_reason",
]

WRONG_SECRET = "the client's secret differs from the controller's"
NO_SECRET = "the client has no secret and the controller requires one"
UNEXPECTED_SECRET = "the client has a secret and the controller has none"
OTHER = "the handshake failed"

REASON_WORDS = {
    WRONG_SECRET: "wrong_secret",
    NO_SECRET: "no_secret",
    UNEXPECTED_SECRET: "unexpected_secret",
    OTHER: "other",
}
"""Each reason and the word that names its counter (``auth_refused_<word>``)."""

_SECRET_HOW = "--secret-file, ?secret_file= or KVFABRIC_SECRET"
_probe_ids = itertools.count()


def refusal_reason(kind: int, value: int, *, secured: bool) -> str:
    """The reason for a failed handshake the controller's monitor saw (``kind``: the
    event, ``value``: its protocol error code); ``secured``: the controller has a secret."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return NO_SECRET if secured else UNEXPECTED_SECRET
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return WRONG_SECRET
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH and secured:
        return WRONG_SECRET  # the ZAP handler refused the client's key
    return OTHER


class HandshakeProbe:
    """A second connection to the controller, made as the client's own are, whose monitor
    events say why the client's socket has no connection; call :meth:`close` when done.

    :attr:`monitor` is polled beside the client's socket; :meth:`read` takes what it has.
    :attr:`refusal` is set (a sentence saying what to change) as soon as the handshake
    fails over the secret; :meth:`finding` says what was seen otherwise."""

    def __init__(
        self, context: zmq.Context[Any], endpoint: str, credentials: Credentials | None
    ) -> None:
        self.endpoint = endpoint
        self._secured = credentials is not None
        self.refusal: str | None = None
        self._connected = False
        self._refused_connection = False
        self._handshake_ok = False
        self._sock = context.socket(zmq.DEALER)
        self._sock.linger = 0
        if credentials is not None:
            credentials.secure_client(self._sock)
        self.monitor = self._sock.get_monitor_socket(
            addr=f"inproc://kvfabric-probe-{next(_probe_ids)}"
        )
        self._sock.connect(endpoint)

    def read(self) -> None:
        """Take the monitor events that have come."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            self._note(int(event["event"]), int(event["value"]))

    def _note(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_CONNECTED:
            self._connected = True
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshake_ok = True
        elif kind & _HANDSHAKE_FAILED:
            mechanism: bytes | None = b"NULL" if self._secured else b"CURVE"
            if kind != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL or (
                value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            ):
                # No detail (the controller hung up before this side read its greeting):
                # the greeting itself says whether the controller has a secret.
                mechanism = _server_mechanism(self.endpoint)
            self.refusal = self._refusal(mechanism)
        elif kind & (zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED) and not self._connected:
            self._refused_connection = True

    def _refusal(self, mechanism: bytes | None) -> str:
        """What to change, given the controller's security mechanism (None: unknown)."""
        where = f"the controller at {self.endpoint}"
        if self._secured and mechanism == b"NULL":
            return (
                f"{where} has no secret but this client has one: give both the same "
                f"secret, or neither ({_SECRET_HOW})"
            )
        if not self._secured and mechanism == b"CURVE":
            return (
                f"{where} requires a secret and this client has none: give it the "
                f"controller's secret ({_SECRET_HOW})"
            )
        if self._secured:
            return (
                f"{where} refused this client's secret (they differ): give it the "
                f"controller's secret ({_SECRET_HOW})"
            )
        return f"{where} refused the connection's handshake"

    def finding(self) -> str:
        """What was seen, for a call that got no connection in time."""
        where = f"the controller at {self.endpoint}"
        if self.refusal is not None:
            return self.refusal
        if self._handshake_ok:
            return f"{where} accepts connections but did not answer in time (overloaded?)"
        if self._refused_connection:
            return (
                f"no answer from {where}: nothing accepts connections there (is it "
                "running, and is the address right?)"
            )
        return (
            f"no answer from {where}: no connection within the time allowed (is it "
            "running, is the address right, does a firewall drop it?)"
        )

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)
        self._sock.close(linger=0)


def _server_mechanism(endpoint: str) -> bytes | None:
    """The security mechanism a ZeroMQ server at ``tcp://HOST:PORT`` names in its greeting
    (``CURVE``, ``NULL``), or None if it cannot be read. ZeroMQ reports a peer that hangs
    up on its greeting as a handshake failure with no detail; the greeting itself tells a
    controller without a secret from one whose secret differs."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        return None
    # ZMTP 3: the signature and the major version make the server send its whole
    # greeting; sending no more keeps it waiting for ours (it never sees a mismatch).
    greeting = b"\xff" + bytes(8) + b"\x7f\x03"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0) as sock:
            sock.sendall(greeting)
            received = b""
            while len(received) < 64:
                piece = sock.recv(64 - len(received))
                if not piece:
                    break
                received += piece
    except OSError:
        return None
    if len(received) < 32 or received[0] != 0xFF or received[9] != 0x7F:
        return None
    return received[12:32].rstrip(b"\0")


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
