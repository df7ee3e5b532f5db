"""Controller addresses as users type them, and bind failures as users can act on them.

ZeroMQ wants ``tcp://HOST:PORT`` and answers anything else with ``EINVAL``; users type
``127.0.0.1:7100`` or paste the client URL ``kvfabric://127.0.0.1:7100``. Those forms are
unambiguous, so they are accepted and rewritten; what is not is refused with the forms
that are. A bind that fails (port in use, no such interface) becomes one line that says
what to do instead of a ZeroMQ traceback.
"""

from __future__ import annotations

import errno
import re

from kvfabric.errors import ConfigError, KvfabricError

__all__ = ["ListenError", "control_endpoint", "listen_error"]

# ASCII only: ZeroMQ cannot use any other name or digit (and says only "Invalid argument").
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+|\*):(\d{1,5})$", re.ASCII)
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class ListenError(KvfabricError, OSError):
    """A server could not bind its address; the message says what to try."""


def control_endpoint(text: str, option: str) -> str:
    """The ZeroMQ endpoint for a controller address given as ``option`` on the command line.

    ``tcp://HOST:PORT`` (and ``ipc://``) pass as they are; ``HOST:PORT`` and
    ``kvfabric://HOST:PORT[?...]`` become ``tcp://HOST:PORT``.
    """
    text = text.strip()
    if text.startswith(_ZMQ_SCHEMES):
        if text.startswith("tcp://") and not _HOST_PORT.match(text.removeprefix("tcp://")):
            raise ConfigError(
                f"{option} {text!r}: a tcp address needs a host and a port, "
                "e.g. tcp://127.0.0.1:7100"
            )
        return text
    bare = text.removeprefix("kvfabric://").split("?", 1)[0].rstrip("/")
    match = _HOST_PORT.match(bare)
    if match is None or "://" in bare:
        raise ConfigError(
            f"{option} {text!r} is not an address; use HOST:PORT or tcp://HOST:PORT, "
            "e.g. 127.0.0.1:7100"
        )
    if not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{option} {text!r}: port must be 1-65535")
    return f"tcp://{bare}"


def listen_error(
    what: str, address: str, code: int | None, reason: str, option: str
) -> ListenError:
    """One actionable line for a server that could not bind ``address`` (``code``: an errno)."""
    if code == errno.EADDRINUSE:
        advice = (
            f"the port is in use (by another kvfabric server?); stop it, or choose a free "
            f"port with {option}"
        )
    elif code == errno.EADDRNOTAVAIL:
        advice = (
            f"no interface here has that address; use 127.0.0.1 or this host's address in {option}"
        )
    elif code == errno.EACCES:
        advice = f"not allowed (ports below 1024 need privileges); choose another with {option}"
    else:
        advice = f"{reason}; check {option}"
    return ListenError(f"{what} cannot listen on {address}: {advice}")
