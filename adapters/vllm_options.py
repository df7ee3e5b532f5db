"""The values of the vLLM connector's ``kv_connector_extra_config``, parsed as every
kvfabric option is: durations as durations ("500ms", "2s", or seconds) and sizes as sizes
("1GiB", "512MiB", or bytes), each refused with the key's name and what it takes."""

from __future__ import annotations

from typing import Any

from kvfabric.errors import ConfigError
from kvfabric.spi import parse_duration, parse_size

__all__ = ["bytes_option", "seconds_option"]


def seconds_option(value: Any, name: str, *, zero: bool = False) -> float:
    """``value`` as seconds (a number, or a duration such as "500ms"): more than 0, or at
    least 0 with ``zero``; ConfigError if not."""
    try:
        seconds = parse_duration(value)
    except (ConfigError, TypeError):
        seconds = -1.0
    if seconds < 0 or (seconds == 0 and not zero):
        least = "a duration of 0 or more" if zero else "a positive duration"
        raise ConfigError(
            f"KVFabricConnector: {name} must be {least} (2, 2s, 500ms), not {value!r}"
        )
    return seconds


def bytes_option(value: Any, name: str) -> int:
    """``value`` as bytes: a number, or a size such as "1GiB"; ConfigError if not."""
    try:
        size = parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"KVFabricConnector: {name}: {exc}") from None
    except TypeError:
        size = -1
    if isinstance(size, bool) or size < 0:
        raise ConfigError(
            f"KVFabricConnector: {name} must be a size (1073741824, 1GiB, 512MiB), not {value!r}"
        )
    return size
