"""Where a command's options come from besides its flags: ``KVFABRIC_*`` variables and a TOML file.

Precedence, highest first: flags on the command line, then environment variables, then the
config file, then the built-in defaults. Every option ``--foo-bar`` of a command can be
set as ``KVFABRIC_FOO_BAR`` (an empty variable counts as unset) and, in the file named by
``--config FILE`` (or ``KVFABRIC_CONFIG``), as the key ``foo_bar`` or ``foo-bar``, either
at the top level (for every command that has that option) or in a table named after the
command (``[node]``, ``[controller]``, ``[serve]``, ``[stats]``), which wins over the top
level. TOML values are strings, numbers or booleans (``capacity = "64GiB"``,
``metrics_port = 9100``); a repeatable option (``--transport-opt``) takes a list, or a
comma-free string for one value, and from the environment one value.

What cannot be right is refused before anything starts, naming where it came from: a key
no command has (with the nearest names), a table no command has, a key the table's command
does not take, a value that does not parse (a size, a duration, a port, a choice), in the
file (``FILE: [node] capacity``) or the environment (``KVFABRIC_CAPACITY``). Deprecated
spellings of options (hidden from ``--help``) are flags only.

Values are applied as the command parser's defaults, so a flag given on the command line
still wins and argparse converts them exactly as it converts flags.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any

import tomllib

from kvfabric.errors import ConfigError
from kvfabric.spi import parse_bool, parse_duration, parse_size

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "apply_sources", "commands_of", "env_name", "options_of"]

ENV_PREFIX = "KVFABRIC_"
CONFIG_ENV = "KVFABRIC_CONFIG"

# Checks for options whose values are plain strings to argparse and parsed later.
_METAVAR_CHECKS: dict[str, Callable[[str], object]] = {
    "SIZE": parse_size,
    "DURATION": parse_duration,
}
_NOT_FROM_FILES = frozenset({"help", "version", "config"})


def _key(option: str) -> str:
    return option.removeprefix("--").replace("-", "_")


def env_name(option: str) -> str:
    """``--foo-bar`` -> ``KVFABRIC_FOO_BAR``."""
    return ENV_PREFIX + _key(option).upper()


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options ``parser`` takes from the environment and files, by key (``foo_bar``):
    its long options, less help, version, --config and hidden (deprecated) spellings."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        for option in action.option_strings:
            if option.startswith("--") and _key(option) not in _NOT_FROM_FILES:
                found[_key(option)] = action
                break
    return found


def commands_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers of ``parser``, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _text(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise ConfigError(f"{where}: a string, number or boolean, not {type(value).__name__}")


def _checked(action: argparse.Action, text: str, where: str) -> Any:
    """``text`` as the option would take it from a flag; ConfigError naming ``where``."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        try:
            flag = parse_bool(text)
        except (ConfigError, ValueError):
            raise ConfigError(f"{where}: true or false, not {text!r}") from None
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    try:
        value: Any = action.type(text) if callable(action.type) else text
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ConfigError(f"{text!r} is not one of {choices}")
        check = _METAVAR_CHECKS.get(str(action.metavar))
        if check is not None:
            check(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return text  # converted by argparse as a default, exactly as a flag's value


def _unknown(key: str, known: set[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _file_values(
    path: str, command: str, commands: Mapping[str, argparse.ArgumentParser]
) -> dict[str, tuple[Any, str]]:
    """The values ``path`` gives ``command``, by key, each with where it came from."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
    every = {name: options_of(p) for name, p in commands.items()}
    anywhere = set().union(*every.values()) if every else set()
    top: dict[str, tuple[Any, str]] = {}
    table: dict[str, tuple[Any, str]] = {}
    for raw_key, value in document.items():
        key = raw_key.replace("-", "_")
        if isinstance(value, dict):
            if raw_key not in commands:
                raise ConfigError(
                    f"{path}: unknown table [{raw_key}]; the tables are "
                    f"{', '.join(f'[{c}]' for c in commands)}"
                )
            for raw_inner, inner in value.items():
                inner_key = raw_inner.replace("-", "_")
                where = f"{path}: [{raw_key}] {raw_inner}"
                if inner_key not in every[raw_key]:
                    raise _unknown(inner_key, set(every[raw_key]), where)
                if raw_key == command:
                    table[inner_key] = (inner, where)
            continue
        if key not in anywhere:
            raise _unknown(key, anywhere, f"{path}: {raw_key}")
        if key in every.get(command, {}):
            top[key] = (value, f"{path}: {raw_key}")
    return {**top, **table}


def apply_sources(
    parser: argparse.ArgumentParser,
    command: str,
    config: str | None,
    environ: Mapping[str, str] | None = None,
) -> Callable[[argparse.Namespace], None]:
    """Make the environment's and ``config``'s values ``command``'s defaults (flags still
    win); returns what to call on the parsed namespace to fill repeatable options that no
    flag gave."""
    environ = os.environ if environ is None else environ
    commands = commands_of(parser)
    sub = commands[command]
    options = options_of(sub)
    raw: dict[str, tuple[Any, str]] = {}
    if config is None:
        config = environ.get(CONFIG_ENV) or None
    if config is not None:
        raw.update(_file_values(config, command, commands))
    for key in options:
        value = environ.get(ENV_PREFIX + key.upper(), "")
        if value:
            raw[key] = (value, ENV_PREFIX + key.upper())
    defaults: dict[str, Any] = {}
    repeated: dict[str, list[str]] = {}
    for key, (value, where) in raw.items():
        action = options[key]
        if isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else [value]
            repeated[action.dest] = [_text(v, where) for v in items]
            for item in repeated[action.dest]:
                _checked(action, item, where)
        else:
            defaults[action.dest] = _checked(action, _text(value, where), where)
    sub.set_defaults(**defaults)

    def fill(args: argparse.Namespace) -> None:
        for dest, values in repeated.items():
            if not getattr(args, dest, None):
                setattr(args, dest, list(values))

    return fill
