"""Keys derived from one shared secret: CurveZMQ on the control plane, a key on TCP data.

Every process of a deployment is given the same secret (``--secret-file`` or the
``KVFABRIC_SECRET`` environment variable). From it each side derives the controller's Curve
key pair, one client key pair that the controller's ZAP handler admits, and the TCP data
plane's key — so knowing the secret is the credential, and nothing else is exchanged.

The TCP data key never crosses the wire: the tcp transport proves it per connection with a
challenge and response (``kvfabric.transports.tcp.auth``). A recorded handshake still lets
an eavesdropper test guesses of the secret offline, so that key is derived with scrypt
(2^14 rounds, 16 MiB, paid once per secret per process) rather than a fast hash; a
secret of 32 random bytes is out of reach either way (docs/security.md).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

import attrs
import zmq
import zmq.utils.z85

from kvfabric.errors import ConfigError, NotSupportedError

__all__ = ["Credentials", "load_secret"]


def load_secret(secret_file: str | None = None) -> bytes | None:
    """The secret from a file (if given) or ``KVFABRIC_SECRET``; None when neither is set."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read secret file {secret_file}: {exc}") from exc
    else:
        secret = os.environ.get("KVFABRIC_SECRET", "").encode()
    if secret_file and not secret:
        raise ConfigError(f"secret file {secret_file} is empty")
    return secret or None


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=32, person=b"kvfabric." + purpose[:6]).digest()


@functools.lru_cache(maxsize=8)
def _data_key(secret: bytes) -> bytes:
    """The tcp data plane's key: slow to derive, since its handshakes can be recorded."""
    return hashlib.scrypt(secret, salt=b"kvfabric.tcpdat", n=1 << 14, r=8, p=1, dklen=32)


@attrs.frozen
class Credentials:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    data_token: bytes
    """The tcp data plane's key (``TransportConfig.token``); it never crosses the wire."""

    @classmethod
    def from_secret(cls, secret: bytes) -> Credentials:
        if not zmq.has("curve"):
            raise NotSupportedError("this libzmq has no CURVE support; cannot use a secret")
        server_secret = zmq.utils.z85.encode(_derive(secret, b"server"))
        client_secret = zmq.utils.z85.encode(_derive(secret, b"client"))
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
            data_token=_data_key(secret),
        )

    def secure_client(self, socket: zmq.Socket[Any]) -> None:
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret

    def secure_server(self, socket: zmq.Socket[Any]) -> None:
        socket.curve_server = True
        socket.curve_publickey = self.server_public
        socket.curve_secretkey = self.server_secret
