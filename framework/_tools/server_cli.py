"""The server commands: ``kvfabric controller``, ``kvfabric node`` and ``kvfabric serve``.

Each prints one line on stdout once it is ready (tests and scripts wait for it), logs to
stderr, and shuts down cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable

from kvfabric._control.controller import Controller
from kvfabric._control.security import Credentials, load_secret
from kvfabric._node.agent import NodeAgent
from kvfabric._node.node import DataNode
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.index import IndexConfig, IndexPlugin
from kvfabric.spi.options import PluginOptions, group_plugin_options
from kvfabric.spi.plugins import plugin_manager
from kvfabric.spi.transport import TransportConfig
from kvfabric.spi.units import parse_duration, parse_size

__all__ = ["add_server_commands"]


def _credentials(args: argparse.Namespace) -> Credentials | None:
    secret = load_secret(args.secret_file)
    return Credentials.from_secret(secret) if secret else None


def _settings(args: argparse.Namespace) -> PluginOptions:
    pairs = [
        *getattr(args, "index_opt", []),
        *getattr(args, "transport_opt", []),
        *getattr(args, "backend_opt", []),
    ]
    return PluginOptions(group_plugin_options(pairs))


def _index_from(args: argparse.Namespace, settings: PluginOptions) -> IndexPlugin:
    index_cls = plugin_manager().index(args.index)
    return index_cls.create(
        IndexConfig(
            lease=parse_duration(args.lease),
            grace=parse_duration(args.grace),
            headroom=args.headroom,
            options=settings.claim(index_cls),
        )
    )


def _controller_from(
    args: argparse.Namespace, credentials: Credentials | None, settings: PluginOptions
) -> Controller:
    return Controller(
        listen=args.listen,
        index=_index_from(args, settings),
        node_timeout=parse_duration(args.node_timeout),
        credentials=credentials,
    )


def _node_from(
    args: argparse.Namespace, credentials: Credentials | None, settings: PluginOptions
) -> DataNode:
    return DataNode.create(
        backend=args.backend,
        transports=[t.strip() for t in args.transport.split(",") if t.strip()],
        backend_config=BackendConfig(
            capacity=parse_size(args.capacity),
            region_size=min(parse_size(args.region_size), parse_size(args.capacity)),
            path=args.path,
        ),
        transport_config=TransportConfig(
            host=args.host,
            advertise=args.advertise,
            port=args.port,
            timeout=parse_duration(args.timeout),
            token=credentials.data_token if credentials else b"",
        ),
        name=args.name,
        plugin_options=settings,
    )


def _describe(node: DataNode) -> str:
    """Transports and their addresses, for the ready line (binary addresses summarised)."""
    parts = []
    for name, server in node.servers.items():
        address = server.address
        text = address.decode("ascii", errors="replace")
        if name == "shm":
            parts.append(name)
        elif text.isprintable() and "\ufffd" not in text:
            parts.append(f"{name}@{text}")
        else:
            parts.append(f"{name} ({len(address)}-byte address)")
    return ", ".join(parts)


def _stop_on_signals(stop: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())


def cmd_controller(args: argparse.Namespace) -> int:
    settings = _settings(args)
    controller = _controller_from(args, _credentials(args), settings)
    settings.check_all_claimed("controller")
    _stop_on_signals(controller.stop)
    controller.serve(
        lambda endpoint: print(f"kvfabric controller listening on {endpoint}", flush=True)
    )
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    credentials = _credentials(args)
    node = _node_from(args, credentials, _settings(args))
    agent = NodeAgent(
        node,
        args.controller,
        heartbeat=parse_duration(args.heartbeat),
        timeout=parse_duration(args.timeout),
        credentials=credentials,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    print(f"kvfabric node {node.name} serving {_describe(node)}", flush=True)
    try:
        stop.wait()
    finally:
        agent.stop()
        node.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    credentials = _credentials(args)
    settings = _settings(args)
    controller = _controller_from(args, credentials, settings)
    node = _node_from(args, credentials, settings)
    agents: list[NodeAgent] = []
    _stop_on_signals(controller.stop)

    def ready(endpoint: str) -> None:
        # The controller is bound: start the node's agent against it, announce when it is in.
        agent = NodeAgent(
            node,
            endpoint,
            heartbeat=parse_duration(args.heartbeat),
            timeout=parse_duration(args.timeout),
            credentials=credentials,
        )
        agents.append(agent)
        agent.start()
        threading.Thread(target=announce, args=(agent, endpoint), daemon=True).start()

    def announce(agent: NodeAgent, endpoint: str) -> None:
        if agent.wait_registered(30.0) is None:
            print("kvfabric serve: the node did not register", file=sys.stderr, flush=True)
            controller.stop()
            return
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        print(
            f"kvfabric serving on {endpoint}: node {node.name} ({_describe(node)}); "
            f"connect with kvfabric://{host}:{port}",
            flush=True,
        )

    try:
        controller.serve(ready)
    finally:
        for agent in agents:
            agent.stop()
        node.close()
    return 0


def _add_controller_options(parser: argparse.ArgumentParser, default_listen: str) -> None:
    parser.add_argument("--listen", default=default_listen, help="ZeroMQ endpoint to bind")
    parser.add_argument(
        "--index", default="memory", help="index plugin (kvfabric plugins lists them)"
    )
    parser.add_argument(
        "--index-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of the index plugin (repeatable)",
    )
    parser.add_argument("--lease", default="30s", help="a writer's time to publish a grant")
    parser.add_argument("--grace", default="2s", help="how long a freed slot waits for reuse")
    parser.add_argument(
        "--headroom", type=float, default=0.05, help="share of capacity kept free ahead of need"
    )
    parser.add_argument(
        "--node-timeout", default="3s", help="drop a node silent for this long, and its entries"
    )


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="dram")
    parser.add_argument(
        "--backend-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of the backend plugin (repeatable)",
    )
    parser.add_argument(
        "--transport-opt",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="an option of a transport plugin, e.g. tcp.pool=4 (repeatable)",
    )
    parser.add_argument("--capacity", default="4GiB")
    parser.add_argument("--region-size", default="1GiB")
    parser.add_argument("--path", default=None, help="backend path (file-backed backends)")
    parser.add_argument(
        "--transport", default="tcp,shm", help="comma-separated transports to serve"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address data transports bind")
    parser.add_argument(
        "--advertise", default=None, help="host clients use to reach this node (for 0.0.0.0)"
    )
    parser.add_argument("--port", type=int, default=0, help="data port (0: any free one)")
    parser.add_argument("--name", default=None, help="stable node name (default: random)")
    parser.add_argument("--heartbeat", default="1s")
    parser.add_argument("--timeout", default="2s", help="bound on one control round trip")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file", default=None, help="shared secret (else $KVFABRIC_SECRET, if set)"
    )
    parser.add_argument("--log-level", default="INFO")


def add_server_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    controller = sub.add_parser("controller", help="run the index (one per deployment)")
    _add_controller_options(controller, "tcp://127.0.0.1:7100")
    _add_common(controller)
    controller.set_defaults(func=cmd_controller)

    node = sub.add_parser("node", help="run a data node (one per host or memory pool)")
    node.add_argument("--controller", default="tcp://127.0.0.1:7100")
    _add_node_options(node)
    _add_common(node)
    node.set_defaults(func=cmd_node)

    serve = sub.add_parser("serve", help="controller and one data node in one process")
    _add_controller_options(serve, "tcp://127.0.0.1:7100")
    _add_node_options(serve)
    _add_common(serve)
    serve.set_defaults(func=cmd_serve)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
