"""Options a plugin declares as data, and their parsing from URLs and the command line.

A plugin lists what it reads (``options = (OptionSpec(name="pool", parse=int, default=8,
help="..."),)``). Users address them by the plugin's name: ``?tcp.pool=4`` in a store URL,
``--transport-opt tcp.pool=4`` on the command line. An option the plugin did not declare
is refused with the list of those it did; the plugin receives every declared option, parsed
or defaulted, and never a string it has to check itself.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvfabric.errors import ConfigError, PluginUnavailableError

__all__ = [
    "OptionSpec",
    "Plugin",
    "parse_bool",
    "parse_plugin_options",
]


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {text!r} (use true or false)")


@attrs.frozen(kw_only=True)
class OptionSpec:
    """One option a plugin reads: its name, how to parse it, its default, what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str

    def describe(self) -> str:
        return f"{self.name} (default {self.default!r}): {self.help}"


def parse_plugin_options(
    plugin: str, specs: Sequence[OptionSpec], raw: Mapping[str, str | Any]
) -> dict[str, Any]:
    """Every declared option, parsed from ``raw`` or defaulted; unknown names are refused."""
    known = {spec.name: spec for spec in specs}
    for name in raw:
        if name not in known:
            accepted = ", ".join(sorted(known)) or "none"
            message = f"{plugin} has no option {name!r}; it accepts: {accepted}"
            close = difflib.get_close_matches(name, list(known), n=1)
            if close:
                message += f"; did you mean {plugin}.{close[0]}?"
            raise ConfigError(message)
    values: dict[str, Any] = {}
    for spec in specs:
        if spec.name not in raw:
            values[spec.name] = spec.default
            continue
        text = raw[spec.name]
        try:
            values[spec.name] = spec.parse(text) if isinstance(text, str) else text
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"option {plugin}.{spec.name}={text!r}: {exc}") from None
    return values


class Plugin:
    """What every plugin class declares as data, before any instance exists."""

    name: ClassVar[str]
    """The name users select it by (its entry point's name)."""
    options: ClassVar[tuple[OptionSpec, ...]] = ()
    """Options it reads, addressed as ``NAME.OPTION`` by users."""
    install_hint: ClassVar[str] = ""
    """The command that installs what it needs, shown when it is unavailable."""

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`~kvfabric.errors.PluginUnavailableError` if a dependency is missing.

        Native libraries are imported here or later, never at module import.
        """

    @classmethod
    def parse_options(cls, raw: Mapping[str, str | Any]) -> dict[str, Any]:
        """This plugin's options from user input: every declared one, parsed or defaulted."""
        return parse_plugin_options(cls.name, cls.options, raw)

    @classmethod
    def unavailable(cls, reason: str) -> PluginUnavailableError:
        """A :class:`PluginUnavailableError` carrying the install hint."""
        hint = f"; install it with: {cls.install_hint}" if cls.install_hint else ""
        return PluginUnavailableError(f"{cls.name}: {reason}{hint}")
