"""kvfabric: a remote KV-cache tier for LLM serving.

``kvfabric.connect(url)`` gives a :class:`Store`; ``await kvfabric.connect_async(url)`` an
:class:`AsyncStore`. Keys are 32-byte content addresses made with :func:`chain_key` (from
tokens) or :func:`fold_key` (from an engine's own hash).

Reads (``batched_contains``, ``batched_exists``, ``batched_get``, ``batched_get_scattered``,
``locate``) never raise because a controller, a data node or a transport failed: the failure
is counted in ``stats()`` and reads as a miss; ``batched_put`` answers ``PutOutcome.FAILED``
and ``delete`` 0. Only programming errors raise (a bad key, ``into`` of the wrong length, a
value over ``max_value``).
"""

from __future__ import annotations

import asyncio

from kvfabric._client.aio import AsyncStore
from kvfabric._client.store import PutOutcome, Store
from kvfabric._plugins import PluginManager, plugin_manager
from kvfabric.descriptor import Descriptor
from kvfabric.errors import (
    ConfigError,
    ControllerUnavailableError,
    InvalidKeyError,
    KvfabricError,
    NameInUseError,
    NotSupportedError,
    PluginError,
    PluginNotFoundError,
    PluginUnavailableError,
    ProtocolError,
    RemoteError,
    TransportError,
    TransportTimeoutError,
    ValidationError,
    ValueTooLargeError,
)
from kvfabric.keys import KEY_SIZE, ROOT_KEY, chain_key, chain_keys, fold_key
from kvfabric.spi.events import EngineBlock
from kvfabric.urls import EmbeddedOptions, RemoteOptions, options_dict, parse_url

__version__ = "0.1.0"

__all__ = [
    "KEY_SIZE",
    "ROOT_KEY",
    "AsyncStore",
    "ConfigError",
    "ControllerUnavailableError",
    "Descriptor",
    "EngineBlock",
    "InvalidKeyError",
    "KvfabricError",
    "NameInUseError",
    "NotSupportedError",
    "PluginError",
    "PluginNotFoundError",
    "PluginUnavailableError",
    "ProtocolError",
    "PutOutcome",
    "RemoteError",
    "Store",
    "TransportError",
    "TransportTimeoutError",
    "ValidationError",
    "ValueTooLargeError",
    "__version__",
    "chain_key",
    "chain_keys",
    "connect",
    "connect_async",
    "fold_key",
]


def connect(url: str = "embedded://", *, plugins: PluginManager | None = None) -> Store:
    """Open a store.

    ``embedded://?capacity=256MiB`` runs everything in this process;
    ``kvfabric://HOST:PORT`` connects to a controller (``kvfabric serve`` or
    ``kvfabric controller``) and its data nodes.
    """
    parsed = parse_url(url)
    plugins = plugins or plugin_manager()
    plugins.pm.hook.kvfabric_configure(config={"url": url, **options_dict(parsed.options)})
    if isinstance(parsed.options, EmbeddedOptions):
        from kvfabric._client.embedded import open_embedded

        return open_embedded(parsed.options, parsed.host, plugins)
    if isinstance(parsed.options, RemoteOptions):
        from kvfabric._client.remote import open_remote

        assert parsed.port is not None
        return open_remote(parsed.options, parsed.host, parsed.port, plugins)
    raise AssertionError(f"scheme {parsed.scheme} parsed but not handled")


async def connect_async(
    url: str = "embedded://", *, plugins: PluginManager | None = None
) -> AsyncStore:
    """Open a store for asyncio code; connecting runs off the event loop too."""
    store = await asyncio.to_thread(connect, url, plugins=plugins)
    return AsyncStore(store)
