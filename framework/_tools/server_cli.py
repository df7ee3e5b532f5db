"""The server commands: ``kvfabric controller``, ``kvfabric node`` and ``kvfabric serve``.

Each prints one line on stdout once it is ready (tests and scripts wait for it) naming its
capacity and every endpoint it serves, logs to stderr, and shuts down cleanly on SIGINT or
SIGTERM. Start-up problems (a port in use, an address ZeroMQ cannot use, a capacity this
machine cannot give) are one ``kvfabric: error: ...`` line that says what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
import zmq

from kvfabric._client.shared_index import check_shared
from kvfabric._control.client import ControlClient
from kvfabric._control.controller import Controller
from kvfabric._control.image_process import ImageProcessServer
from kvfabric._control.remote_index import fetch_stats
from kvfabric._control.security import Credentials, load_secret
from kvfabric._node.agent import NodeAgent
from kvfabric._node.capacity import check_capacity
from kvfabric._node.membership import ControllerMembership, IndexMembership, Membership
from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginOptions, group_plugin_options, plugin_manager
from kvfabric._tools.endpoints import control_endpoint, listen_error
from kvfabric._tools.metrics import MetricsServer, Scopes, ScopesCollector
from kvfabric.errors import ConfigError, KvfabricError, TransportError
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.index import IndexConfig, IndexPlugin
from kvfabric.spi.transport import TransportConfig, TransportServer
from kvfabric.spi.units import format_size, parse_duration, parse_size

__all__ = ["HelpFormatter", "add_server_commands", "configure_logging"]

log = logging.getLogger("kvfabric._tools.server_cli")

# A node that has not registered after this long says so, then again at this interval.
_FIRST_WAIT_NOTICE = 2.0
_WAIT_NOTICE_EVERY = 5.0

_UNITS_EPILOG = (
    "Sizes are bytes (4096) or take a unit: KiB, MiB, GiB, TiB (binary, 1024-based) or KB, "
    "MB, GB, TB (decimal); a lone K/M/G/T is refused as ambiguous. Durations are seconds "
    "(2, 2s) or take ms, us, min. Addresses are HOST:PORT or tcp://HOST:PORT."
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _size(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _duration(text: str | float, option: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def _port(text: str) -> int:
    """A TCP port for argparse: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), got {value}")
    return value


def _credentials(args: argparse.Namespace) -> Credentials | None:
    secret = load_secret(args.secret_file)
    return Credentials.from_secret(secret) if secret else None


def _settings(args: argparse.Namespace, *, index: bool = True) -> PluginOptions:
    """Users' NAME.OPTION settings for the plugins this command selects (``index=False``:
    the index's are claimed elsewhere, as a node's shared index)."""
    pairs = [
        *(getattr(args, "index_opt", []) if index else []),
        *getattr(args, "transport_opt", []),
        *getattr(args, "backend_opt", []),
    ]
    return PluginOptions(group_plugin_options(pairs))


def _index_from(args: argparse.Namespace, settings: PluginOptions) -> IndexPlugin:
    index_cls = plugin_manager().index(args.index)
    defaults = IndexConfig()
    # A node using a shared index has no --lease/--grace/--headroom: those are the index's,
    # set where it is served; the node only registers and heartbeats.
    replicas = getattr(args, "replicas", defaults.replicas)
    index_cls.check_replicas(replicas)
    return index_cls.create(
        IndexConfig(
            lease=_duration(getattr(args, "lease", defaults.lease), "--lease"),
            grace=_duration(getattr(args, "grace", defaults.grace), "--grace"),
            headroom=getattr(args, "headroom", defaults.headroom),
            options=settings.claim(index_cls),
            replicas=replicas,
        )
    )


def _controller_from(
    args: argparse.Namespace,
    credentials: Credentials | None,
    index: IndexPlugin,
    image_servers: dict[str, TransportServer],
) -> Controller:
    return Controller(
        listen=control_endpoint(args.listen, "--listen"),
        index=index,
        node_timeout=_duration(args.node_timeout, "--node-timeout"),
        credentials=credentials,
        image_servers=image_servers,
        freeze_long_lived=True,  # a process of its own (with `serve`, its node's agents)
    )


def _transport_names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    return [] if names == ["none"] else names


def _transport_config(args: argparse.Namespace, credentials: Credentials | None) -> TransportConfig:
    return TransportConfig(
        host=args.host,
        advertise=args.advertise,
        port=args.port,
        timeout=_duration(args.timeout, "--timeout"),
        token=credentials.data_token if credentials else b"",
    )


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


def _image_servers(
    args: argparse.Namespace, credentials: Credentials | None, settings: PluginOptions
) -> dict[str, TransportServer]:
    """The controller's own transport servers for the lookup image (``--transport``).

    A transport that is not one-sided (``tcp``: its server's CPU serves every read) gets
    its server in a process of its own, so lookups cost the controller no CPU.
    """
    plugins = plugin_manager()
    classes = {name: plugins.transport(name) for name in _transport_names(args.transport)}
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
        _close_servers(servers)
        raise _transport_failure(exc, args, "the controller") from exc
    except BaseException:
        _close_servers(servers)
        raise
    return servers


def _close_servers(servers: dict[str, TransportServer]) -> None:
    for server in servers.values():
        with contextlib.suppress(Exception):
            server.close()


def _node_from(
    args: argparse.Namespace, credentials: Credentials | None, settings: PluginOptions
) -> DataNode:
    capacity = _size(args.capacity, "--capacity")
    region_size = min(_size(args.region_size, "--region-size"), capacity)
    # Checked before any region is allocated: a capacity this machine cannot give fails
    # here with what to do, not halfway through allocation.
    check_capacity(capacity, region_size, plugin_manager().backend(args.backend))
    try:
        return DataNode.create(
            backend=args.backend,
            transports=[t.strip() for t in args.transport.split(",") if t.strip()],
            backend_config=BackendConfig(
                capacity=capacity, region_size=region_size, path=args.path
            ),
            transport_config=_transport_config(args, credentials),
            name=args.name,
            plugin_options=settings,
        )
    except TransportError as exc:
        failure = _transport_failure(exc, args, "the data node")
        if failure is exc:
            raise
        raise failure from exc


def _describe(node: DataNode) -> str:
    """Capacity, backend and every transport with its address, for the ready line."""
    regions = node.backend.regions()
    capacity = sum(r.size for r in regions)
    parts = [_endpoint_words(name, server.address) for name, server in node.servers.items()]
    region_word = "region" if len(regions) == 1 else "regions"
    stats = node.stats()
    prefault_ms = stats.get("prefault_ms", 0)
    prepared = f", memory prepared in {prefault_ms / 1000:.2f}s" if prefault_ms else ""
    if stats.get("huge_page_bytes"):
        prepared += f", {format_size(stats['huge_page_bytes'])} on huge pages"
    return (
        f"{format_size(capacity)} ({capacity} bytes, {node.backend.name}, {len(regions)} "
        f"{region_word}{prepared}) over {', '.join(parts)}"
    )


def _endpoint_words(name: str, address: bytes) -> str:
    """A transport and its address as the ready lines show them."""
    text = address.decode("ascii", errors="replace")
    if name == "shm":
        return "shm (same host)"
    if text.isprintable() and "\ufffd" not in text:
        return f"{name}@{text}"
    return f"{name} ({len(address)}-byte address)"


def _stop_on_signals(stop: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())


def _controller_stats(endpoint: Callable[[], str], args: argparse.Namespace) -> Scopes:
    """The controller's counters through its own STATS request, as ``kvfabric stats`` reads
    them. A client per scrape: scrapes are seconds apart and each runs on its own thread."""
    credentials = _credentials(args)
    client = ControlClient(
        endpoint(), timeout=_duration(args.timeout, "--timeout"), credentials=credentials
    )
    try:
        return fetch_stats(client)
    finally:
        client.close()


@contextmanager
def _metrics(args: argparse.Namespace, fetch: Callable[[], Scopes], source: str) -> Iterator[str]:
    """Serve ``fetch``'s counters on ``--metrics-port`` if given; yields the ready-line part."""
    if args.metrics_port is None:
        yield ""
        return
    server = MetricsServer(ScopesCollector(fetch, source), args.metrics_host, args.metrics_port)
    try:
        yield f"; metrics at {server.url}"
    finally:
        server.close()


def _serve_controller(controller: Controller, listen: str, ready: Callable[[str], None]) -> None:
    """``controller.serve`` with a failed bind as one line that says what to do."""
    try:
        controller.serve(ready)
    except zmq.ZMQError as exc:
        if controller.endpoint:
            raise  # bound and served: not a start-up problem
        raise listen_error(
            "the controller", listen, exc.errno, exc.strerror, "--listen HOST:PORT"
        ) from None


def _announce_waiting(agent: NodeAgent, membership: Membership, secured: bool) -> None:
    """Log on stderr while the node waits for its controller, until it is registered."""
    started = time.monotonic()
    if agent.wait_registered(_FIRST_WAIT_NOTICE) is not None:
        return
    hint = " with the same secret" if secured else ""
    while True:
        log.warning(
            "waiting for %s to register this node (%.0fs so far; the "
            "node is not used until then); %s%s?",
            membership.where,
            time.monotonic() - started,
            membership.check_hint,
            hint,
        )
        if agent.wait_registered(_WAIT_NOTICE_EVERY) is not None:
            log.info(
                "registered with %s after %.1fs",
                membership.where,
                time.monotonic() - started,
            )
            return


def _image_words(controller: Controller) -> str:
    """For the ready line: where the lookup image is served."""
    image = controller.image
    if image is None:
        return "; no lookup image (lookups by RPC)"
    parts = [_endpoint_words(e.transport, e.address) for e in image.endpoints]
    return f"; lookup image over {', '.join(parts) or 'nothing'}"


def cmd_controller(args: argparse.Namespace) -> int:
    settings = _settings(args)
    credentials = _credentials(args)
    index = _index_from(args, settings)
    try:
        servers = _image_servers(args, credentials, settings)
        try:
            controller = _controller_from(args, credentials, index, servers)
            settings.check_all_claimed("controller")
            with _metrics(
                args,
                lambda: _controller_stats(lambda: controller.endpoint, args),
                "the controller",
            ) as metrics:
                _stop_on_signals(controller.stop)
                _serve_controller(
                    controller,
                    controller.listen,
                    lambda endpoint: print(
                        f"kvfabric controller listening on {endpoint} (index {args.index})"
                        f"{_image_words(controller)}{metrics}; clients connect with "
                        f"kvfabric://{_host_port(endpoint)}",
                        flush=True,
                    ),
                )
        finally:
            _close_servers(servers)
    finally:
        index.close()
    return 0


def index_from_options(name: str, index_opt: list[str]) -> IndexPlugin:
    """A client of the shared index ``name`` with ``--index-opt`` settings (``kvfabric node
    --index`` and ``kvfabric stats --index``): a ConfigError for an index that lives inside
    a controller, or an option it does not take."""
    settings = PluginOptions(group_plugin_options(index_opt))
    check_shared(plugin_manager().index(name))
    index = _index_from(argparse.Namespace(index=name), settings)
    try:
        settings.check_all_claimed(f"{name} index")
    except BaseException:
        index.close()
        raise
    return index


def _membership(
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
    return ControllerMembership(
        control_endpoint(args.controller, "--controller"),
        timeout=_duration(args.timeout, "--timeout"),
        retry_interval=min(_duration(args.heartbeat, "--heartbeat"), 1.0),
        credentials=credentials,
    ), None


def cmd_node(args: argparse.Namespace) -> int:
    credentials = _credentials(args)
    membership, shared_index = _membership(args, credentials)
    try:
        node = _node_from(args, credentials, _settings(args, index=False))
    except BaseException:
        membership.close()
        raise
    stop = threading.Event()
    try:
        agent = NodeAgent(node, membership, heartbeat=_duration(args.heartbeat, "--heartbeat"))

        def node_stats() -> Scopes:
            registered = agent.registered
            node_id = registered.id if registered is not None else 0
            scopes: Scopes = {
                f"node {node_id} {node.name}": {
                    **node.stats(),
                    "registered": int(registered is not None),
                }
            }
            if shared_index is not None:
                # No controller reports the shared index's counters (per shard, in Redis):
                # every node does. One that cannot reach it still reports its own.
                with contextlib.suppress(KvfabricError):
                    scopes["index"] = shared_index.shared_stats()
            return scopes

        with _metrics(args, node_stats, f"node {node.name}") as metrics:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            agent.start()
            print(
                f"kvfabric node {node.name} serving {_describe(node)}; registering with "
                f"{membership.where}{metrics}",
                flush=True,
            )
            threading.Thread(
                target=_announce_waiting,
                args=(agent, membership, credentials is not None),
                name="kvfabric-wait-notice",
                daemon=True,
            ).start()
            try:
                stop.wait()
            finally:
                agent.stop()
    finally:
        node.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    credentials = _credentials(args)
    settings = _settings(args)
    index = _index_from(args, settings)
    try:
        node = _node_from(args, credentials, settings)
    except BaseException:
        index.close()
        raise
    # The node's transport servers serve the lookup image too: one port per transport.
    controller = _controller_from(args, credentials, index, node.servers)
    agents: list[NodeAgent] = []
    try:
        with _metrics(
            args, lambda: _controller_stats(lambda: controller.endpoint, args), "the controller"
        ) as metrics:
            _stop_on_signals(controller.stop)

            def ready(endpoint: str) -> None:
                # The controller is bound: start the node's agent against it, announce when
                # the node is in.
                membership = ControllerMembership(
                    endpoint,
                    timeout=_duration(args.timeout, "--timeout"),
                    retry_interval=min(_duration(args.heartbeat, "--heartbeat"), 1.0),
                    credentials=credentials,
                )
                agent = NodeAgent(
                    node, membership, heartbeat=_duration(args.heartbeat, "--heartbeat")
                )
                agents.append(agent)
                agent.start()
                threading.Thread(target=announce, args=(agent, endpoint), daemon=True).start()

            def announce(agent: NodeAgent, endpoint: str) -> None:
                if agent.wait_registered(30.0) is None:
                    print(
                        "kvfabric: error: the node did not register with its own controller "
                        "within 30s",
                        file=sys.stderr,
                        flush=True,
                    )
                    controller.stop()
                    return
                print(
                    f"kvfabric serving on {endpoint}: node {node.name}, {_describe(node)}"
                    f"{_image_words(controller)}{metrics}; connect with "
                    f"kvfabric://{_host_port(endpoint)}",
                    flush=True,
                )

            try:
                _serve_controller(controller, controller.listen, ready)
            finally:
                for agent in agents:
                    agent.stop()
    finally:
        index.close()
        node.close()
    return 0


def _host_port(endpoint: str) -> str:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return f"{host}:{port}"


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of copies: {text!r}") from None
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"copies of a value: 1 to 16, got {value}")
    return value


def _add_controller_options(parser: argparse.ArgumentParser, default_listen: str) -> None:
    parser.add_argument(
        "--listen",
        default=default_listen,
        metavar="HOST:PORT",
        help="address the controller binds (HOST:PORT or tcp://HOST:PORT; 0.0.0.0 for all "
        "interfaces)",
    )
    parser.add_argument(
        "--index", default="memory", help="index plugin (`kvfabric plugins` lists them)"
    )
    parser.add_argument(
        "--index-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of the index plugin (repeatable)",
    )
    parser.add_argument(
        "--lease",
        default="30s",
        metavar="DURATION",
        help="a writer's time to publish what it was granted before the slot is reclaimed",
    )
    parser.add_argument(
        "--grace",
        default="2s",
        metavar="DURATION",
        help="how long a freed slot waits before reuse (readers holding its descriptor "
        "finish first)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="share of capacity kept free ahead of need, by evicting least recently used",
    )
    parser.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="K",
        help="store each value on K distinct data nodes (fewer while fewer have room); a "
        "read falls over to another copy when its node is lost",
    )
    parser.add_argument(
        "--node-timeout",
        default="3s",
        metavar="DURATION",
        help="drop a data node silent for this long, and its entries",
    )


def _add_image_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transport",
        default="tcp,shm",
        help="comma-separated transports serving the index's lookup image, which clients "
        "read one-sided instead of asking the controller (none: lookups by RPC only)",
    )
    parser.add_argument(
        "--transport-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of a transport plugin, e.g. tcp.pool=4 (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address image transports bind")
    parser.add_argument(
        "--advertise", default=None, help="host clients use to reach them (for 0.0.0.0)"
    )
    parser.add_argument(
        "--port", type=_port, default=0, help="image transport port (0: any free one)"
    )


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--capacity", default="4GiB", metavar="SIZE", help="memory this node serves"
    )
    parser.add_argument(
        "--region-size",
        default="1GiB",
        metavar="SIZE",
        help="capacity is allocated in regions of this size (one file descriptor each)",
    )
    parser.add_argument(
        "--backend", default="dram", help="memory backend (`kvfabric plugins` lists them)"
    )
    parser.add_argument(
        "--backend-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of the backend plugin (repeatable)",
    )
    parser.add_argument(
        "--transport", default="tcp,shm", help="comma-separated transports to serve"
    )
    parser.add_argument(
        "--transport-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of a transport plugin, e.g. tcp.pool=4 (repeatable)",
    )
    parser.add_argument("--path", default=None, help="backend path (file-backed backends)")
    parser.add_argument("--host", default="127.0.0.1", help="address data transports bind")
    parser.add_argument(
        "--advertise", default=None, help="host clients use to reach this node (for 0.0.0.0)"
    )
    parser.add_argument("--port", type=_port, default=0, help="data port (0: any free one)")
    parser.add_argument("--name", default=None, help="stable node name (default: random)")
    parser.add_argument(
        "--heartbeat",
        default="1s",
        metavar="DURATION",
        help="how often the node reports to the controller (keep it well under the "
        "controller's --node-timeout)",
    )
    parser.add_argument(
        "--timeout",
        default="2s",
        metavar="DURATION",
        help="bound on one control round trip",
    )


def _add_metrics_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: any free "
        "port, printed at start-up; default: no endpoint)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics endpoint binds (0.0.0.0 for all interfaces)",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file", default=None, help="shared secret (else $KVFABRIC_SECRET, if set)"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="what is logged on stderr",
    )


def add_server_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    controller = sub.add_parser(
        "controller",
        help="run the index (one per deployment)",
        description="Run the controller: the index of what is stored where, behind one "
        "ZeroMQ port. Data nodes register with it; clients send it their lookups.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_controller_options(controller, "tcp://127.0.0.1:7100")
    _add_image_options(controller)
    _add_metrics_options(controller)
    controller.add_argument(
        "--timeout",
        default="2s",
        metavar="DURATION",
        help="bound on the metrics endpoint's request for the controller's counters",
    )
    _add_common(controller)
    controller.set_defaults(func=cmd_controller)

    node = sub.add_parser(
        "node",
        help="run a data node (one per host or memory pool)",
        description="Run a data node: memory served over data transports, registered with "
        "a controller. It waits (and says so on stderr) until the controller answers.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    node.add_argument(
        "--controller",
        default="tcp://127.0.0.1:7100",
        metavar="HOST:PORT",
        help="the controller's address (HOST:PORT, tcp://HOST:PORT or kvfabric://HOST:PORT)",
    )
    node.add_argument(
        "--index",
        default=None,
        metavar="NAME",
        help="register with a shared index directly instead of a controller (e.g. redis, "
        "with --index-opt redis.url=redis://HOST:PORT)",
    )
    node.add_argument(
        "--index-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of the shared index (repeatable)",
    )
    _add_node_options(node)
    _add_metrics_options(node)
    _add_common(node)
    node.set_defaults(func=cmd_node)

    serve = sub.add_parser(
        "serve",
        help="controller and one data node in one process",
        description="Run a controller and one data node in one process: a whole store on one host.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_controller_options(serve, "tcp://127.0.0.1:7100")
    _add_node_options(serve)
    _add_metrics_options(serve)
    _add_common(serve)
    serve.set_defaults(func=cmd_serve)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
