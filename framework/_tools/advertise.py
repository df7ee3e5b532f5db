"""The address a server tells clients when it binds every interface (``--host 0.0.0.0``).

``0.0.0.0`` (or ``::``, ``*``) is where a server listens, not an address a client on
another host can use. Given no ``--advertise``, a server bound so advertises the address
of its interface that routes toward the service it registers with (the controller, or the
shared index's Redis) — the interface its peers most likely share — found by asking the
kernel for the route (a UDP ``connect``, which sends nothing). A controller or ``serve``
with nothing to route toward takes the interface of the default route. If no route is
known, the command fails with an error that names ``--advertise``. The choice is logged.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlsplit

from kvfabric.errors import ConfigError

__all__ = ["WILDCARD_HOSTS", "advertised_host", "route_target"]

log = logging.getLogger("kvfabric._tools.server_run")

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*", ""})

# A documentation address (TEST-NET-1): routed by the default route, never contacted.
_DEFAULT_ROUTE_PROBE = "192.0.2.1"


def route_target(text: str | None) -> str | None:
    """The host of an address as options give it (``HOST:PORT``, ``tcp://HOST:PORT``,
    ``redis://HOST:PORT/...``), or None."""
    if not text:
        return None
    if "://" not in text:
        text = f"tcp://{text}"
    try:
        host = urlsplit(text).hostname
    except ValueError:
        return None
    return None if host is None or host in WILDCARD_HOSTS else host


def _source_address(target: str) -> str | None:
    try:
        infos = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(address)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def advertised_host(host: str, advertise: str | None, toward: str | None) -> str | None:
    """What to advertise for a server bound to ``host``: ``advertise`` if given; None (the
    bound address) unless ``host`` is a wildcard; else the address of the interface that
    routes toward ``toward`` (a host; None: the default route)."""
    if advertise is not None or host not in WILDCARD_HOSTS:
        return advertise
    found = _source_address(toward or _DEFAULT_ROUTE_PROBE)
    if found is None:
        raise ConfigError(
            f"--host {host} listens on every interface, but no address of this host for "
            "clients to use was found (no route); give it with --advertise HOST"
        )
    log.info(
        "--host %s: advertising %s to clients (the interface toward %s); --advertise HOST "
        "chooses another",
        host,
        found,
        toward or "the default route",
    )
    return found
