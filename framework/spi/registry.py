"""The registry a plugin's registration hook fills: name → plugin class of one kind.

``kvfabric_register_transports(registry)`` and its siblings receive one; ``registry.add``
checks the class as pluggy checks hook implementations (the right base class, a ``name``
equal to the registered one, capabilities and well-formed options), so a malformed plugin
fails at load with an error naming the plugin, the hook and what is wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, Literal, TypeVar

from kvfabric.errors import PluginError
from kvfabric.spi.options import OptionSpec, Plugin
from kvfabric.spi.transport import Capabilities

__all__ = ["Kind", "Registry"]

Kind = Literal["transport", "backend", "index", "adapter"]

P = TypeVar("P", bound=Plugin)


class Registry(Generic[P]):
    """Name → plugin class of one kind, filled by the registration hooks and checked there."""

    def __init__(self, kind: Kind, base: type[Plugin]) -> None:
        # ``base`` is abstract, so it is typed as the root plugin class (mypy's type-abstract).
        self.kind = kind
        self.base = base
        self._items: dict[str, type[P]] = {}
        self._source = "a direct call"

    def add(self, name: str, cls: type[P]) -> None:
        """Register ``cls`` as ``name``; raises :class:`PluginError` if it is malformed."""
        problem = _check_plugin_class(self.kind, self.base, name, cls)
        if problem:
            raise PluginError(
                f"{self._source} registered {self.kind} {name!r} ({cls!r}), which {problem}"
            )
        known = self._items.get(name)
        if known is not None and known is not cls:
            raise PluginError(f"two {self.kind}s are registered as {name!r}: {known!r}, {cls!r}")
        self._items[name] = cls

    def get(self, name: str) -> type[P] | None:
        return self._items.get(name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _check_plugin_class(kind: Kind, base: type[Plugin], name: str, cls: Any) -> str:
    """What is wrong with a plugin class, or "" when nothing is."""
    if not isinstance(cls, type) or not issubclass(cls, base):
        return f"is not a subclass of kvfabric.spi.{base.__name__}"
    if getattr(cls, "name", None) != name:
        return f"declares name {getattr(cls, 'name', None)!r} (must equal {name!r})"
    options = getattr(cls, "options", ())
    if not isinstance(options, tuple) or not all(isinstance(o, OptionSpec) for o in options):
        return "declares options that are not a tuple of kvfabric.spi.OptionSpec"
    if kind == "transport":
        if not isinstance(getattr(cls, "capabilities", None), Capabilities):
            return "declares no capabilities (a kvfabric.spi.Capabilities class attribute)"
        if not isinstance(getattr(cls, "preference", None), int):
            return "declares a preference that is not an int"
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        return f"leaves abstract methods unimplemented: {', '.join(abstract)}"
    return ""
