"""The ``tcp`` handshake: a challenge and response per connection; the key never travels.

Every connection opens the same way, whether or not the deployment has a secret::

    node   -> client  GREETING  header(count 33)  flags u8 | node nonce 32 B
                      (flags bit 0: TLS follows; the client starts it, the rest runs inside)
    client -> node    HELLO     header(count 64)  client nonce 32 B | client proof 32 B
    node   -> client  HELLO     header(count 32)  node proof 32 B
                      or an error header (AUTH_FAILED, BUSY, ...) and the node closes

A proof is HMAC-SHA256 under the transport's key (``TransportConfig.token``, derived from
the deployment's secret; empty without one) of a label naming the side and the
transcript: version, flags and both nonces. So the key never crosses the wire; a recorded
HELLO answers only the nonce of the connection it was recorded on (a fresh node nonce per
connection: a replay elsewhere is refused); the node's proof shows the client that the node
holds the key too (mutual); the two labels keep one side's proof from being reflected as
the other's; and the flags in the transcript keep the TLS offer from being stripped
unnoticed. A client without the secret computes proofs under the empty key, which match
only a node without one.

What it does not do without TLS: an attacker on the path can relay a handshake it cannot
compute and then inject or alter frames on that connection (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kvfabric.errors import ProtocolError
from kvfabric.transports.tcp.wire import VERSION

__all__ = [
    "FLAG_TLS",
    "GREETING_SIZE",
    "HELLO_SIZE",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "client_proof",
    "new_nonce",
    "pack_greeting",
    "server_proof",
    "unpack_greeting",
]

NONCE_SIZE = 32
PROOF_SIZE = hashlib.sha256().digest_size
FLAG_TLS = 1
_KNOWN_FLAGS = FLAG_TLS
GREETING_SIZE = 1 + NONCE_SIZE
HELLO_SIZE = NONCE_SIZE + PROOF_SIZE
_CLIENT = b"kvfabric tcp client proof"
_SERVER = b"kvfabric tcp server proof"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def pack_greeting(flags: int, nonce: bytes) -> bytes:
    return bytes([flags]) + nonce


def unpack_greeting(body: bytes) -> tuple[int, bytes]:
    """``(flags, node nonce)``; flags this version does not know are a ProtocolError."""
    flags = body[0]
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"the node sent handshake flags {flags:#x}, unknown to this client")
    return flags, bytes(body[1:])


def _transcript(flags: int, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return bytes([VERSION, flags]) + server_nonce + client_nonce


def client_proof(key: bytes, flags: int, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, _CLIENT + _transcript(flags, server_nonce, client_nonce), "sha256")


def server_proof(key: bytes, flags: int, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, _SERVER + _transcript(flags, server_nonce, client_nonce), "sha256")
