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
    from kvfabric.spi.plugins import Registry

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("kvfabric")
hookimpl = pluggy.HookimplMarker("kvfabric")


@hookspec
def kvfabric_register_transports(registry: Registry[Any]) -> None:
    """Add transport classes: ``registry.add("ucx", UcxTransport)``.

    Called when a plugin module is registered (its entry point in group
    ``kvfabric.transports`` was selected by name).
    """


@hookspec
def kvfabric_register_backends(registry: Registry[Any]) -> None:
    """Add backend classes: ``registry.add("dram", DramBackend)``.

    Called when a plugin module of group ``kvfabric.backends`` is registered.
    """


@hookspec(historic=True)
def kvfabric_configure(config: Mapping[str, Any]) -> None:
    """Receive the process's kvfabric configuration (the parsed URL options).

    Historic: a plugin registered later is called with every configuration seen so far.
    """


@hookspec
def kvfabric_lookup_done(keys: Sequence[bytes], hits: int) -> None:
    """Observe a prefix lookup: ``hits`` leading ``keys`` were found.

    Called off the hot path, from a background thread, after the lookup returned; only when
    some plugin implements it.
    """
