"""Plugin discovery and selection by name.

Transports, backends and adapters are found through entry-point groups
(``kvfabric.transports``, ``kvfabric.backends``, ``kvfabric.adapters``); the built-ins are
registered through the same entry points as third-party plugins. Selecting a name loads only
that entry point, so choosing ``tcp`` never imports UCX.

pluggy's ``load_setuptools_entrypoints`` registers a plugin under the bare entry-point name,
so a transport and a backend of the same name would shadow each other; we load the single
entry point ourselves and register it as ``<group>:<name>`` instead.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterator
from importlib import metadata
from typing import Any, Generic, Literal, TypeVar

import attrs
import pluggy

from kvfabric.errors import PluginError, PluginNotFoundError, PluginUnavailableError
from kvfabric.spi import hooks as hookspecs

__all__ = [
    "GROUPS",
    "InstalledPlugin",
    "PluginManager",
    "Registry",
    "installed_plugins",
    "plugin_manager",
]

Kind = Literal["transport", "backend", "adapter"]
GROUPS: dict[Kind, str] = {
    "transport": "kvfabric.transports",
    "backend": "kvfabric.backends",
    "adapter": "kvfabric.adapters",
}
# Plugins that ship with kvfabric behind an extra: a missing one gets the exact pip command.
_EXTRAS: dict[tuple[Kind, str], str] = {
    ("transport", "ucx"): "ucx",
    ("transport", "verbs"): "verbs",
    ("adapter", "lmcache"): "lmcache",
    ("adapter", "vllm"): "vllm",
}

T = TypeVar("T")


def install_hint(kind: Kind, name: str) -> str:
    extra = _EXTRAS.get((kind, name))
    if extra is None:
        return ""
    return f"pip install 'kvfabric[{extra}]'"


class Registry(Generic[T]):
    """Name → plugin class, filled by the registration hooks."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> None:
        known = self._items.get(name)
        if known is not None and known is not obj:
            raise PluginError(f"two {self.kind}s are registered as {name!r}: {known!r}, {obj!r}")
        self._items[name] = obj

    def get(self, name: str) -> T | None:
        return self._items.get(name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


@attrs.frozen(kw_only=True)
class InstalledPlugin:
    kind: Kind
    name: str
    target: str
    distribution: str
    version: str


def installed_plugins(kind: Kind | None = None) -> list[InstalledPlugin]:
    """Every entry point in kvfabric's groups (or one kind's group), without loading any."""
    found: list[InstalledPlugin] = []
    kinds: list[Kind] = [kind] if kind else list(GROUPS)
    for k in kinds:
        for ep in metadata.entry_points(group=GROUPS[k]):
            dist = ep.dist
            found.append(
                InstalledPlugin(
                    kind=k,
                    name=ep.name,
                    target=ep.value,
                    distribution=dist.metadata["Name"] if dist else "?",
                    version=dist.version if dist else "?",
                )
            )
    return sorted(found, key=lambda p: (p.kind, p.name))


def _not_found(kind: Kind, name: str) -> PluginNotFoundError:
    names = sorted({p.name for p in installed_plugins(kind)})
    known = sorted(names + [n for (k, n) in _EXTRAS if k == kind and n not in names])
    message = f"no {kind} named {name!r}; installed: {', '.join(names) or 'none'}"
    close = difflib.get_close_matches(name, known, n=1)
    if close and close[0] != name:
        message += f"; did you mean {close[0]!r}?"
        name = close[0]
    hint = "" if name in names else install_hint(kind, name)
    if hint:
        message += f"; it ships as an extra: {hint}"
    return PluginNotFoundError(message)


class PluginManager:
    """kvfabric's pluggy manager plus the registries its hooks fill."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("kvfabric")
        self.pm.add_hookspecs(hookspecs)
        self.transports: Registry[Any] = Registry("transport")
        self.backends: Registry[Any] = Registry("backend")
        self._lock = threading.RLock()

    def register(self, plugin: object, name: str) -> None:
        """Register a plugin object directly (no entry point) and run its registration hooks."""
        with self._lock:
            if self.pm.get_plugin(name) is None:
                self.pm.register(plugin, name=name)
            self._run_registration_hooks()

    def transport(self, name: str) -> Any:
        """The transport class registered as ``name``, loading its entry point if needed."""
        return self._select("transport", self.transports, name)

    def backend(self, name: str) -> Any:
        """The backend class registered as ``name``, loading its entry point if needed."""
        return self._select("backend", self.backends, name)

    def _select(self, kind: Kind, registry: Registry[Any], name: str) -> Any:
        with self._lock:
            cls = registry.get(name)
            if cls is None:
                self._load_entry_point(kind, name)
                cls = registry.get(name)
                if cls is None:
                    raise PluginError(
                        f"entry point {name!r} in group {GROUPS[kind]} registered no {kind} "
                        f"named {name!r}; its plugin must implement "
                        f"kvfabric_register_{kind}s(registry)"
                    )
        try:
            cls.check_available()
        except PluginUnavailableError as exc:
            hint = install_hint(kind, name) or getattr(cls, "install_hint", "")
            if hint and hint not in str(exc):
                raise PluginUnavailableError(f"{exc}; install it with: {hint}") from exc
            raise
        return cls

    def _load_entry_point(self, kind: Kind, name: str) -> None:
        group = GROUPS[kind]
        matches = metadata.entry_points(group=group).select(name=name)
        entry = next(iter(matches), None)
        if entry is None:
            raise _not_found(kind, name)
        try:
            plugin = entry.load()
        except ImportError as exc:
            hint = install_hint(kind, name)
            message = f"{kind} {name!r} is installed but cannot be imported: {exc}"
            raise PluginUnavailableError(message + (f"; {hint}" if hint else "")) from exc
        plugin_name = f"{group}:{name}"
        if self.pm.get_plugin(plugin_name) is None:
            self.pm.register(plugin, name=plugin_name)
        self._run_registration_hooks()

    def _run_registration_hooks(self) -> None:
        self.pm.hook.kvfabric_register_transports(registry=self.transports)
        self.pm.hook.kvfabric_register_backends(registry=self.backends)


_default: PluginManager | None = None
_default_lock = threading.Lock()


def plugin_manager() -> PluginManager:
    """The process-wide plugin manager."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default
