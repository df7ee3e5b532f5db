"""Parsing of sizes ("256MiB") and durations ("2s", "500ms") in URLs and on the command line.

Sizes: a number of bytes ("4096"), or a number with a unit, case-insensitive:

- ``KiB``, ``MiB``, ``GiB``, ``TiB``: binary, 1024-based (``16GiB`` = 17179869184 bytes);
  what memory comes in, and what kvfabric prints.
- ``KB``, ``MB``, ``GB``, ``TB``: decimal, 1000-based (``16GB`` = 16000000000 bytes), as the
  SI and IEC define them.
- ``K``, ``M``, ``G``, ``T`` alone are refused, with both readings in the message. Tools
  disagree on them (Kubernetes reads ``16G`` as 16·10⁹ bytes; Docker, the JVM and systemd as
  16·2³⁰; Redis reads ``1g`` as 10⁹ but ``1gb`` as 2³⁰), so any choice would silently give
  someone 7% more or less memory than they meant; a refusal costs one retry.

Durations: seconds ("2", "2s"), or ``ms``, ``us``, ``m``/``min`` ("1.5min").
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvfabric.errors import ConfigError

__all__ = ["format_size", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_AMBIGUOUS_UNITS = {"k": "K", "m": "M", "g": "G", "t": "T"}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_SIZE_EXAMPLES = "e.g. 4096 (bytes), 256MiB, 16GiB (binary) or 16GB (decimal)"


def parse_size(text: str | int) -> int:
    """Bytes from "4096", "256MiB", "16GiB" (binary) or "1.5GB" (decimal); "16G" is refused."""
    if isinstance(text, int):
        return text
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ConfigError(f"not a size: {text!r} ({_SIZE_EXAMPLES})")
    number, unit = match.group(1), match.group(2).lower()
    if unit in _AMBIGUOUS_UNITS:
        letter = _AMBIGUOUS_UNITS[unit]
        binary = int(Fraction(number) * _SIZE_UNITS[unit + "ib"])
        decimal = int(Fraction(number) * _SIZE_UNITS[unit + "b"])
        raise ConfigError(
            f"size {text!r} is ambiguous: write {number}{letter}iB ({binary} bytes, binary) "
            f"or {number}{letter}B ({decimal} bytes, decimal)"
        )
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"not a size: {text!r} ({_SIZE_EXAMPLES})")
    # Exact arithmetic: "0.1KB" is 100 bytes, not 100.00000000000001.
    value = Fraction(number) * _SIZE_UNITS[unit]
    if value.denominator != 1:
        raise ConfigError(f"not a whole number of bytes: {text!r} ({_SIZE_EXAMPLES})")
    return int(value)


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
