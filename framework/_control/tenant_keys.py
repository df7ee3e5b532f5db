"""What a tenant's secret derives, on both sides: its credential and its namespace.

A tenant is named on the controller (``--tenants FILE``) and in its clients' URL
(``tenant=NAME``, ``secret_file=``); both read the same secret and derive from it:

- the tenant's CurveZMQ client key pair: the controller admits its public key and learns
  the tenant of every frame from it (the key the handshake proved, never a field the client
  sends);
- the tenant's ``tcp`` data-plane key (scrypt, as the deployment's), which nodes accept
  beside the deployment's;
- the *scope key*, with which the client turns each of its keys into the index key it is
  stored under: the keyed hash ``h = BLAKE2b(key, key=scope)`` with bytes 8 to 12 replaced
  by the tenant's 4-byte tag (from its name). The controller sets the tag on every key a
  tenant's frame carries, so a tenant can address only keys with its own tag, whatever
  bytes it sends. The tag lies in bytes 8 to 16, which the index's lookup image keeps of
  each key and compares (bytes 0 to 8, which place a key in the image, stay the hash's).
  The keyed hash keeps anyone without the tenant's secret from telling which prompts an
  index key stands for.

Each derivation takes the tenant's name with its secret, so a secret presented under
another tenant's name proves nothing: the controller admits no such key.

The controller's own Curve key pair stays the deployment's; a tenant's client, which does
not hold that secret, is told the controller's public key (``controller_key=`` in its URL,
printed by the controller at start) so it still refuses anyone else posing as it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import attrs
import zmq
import zmq.utils.z85

from kvfabric._control.security import Credentials
from kvfabric.errors import ConfigError, NotSupportedError
from kvfabric.keys import KEY_SIZE

__all__ = [
    "TAG",
    "TAG_SIZE",
    "TenantKeys",
    "controller_key",
    "tenant_tag",
    "valid_tenant_name",
]

TAG_SIZE = 4
"""Bytes of a tenant's index keys that name the tenant."""
TAG = slice(8, 8 + TAG_SIZE)
"""Where in an index key the tag is."""


def valid_tenant_name(name: str) -> str:
    """``name`` if it can name a tenant (letters, digits, ``-``, ``_``; 1-64), else a
    ConfigError."""
    if not 1 <= len(name) <= 64 or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"not a tenant name: {name!r} (letters, digits, '-' and '_', at most 64)")
    return name


def tenant_tag(name: str) -> bytes:
    """The 4 bytes (at :data:`TAG`) that name the tenant in each of its index keys."""
    return hashlib.blake2b(name.encode(), digest_size=TAG_SIZE, person=b"kvfabric.tag").digest()


@functools.lru_cache(maxsize=64)
def _tenant_data_key(name: str, secret: bytes) -> bytes:
    """A tenant's tcp data-plane key: slow to derive, as its handshakes can be recorded."""
    salt = b"kvfabric.tenant." + name.encode()
    return hashlib.scrypt(secret, salt=salt, n=1 << 14, r=8, p=1, dklen=32)


def _derive(name: str, secret: bytes, purpose: bytes) -> bytes:
    named = bytes([len(name)]) + name.encode() + secret
    return hashlib.blake2b(named, digest_size=32, person=b"kvfabric.t" + purpose[:6]).digest()


def controller_key(credentials: Credentials) -> str:
    """The controller's public Curve key as a tenant's URL gives it (``controller_key=``):
    64 hex digits. Not Curve's own z85 text, whose alphabet has ``&``, ``#``, ``%`` and
    ``+``, which a URL reads as a separator, a fragment, an escape and a space."""
    return zmq.utils.z85.decode(credentials.server_public).hex()


@attrs.frozen
class TenantKeys:
    """What one tenant's secret derives (see the module's docstring)."""

    name: str
    tag: bytes
    client_public: bytes
    client_secret: bytes
    data_token: bytes
    scope: bytes = attrs.field(repr=False)

    @classmethod
    def from_secret(cls, name: str, secret: bytes) -> TenantKeys:
        if not zmq.has("curve"):
            raise NotSupportedError("this libzmq has no CURVE support; cannot use tenants")
        valid_tenant_name(name)
        client_secret = zmq.utils.z85.encode(_derive(name, secret, b"client"))
        return cls(
            name=name,
            tag=tenant_tag(name),
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
            data_token=_tenant_data_key(name, secret),
            scope=_derive(name, secret, b"scope"),
        )

    def client_credentials(self, controller_public: str) -> Credentials:
        """Credentials for this tenant's client of the controller whose public key is
        ``controller_public`` (64 hex digits, :func:`controller_key`)."""
        try:
            decoded = bytes.fromhex(controller_public)
        except ValueError:
            decoded = b""
        if len(decoded) != 32:
            raise ConfigError(
                f"controller_key={controller_public!r} is not a controller's public key "
                "(64 hex digits, as the controller prints it at start)"
            )
        return Credentials(
            server_public=zmq.utils.z85.encode(decoded),
            server_secret=b"",
            client_public=self.client_public,
            client_secret=self.client_secret,
            data_token=self.data_token,
        )

    def index_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The index keys the client's ``keys`` (checked already) are stored under."""
        scope, tag, blake2b = self.scope, self.tag, hashlib.blake2b
        out = []
        for key in keys:
            hashed = blake2b(key, digest_size=KEY_SIZE, key=scope).digest()
            out.append(hashed[:8] + tag + hashed[12:])
        return out
