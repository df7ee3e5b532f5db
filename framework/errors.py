"""The one exception root of kvfabric and its subclasses.

Every subclass also inherits the builtin that fits it, so callers that only know the
builtins (``except LookupError``, ``except TimeoutError``) still catch the right things.
Native exceptions are mapped at the transport boundary: ``raise TransportError(...) from exc``.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ControllerUnavailableError",
    "InvalidKeyError",
    "KvfabricError",
    "NameInUseError",
    "NotSupportedError",
    "PluginError",
    "PluginNotFoundError",
    "PluginUnavailableError",
    "ProtocolError",
    "RegistrationInterruptedError",
    "RemoteError",
    "TransportError",
    "TransportTimeoutError",
    "ValidationError",
    "ValueTooLargeError",
]


class KvfabricError(Exception):
    """Root of every error kvfabric raises on purpose."""


class ConfigError(KvfabricError, ValueError):
    """A URL, option or argument is not acceptable; the message says what is."""


class InvalidKeyError(KvfabricError, ValueError):
    """A key is not 32 bytes."""


class PluginError(KvfabricError, LookupError):
    """A plugin could not be found, loaded or used."""


class PluginNotFoundError(PluginError):
    """No installed plugin has that name in that group."""


class PluginUnavailableError(PluginError, ImportError):
    """The plugin exists but a dependency it needs is not installed (message has the hint)."""


class NotSupportedError(KvfabricError, TypeError):
    """A plugin lacks a capability the caller asked for (checked before anything is started)."""


class ValueTooLargeError(KvfabricError, ValueError):
    """A value is larger than the store accepts."""


class ValidationError(KvfabricError, ValueError):
    """A landed record does not match what was asked for; readers turn it into a miss."""


class ProtocolError(KvfabricError, ValueError):
    """A malformed or unknown frame on the wire."""


class RemoteError(KvfabricError, RuntimeError):
    """A server answered a request with an error reply."""


class NameInUseError(RemoteError):
    """A data node registered under a name a live node of another process holds; it is
    released once that node falls silent (or deregisters)."""


class TransportError(KvfabricError, OSError):
    """Moving bytes to or from a data node failed."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A data node did not answer within the configured timeout."""


class ControllerUnavailableError(KvfabricError, ConnectionError):
    """The controller cannot be reached; lookups read as misses and puts are dropped."""


class AuthenticationError(ControllerUnavailableError, PermissionError):
    """The controller refused this process's secret (a different one, none where it needs
    one, or one where it has none); the message says which and what to change."""


class RegistrationInterruptedError(ControllerUnavailableError):
    """An index took a node's registration, then was lost before the registration was
    complete: clients may already have written to the node, so its memory may hold records
    (the node scans it when it registers again)."""
