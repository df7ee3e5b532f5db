"""Store URLs and the client options they carry.

A URL names where the store is and carries its options as query parameters:
``embedded://?capacity=256MiB&transport=shm``: :class:`ClientOptions` for every client,
:class:`EmbeddedOptions` and :class:`RemoteOptions` per scheme, and each plug-in's own
``NAME.OPTION`` values, which the plug-in declares (``kvfabric.spi.OptionSpec``). An
unknown option, a bad value (one that does not parse, or out of the option's range: no
``timeout=0`` or ``lease=0``), a host that cannot name one, or an unknown scheme is a
:class:`~kvfabric.errors.ConfigError` that names the option and the value and says what is
accepted.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import attrs

from kvfabric._runtime.bounds import MAX_DURATION, bounded, check_host
from kvfabric.errors import ConfigError
from kvfabric.spi.options import parse_bool
from kvfabric.spi.units import parse_duration, parse_size

__all__ = [
    "SCHEMES",
    "ClientOptions",
    "EmbeddedOptions",
    "RemoteOptions",
    "StoreUrl",
    "options_dict",
    "parse_url",
]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"not an integer: {text!r}") from None
    if value < 0:
        raise ConfigError(f"must not be negative: {text!r}")
    return value


def _replicas(text: str) -> int:
    value = _positive_int(text)
    if not 1 <= value <= 16:
        raise ConfigError(f"copies of a value: 1 to 16, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"must be in [0, 1): {text!r}")
    return value


def _name(text: str) -> str:
    if not text or not text.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"not a plugin name: {text!r}")
    return text


@attrs.frozen(kw_only=True)
class ClientOptions:
    """Options every client URL accepts."""

    timeout: float = 2.0
    """Bound on one batched read or write to a data node (seconds)."""
    node_backoff: float = 1.0
    """After a data node fails as a whole (a timeout, a failed connection), hold it off this
    long (seconds): lookups count keys only there as misses, reads and writes skip it
    without waiting; then one call probes it, and each failed probe doubles the period (up
    to 30 s). 0: never hold a node off (every call waits ``timeout`` again)."""
    prefetch_entries: int = 65536
    prefetch_ttl: float = 10.0
    max_value: int = 1 << 30
    transport: str | None = None
    """Force one transport by name instead of the best one each node offers."""
    lookup_image: bool = True
    """Answer lookups from the index's lookup image, where it publishes one, without asking
    the controller (false: every lookup is a control RPC)."""
    extents: bool = True
    """Write into extents leased from the index, where it leases them: a put is one control
    round trip (the publish) instead of two (allocate, publish). False: every put allocates
    per key."""
    plugin_options: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    """``NAME.OPTION=VALUE`` query parameters, by plugin name; each plugin parses its own."""


@attrs.frozen(kw_only=True)
class EmbeddedOptions(ClientOptions):
    """Options of ``embedded://[NAME]``: index, one data node and client in this process.

    Clients that connect with the same NAME share one store (each has its own prefetch
    cache and counters); without a name every connect makes a private store.
    """

    capacity: int = 256 << 20
    backend: str = "dram"
    path: str | None = None
    """Directory of a backend that keeps its memory in files (``backend=file``)."""
    index: str = "memory"
    region_size: int = 1 << 30
    lease: float = 30.0
    grace: float = 2.0
    headroom: float = 0.05
    replicas: int = 1
    """Copies of each value, on distinct data nodes (of the index's nodes: a shared index's
    embedded stores in several processes)."""


@attrs.frozen(kw_only=True)
class RemoteOptions(ClientOptions):
    """Options of ``kvfabric://HOST:PORT``: a controller and its data nodes.

    With ``index=NAME`` (a *shared* index plugin, e.g. ``redis``) HOST:PORT is where that
    index lives instead, and clients and nodes use it directly, with no controller.
    """

    index: str | None = None
    """A shared index plugin to use directly (HOST:PORT is then its address)."""
    replicas: int = 1
    """With ``index=NAME``: copies of each value this client stores, on distinct data nodes
    (readers need not say it: lookups return the copies there are). A controller decides
    it for its clients (``kvfabric controller --replicas K``)."""
    control_timeout: float = 1.0
    """Bound on one control round trip; past it the lookup is a miss."""
    retry_interval: float = 1.0
    """After the controller failed to answer, calls fail fast this long before retrying."""
    secret_file: str | None = None
    """File holding the deployment's shared secret (else ``KVFABRIC_SECRET``, if set); with
    ``tenant``, the tenant's secret."""
    report_interval: float = 5.0
    """Seconds between this client's usage reports to the controller (keys looked up, read
    and written, and its calls' durations: the fleet's hit rate in ``kvfabric stats`` and
    the controller's metrics); 0 reports only when the store closes."""
    tenant: str | None = None
    """The tenant this client is (docs/tenants.md): its keys are that tenant's namespace,
    authenticated by the tenant's secret (``secret_file``)."""
    controller_key: str | None = None
    """With ``tenant``: the controller's public key (printed by the controller at start),
    so a tenant's client, which does not hold the deployment's secret, still knows it talks
    to that controller."""


def _duration(
    *, above: float | None = None, at_least: float | None = None
) -> Callable[[str], float]:
    return bounded(parse_duration, above=above, at_least=at_least, at_most=MAX_DURATION, unit="s")


_PARSERS: dict[str, Callable[[str], Any]] = {
    "timeout": _duration(above=0.0),
    "node_backoff": _duration(at_least=0.0),
    "prefetch_entries": _positive_int,
    "prefetch_ttl": _duration(at_least=0.0),
    "max_value": bounded(parse_size, at_least=1),
    "transport": _name,
    "lookup_image": parse_bool,
    "extents": parse_bool,
    "capacity": parse_size,
    "backend": _name,
    "path": str,
    "index": _name,
    "region_size": parse_size,
    "lease": _duration(above=0.0),
    "grace": _duration(at_least=0.0),
    "headroom": _fraction,
    "replicas": _replicas,
    "control_timeout": _duration(above=0.0),
    "retry_interval": _duration(at_least=0.0),
    "secret_file": str,
    "report_interval": _duration(at_least=0.0),
    "tenant": str,
    "controller_key": str,
}

SCHEMES: dict[str, type[ClientOptions]] = {
    "embedded": EmbeddedOptions,
    "kvfabric": RemoteOptions,
}


@attrs.frozen(kw_only=True)
class StoreUrl:
    scheme: str
    host: str
    port: int | None
    options: ClientOptions


def parse_url(url: str) -> StoreUrl:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise ConfigError(f"not a store URL: {url!r} ({exc})") from None
    port = _port(url)
    scheme = parts.scheme
    options_cls = SCHEMES.get(scheme)
    if options_cls is None:
        accepted = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(f"unknown store URL scheme in {url!r}; accepted: {accepted}")
    if scheme == "embedded" and (port is not None or parts.path.strip("/")):
        raise ConfigError(f"embedded:// takes at most a name (embedded://NAME), got {url!r}")
    if scheme == "kvfabric" and (not parts.hostname or not port):
        raise ConfigError(
            f"kvfabric:// needs the controller's HOST:PORT (a port of 1-65535), got {url!r}"
        )
    if parts.hostname:
        check_host(parts.hostname, f"the host in {url!r}:")
    values = _parse_query(scheme, parts.query, options_cls)
    if scheme == "kvfabric" and values.get("replicas", 1) != 1 and not values.get("index"):
        raise ConfigError(
            f"replicas in {url!r}: a controller decides how many copies its clients store "
            "(kvfabric controller --replicas K); a client says it only with a shared "
            "index (index=NAME)"
        )
    try:
        options = options_cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad options in {url!r}: {exc}") from exc
    return StoreUrl(scheme=scheme, host=parts.hostname or "", port=port, options=options)


def _port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None


def _parse_query(scheme: str, query: str, options_cls: type[ClientOptions]) -> dict[str, Any]:
    accepted = [f.name for f in attrs.fields(options_cls) if f.name != "plugin_options"]
    values: dict[str, Any] = {}
    plugin_options: dict[str, dict[str, str]] = {}
    for name, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        plugin, dot, option = name.partition(".")
        if dot:
            # Addressed to a plugin (``tcp.pool=4``): checked by that plugin when selected.
            if not plugin or not option:
                raise ConfigError(f"plugin options look like PLUGIN.OPTION=VALUE, got {name!r}")
            if option in plugin_options.setdefault(plugin, {}):
                raise ConfigError(f"option {name!r} given twice")
            plugin_options[plugin][option] = raw
            continue
        if name not in accepted:
            message = (
                f"unknown option {name!r} for {scheme}://; accepted: {', '.join(accepted)}, "
                "and PLUGIN.OPTION for a plugin's own options"
            )
            close = difflib.get_close_matches(name, accepted, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
            raise ConfigError(message)
        if name in values:
            raise ConfigError(f"option {name!r} given twice")
        try:
            values[name] = _PARSERS[name](raw)
        except ConfigError as exc:
            raise ConfigError(f"option {name!r}: {exc}") from None
    if plugin_options:
        values["plugin_options"] = plugin_options
    return values


def options_dict(options: ClientOptions) -> Mapping[str, Any]:
    return attrs.asdict(options)
