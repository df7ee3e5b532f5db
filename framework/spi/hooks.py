"""The hooks kvfabric plugins implement (pluggy project name ``kvfabric``).

pluggy carries discovery and lifecycle only: a plugin's registration hook adds classes to a
registry, and from then on the data path uses plain method calls on those classes. Hooks are
always called with keyword arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvfabric.spi.backend import Backend
    from kvfabric.spi.index import IndexPlugin
    from kvfabric.spi.registry import Registry
    from kvfabric.spi.transport import Transport

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("kvfabric")
hookimpl = pluggy.HookimplMarker("kvfabric")


@hookspec
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    """Add transport classes: ``registry.add("ucx", UcxTransport)``.

    Called when a plugin module is registered (its entry point in group
    ``kvfabric.transports`` was selected by name).
    """


@hookspec
def kvfabric_register_backends(registry: Registry[Backend]) -> None:
    """Add backend classes: ``registry.add("dram", DramBackend)``.

    Called when a plugin module of group ``kvfabric.backends`` is registered.
    """


@hookspec
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    """Add index classes: ``registry.add("memory", MemoryIndex)``.

    Called when a plugin module of group ``kvfabric.indexes`` is registered.
    """


@hookspec
def kvfabric_configure(config: Mapping[str, Any]) -> None:
    """Receive a store's configuration (the parsed URL options) when it connects.

    Called once per ``kvfabric.connect``, for the plugins registered at that moment; nothing
    is kept for plugins registered later, so connecting leaves no process-wide state behind.
    """


@hookspec
def kvfabric_lookup_done(keys: Sequence[bytes], hits: int) -> None:
    """Observe a prefix lookup: ``hits`` leading ``keys`` were found.

    Called off the hot path, from a background thread, after the lookup returned; only when
    some plugin implements it.
    """
