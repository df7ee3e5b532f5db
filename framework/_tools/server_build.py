"""Building the server commands' parts from their parsed options: the index, the controller and
its lookup-image servers, a data node, and where a node registers.

Each builder reads the :mod:`kvfabric._tools.server_options` it needs from the command's
namespace and turns what cannot work (a size or duration that does not parse, a port in use,
a capacity this machine cannot give) into one error naming the option. Running what is built
is :mod:`kvfabric._tools.server_run`.
"""

from __future__ import annotations

import argparse
import contextlib

import attrs

from kvfabric._client.shared_index import check_shared
from kvfabric._control.controller import Controller
from kvfabric._control.image_process import ImageProcessServer
from kvfabric._control.kv_events import KvEventPublisher
from kvfabric._control.reservations import ReservationLimits
from kvfabric._control.security import Credentials, load_secret
from kvfabric._control.session import CHUNK_BYTES
from kvfabric._control.tenant_config import TenantSpec, load_tenants
from kvfabric._control.tenant_gate import TenantGate
from kvfabric._node.capacity import check_capacity
from kvfabric._node.membership import ControllerMembership, IndexMembership, Membership
from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginOptions, group_plugin_options, plugin_manager
from kvfabric._runtime.bounds import MAX_DURATION, bounded, check_host
from kvfabric._tools.advertise import advertised_host, route_target
from kvfabric._tools.endpoints import control_endpoint, listen_error
from kvfabric.errors import ConfigError, TransportError
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.index import IndexConfig, IndexPlugin
from kvfabric.spi.transport import TransportConfig, TransportServer
from kvfabric.spi.units import format_size, parse_duration, parse_size

__all__ = [
    "MIN_FRAME",
    "close_servers",
    "controller_from",
    "controller_membership",
    "credentials_from",
    "duration",
    "image_servers_from",
    "index_from",
    "index_from_options",
    "kv_events_from",
    "max_frame_from",
    "membership_from",
    "node_from",
    "plugin_settings",
    "reservation_limits_from",
    "tenants_from",
]

MIN_FRAME = 1 << 20
"""The least ``--max-frame`` taken: every frame a client or node sends fits in it."""


def _size(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


_DURATION = bounded(parse_duration, above=0.0, at_most=MAX_DURATION, unit="s")
_DURATION_OR_ZERO = bounded(parse_duration, at_least=0.0, at_most=MAX_DURATION, unit="s")


def duration(text: str | float, option: str, *, zero: bool = False) -> float:
    """``text`` in seconds; a ConfigError naming ``option`` if it does not parse, or is not
    more than 0 (``zero``: 0 or more) and at most :data:`MAX_DURATION`."""
    try:
        return (_DURATION_OR_ZERO if zero else _DURATION)(str(text))
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _headroom(value: float) -> float:
    if not 0.0 <= value < 1.0:  # NaN included
        raise ConfigError(f"--headroom: {value!r} is out of range; accepted: 0 to under 1")
    return value


def credentials_from(args: argparse.Namespace) -> Credentials | None:
    """``--secret-file`` (else ``$KVFABRIC_SECRET``) as credentials, or None: unsecured."""
    secret = load_secret(args.secret_file)
    return Credentials.from_secret(secret) if secret else None


def tenants_from(args: argparse.Namespace) -> list[TenantSpec] | None:
    """``--tenants FILE``, read and checked (None: no tenants)."""
    path = getattr(args, "tenants", None)
    return load_tenants(path) if path else None


def plugin_settings(args: argparse.Namespace, *, index: bool = True) -> PluginOptions:
    """Users' NAME.OPTION settings for the plugins this command selects (``index=False``:
    the index's are claimed elsewhere, as a node's shared index)."""
    pairs = [
        *(getattr(args, "index_opt", []) if index else []),
        *getattr(args, "transport_opt", []),
        *getattr(args, "backend_opt", []),
    ]
    return PluginOptions(group_plugin_options(pairs))


def index_from(args: argparse.Namespace, settings: PluginOptions) -> IndexPlugin:
    """The ``--index`` plugin, configured by the controller options the command has."""
    index_cls = plugin_manager().index(args.index)
    defaults = IndexConfig()
    # A node using a shared index has no --lease/--grace/--headroom: those are the index's,
    # set where it is served; the node only registers and heartbeats.
    replicas = getattr(args, "replicas", defaults.replicas)
    index_cls.check_replicas(replicas)
    return index_cls.create(
        IndexConfig(
            lease=duration(getattr(args, "lease", defaults.lease), "--lease"),
            grace=duration(getattr(args, "grace", defaults.grace), "--grace", zero=True),
            headroom=_headroom(getattr(args, "headroom", defaults.headroom)),
            options=settings.claim(index_cls),
            replicas=replicas,
        )
    )


def index_from_options(name: str, index_opt: list[str]) -> IndexPlugin:
    """A client of the shared index ``name`` with ``--index-opt`` settings (``kvfabric node
    --index`` and ``kvfabric stats --index``): a ConfigError for an index that lives inside
    a controller, or an option it does not take."""
    settings = PluginOptions(group_plugin_options(index_opt))
    check_shared(plugin_manager().index(name))
    index = index_from(argparse.Namespace(index=name), settings)
    try:
        settings.check_all_claimed(f"{name} index")
    except BaseException:
        index.close()
        raise
    return index


def kv_events_from(args: argparse.Namespace) -> KvEventPublisher | None:
    """``--kv-events`` (with ``--kv-events-replay`` and ``--kv-events-topic``): the
    publisher, its sockets open; None without ``--kv-events``."""
    endpoint = getattr(args, "kv_events", None)
    if endpoint is None:
        if getattr(args, "kv_events_replay", None) is not None:
            raise ConfigError("--kv-events-replay: replays events; give --kv-events too")
        return None
    return KvEventPublisher(endpoint, replay=args.kv_events_replay, topic=args.kv_events_topic)


def controller_from(
    args: argparse.Namespace,
    credentials: Credentials | None,
    index: IndexPlugin,
    image_servers: dict[str, TransportServer],
    tenants: list[TenantSpec] | None = None,
    kv_events: KvEventPublisher | None = None,
) -> Controller:
    return Controller(
        listen=control_endpoint(args.listen, "--listen"),
        index=index,
        node_timeout=duration(args.node_timeout, "--node-timeout"),
        credentials=credentials,
        image_servers=image_servers,
        freeze_long_lived=True,  # a process of its own (with `serve`, its node's agents)
        max_frame=max_frame_from(args.max_frame),
        reservation_limits=reservation_limits_from(args),
        tenants=TenantGate(tenants) if tenants else None,
        kv_events=kv_events,
    )


def max_frame_from(text: str) -> int:
    """``--max-frame``: at least :data:`MIN_FRAME`, so every legitimate frame fits."""
    size = _size(text, "--max-frame")
    if size < MIN_FRAME:
        raise ConfigError(
            f"--max-frame: {text} is less than {format_size(MIN_FRAME)}: clients send chunks "
            f"of up to {format_size(CHUNK_BYTES)} and nodes register and report in frames "
            "of up to a few hundred KiB"
        )
    return size


def reservation_limits_from(args: argparse.Namespace) -> ReservationLimits:
    """``--max-client-bytes`` (a size, or a percentage of the capacity) and
    ``--max-client-grants``."""
    text = str(args.max_client_bytes).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ConfigError(
                f"--max-client-bytes: {text!r} is not a share of the capacity (0% to 100%)"
            )
        return ReservationLimits(share=share, grants=args.max_client_grants)
    size = _size(text, "--max-client-bytes")
    if size <= 0:
        raise ConfigError("--max-client-bytes: a size above 0, or a percentage (50%)")
    return ReservationLimits(bytes=size, grants=args.max_client_grants)


def _transport_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    return [] if names == ["none"] else names


def _transport_config(
    args: argparse.Namespace,
    credentials: Credentials | None,
    tenants: list[TenantSpec] | None = None,
) -> TransportConfig:
    host = check_host(args.host, "--host")
    advertise = None if args.advertise is None else check_host(args.advertise, "--advertise")
    return TransportConfig(
        host=host,
        advertise=advertised_host(host, advertise, _route_toward(args)),
        port=args.port,
        token=credentials.data_token if credentials else b"",
        tenant_tokens=tuple((t.keys.data_token, t.keys.tag) for t in tenants or ()),
    )


def _route_toward(args: argparse.Namespace) -> str | None:
    """The host a server's peers are most likely reached through: a node's controller or
    shared index, a controller's own --listen address (None: the default route)."""
    if getattr(args, "index", None) == "redis" and not hasattr(args, "listen"):
        for option in getattr(args, "index_opt", []):
            name, _, value = option.partition("=")
            if name == "redis.url":
                return route_target(value)
        return route_target("redis://127.0.0.1:6379")
    if hasattr(args, "listen"):
        return route_target(args.listen)
    return route_target(getattr(args, "controller", None))


def _transport_failure(exc: TransportError, args: argparse.Namespace, what: str) -> Exception:
    """A transport that could not listen, as one line that says what to do (or as it is)."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno is not None:
        transport = str(exc).partition(":")[0]
        return listen_error(
            f"{what}'s {transport} transport",
            f"{args.host}:{args.port}",
            cause.errno,
            cause.strerror or str(cause),
            "--host and --port (0: any free port)",
        )
    return exc


def image_servers_from(
    args: argparse.Namespace, credentials: Credentials | None, settings: PluginOptions
) -> dict[str, TransportServer]:
    """The controller's own transport servers for the lookup image (``--transport``).

    A transport that is not one-sided (``tcp``: its server's CPU serves every read) gets
    its server in a process of its own, so lookups cost the controller no CPU.
    """
    plugins = plugin_manager()
    classes = {name: plugins.transport(name) for name in _transport_names(args.transport)}
    # No tenant keys: a tenant's client reads no lookup image (it is every tenant's), it
    # asks the controller, which keeps tenants apart.
    config = _transport_config(args, credentials)
    servers: dict[str, TransportServer] = {}
    try:
        for name, cls in classes.items():
            configured = attrs.evolve(config, options=settings.claim(cls))
            if cls.capabilities.one_sided:
                servers[name] = cls.create_server(configured)
            else:
                # Made and closed here first: a port in use or a TLS setting that cannot
                # work fails the command now, as for any other server, not in the child.
                cls.create_server(configured).close()
                servers[name] = ImageProcessServer(name, configured)
    except TransportError as exc:
        close_servers(servers)
        raise _transport_failure(exc, args, "the controller") from exc
    except BaseException:
        close_servers(servers)
        raise
    return servers


def close_servers(servers: dict[str, TransportServer]) -> None:
    for server in servers.values():
        with contextlib.suppress(Exception):
            server.close()


def node_from(
    args: argparse.Namespace,
    credentials: Credentials | None,
    settings: PluginOptions,
    tenants: list[TenantSpec] | None = None,
) -> DataNode:
    capacity = _size(args.capacity, "--capacity")
    region_size = min(_size(args.region_size, "--region-size"), capacity)
    # Checked before any region is allocated: a capacity this machine cannot give fails
    # here with what to do, not halfway through allocation.
    check_capacity(capacity, region_size, plugin_manager().backend(args.backend))
    if args.path is not None and args.backend == "dram":
        raise ConfigError(
            f"--path {args.path} is where a file-backed node keeps its memory, but the backend "
            "is dram (memory only): add --backend file to keep it in files there, or drop "
            "--path"
        )
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or transports == ["none"]:
        raise ConfigError(
            f"--transport {args.transport!r}: a data node serves over at least one transport "
            "(e.g. tcp,shm; `kvfabric plugins` lists them)"
        )
    try:
        return DataNode.create(
            backend=args.backend,
            transports=transports,
            backend_config=BackendConfig(
                capacity=capacity, region_size=region_size, path=args.path
            ),
            transport_config=_transport_config(args, credentials, tenants),
            name=args.name,
            plugin_options=settings,
        )
    except TransportError as exc:
        failure = _transport_failure(exc, args, "the data node")
        if failure is exc:
            raise
        raise failure from exc


def controller_membership(
    endpoint: str, args: argparse.Namespace, credentials: Credentials | None
) -> ControllerMembership:
    """A node's registration with the controller at ``endpoint``, retried while it is away."""
    return ControllerMembership(
        endpoint,
        timeout=duration(args.timeout, "--timeout"),
        retry_interval=min(duration(args.heartbeat, "--heartbeat"), 1.0),
        credentials=credentials,
    )


def membership_from(
    args: argparse.Namespace, credentials: Credentials | None
) -> tuple[Membership, IndexPlugin | None]:
    """Where this node registers: its controller, or (``--index NAME``) a shared index
    (returned too: the node's metrics show its counters, as a controller's show its own)."""
    if args.index:
        index = index_from_options(args.index, args.index_opt)
        try:
            return IndexMembership(index, f"the {args.index} index"), index
        except BaseException:
            index.close()
            raise
    endpoint = control_endpoint(args.controller, "--controller")
    return controller_membership(endpoint, args, credentials), None
