"""What an option's value may be: ranges of durations, sizes and counts, and host names.

The parsers users' text goes through (``kvfabric.spi.parse_duration``, ``parse_size``,
``int``) read any number; :func:`bounded` wraps one with the range its option accepts, so
that ``lease=0``, ``timeout=0`` or ``tcp.pool=-1`` is refused where it is given — with the
value and what is accepted — instead of making a store that never stores, times out every
call or spins. The caller adds the option's name (``option 'lease': ...``). Durations stop
at :data:`MAX_DURATION`: longer ones overflow the waits that use them, and no timeout,
lease or interval of a cache needs more.

:func:`check_host` does the same for host names: ZeroMQ and the resolver answer one they
cannot use (``hôst``, ``a b``) with errors that name neither the option nor the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from kvfabric.errors import ConfigError

__all__ = ["MAX_DURATION", "bounded", "check_host"]

N = TypeVar("N", int, float)

MAX_DURATION = 86400.0
"""The longest duration any option accepts (one day), in seconds."""

# A host name (letters, digits, '-', '_', '.'), an IPv4 or IPv6 address (bracketed or not),
# or '*' (ZeroMQ: every interface).
_HOST = re.compile(
    r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*|[A-Za-z0-9_.-]+|\*)$", re.ASCII
)


def bounded(
    parse: Callable[[str], N],
    *,
    above: N | None = None,
    at_least: N | None = None,
    at_most: N | None = None,
    zero: str | None = None,
    unit: str = "",
    show: Callable[[N], str] | None = None,
) -> Callable[[str], N]:
    """``parse``, then a ConfigError that says what is accepted unless the value is more
    than ``above``, at least ``at_least`` and at most ``at_most`` — or is 0 where ``zero``
    says what 0 means (``"off"``). The message shows each bound with ``show`` (e.g.
    ``format_size``), else as a number followed by ``unit`` (``"s"``)."""

    def text(value: N) -> str:
        if show is not None:
            return show(value)
        return f"{value}{unit}" if isinstance(value, int) else f"{value:g}{unit}"

    limits = []
    if above is not None:
        limits.append(f"more than {text(above)}")
    if at_least is not None:
        limits.append(f"at least {text(at_least)}")
    if at_most is not None:
        limits.append(f"at most {text(at_most)}")
    accepted = " and ".join(limits)
    if zero is not None:
        accepted = f"0 ({zero}), or {accepted}"

    def check(raw: str) -> N:
        value = parse(raw)
        if zero is not None and value == 0:
            return value
        if (
            not value == value  # NaN
            or (above is not None and not value > above)
            or (at_least is not None and not value >= at_least)
            or (at_most is not None and not value <= at_most)
        ):
            raise ConfigError(f"{raw!r} is out of range; accepted: {accepted}")
        return value

    return check


def check_host(host: str, option: str) -> str:
    """``host`` if it can name a host (a name, an IP address, ``*``), else a ConfigError
    naming ``option``, the value and what is accepted."""
    if _HOST.match(host):
        return host
    accepted = "ASCII letters, digits, '-', '_' and '.', or an IP address ([::1] for IPv6)"
    if not host.isascii():
        try:
            spelled = host.encode("idna").decode("ascii")
        except UnicodeError:
            hint = ""
        else:
            hint = f" (this name in that form: {spelled!r})"
        accepted += f"; a name in another script in its IDNA form{hint}"
    what = "empty" if not host else "not a host name or address"
    raise ConfigError(f"{option} {host!r} is {what}; accepted: {accepted}")
