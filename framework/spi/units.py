"""Parsing of sizes ("256MiB") and durations ("2s", "500ms") in URLs and on the command line."""

from __future__ import annotations

import re

from kvfabric.errors import ConfigError

__all__ = ["format_size", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "4096", "256MiB", "4GiB", "1.5GB" (binary and decimal units)."""
    if isinstance(text, int):
        return text
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} (use e.g. 4096, 256MiB, 4GiB, 1GB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str | float) -> float:
    """Seconds from "2", "2s", "500ms", "1.5min"."""
    if isinstance(text, int | float):
        return float(text)
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ConfigError(f"not a duration: {text!r} (use e.g. 2s, 500ms, 1.5min)")
    return float(match.group(1)) * _DURATION_UNITS[unit]


def format_size(n: float) -> str:
    """A short human size: 1.5 GiB, 256 KiB, 12 B."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
