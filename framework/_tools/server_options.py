"""The server commands' options: ``kvfabric controller``, ``kvfabric node`` and ``kvfabric
serve``, each option defined once and shared by the commands that take it (``kvfabric
stats`` reuses the address, shared-index, secret and timeout options).

Only argparse here: building and running what the options describe is
:mod:`kvfabric._tools.server_build` and :mod:`kvfabric._tools.server_run`, imported when a
command runs, so ``--help`` loads neither.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "TIMEOUT_HELP",
    "DeprecatedAlias",
    "HelpFormatter",
    "add_controller_address",
    "add_secret_option",
    "add_server_commands",
    "add_shared_index_options",
    "add_timeout_option",
]

CONTROLLER_ADDRESS = "tcp://127.0.0.1:7100"

_UNITS_EPILOG = (
    "Sizes are bytes (4096) or take a unit: KiB, MiB, GiB, TiB (binary, 1024-based) or KB, "
    "MB, GB, TB (decimal); a lone K/M/G/T is refused as ambiguous. Durations are seconds "
    "(2, 2s) or take ms, us, min. Addresses are HOST:PORT or tcp://HOST:PORT."
)
_PLUGIN_OPTION = "NAME.OPTION=VALUE"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _port(text: str) -> int:
    """A TCP port for argparse: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free one), got {value}")
    return value


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of copies: {text!r}") from None
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"copies of a value: 1 to 16, got {value}")
    return value


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


# -- options more than one command takes -------------------------------------------------


def add_controller_address(parser: argparse.ArgumentParser, default: str) -> None:
    """``--controller``: where a node registers, or whom ``kvfabric stats`` asks."""
    parser.add_argument(
        "--controller",
        default=default,
        metavar="HOST:PORT",
        help="the controller's address (HOST:PORT, tcp://HOST:PORT or kvfabric://HOST:PORT)",
    )


def _add_index_options(
    parser: argparse.ArgumentParser,
    *,
    default: str | None,
    metavar: str | None,
    help: str,
    option_help: str,
) -> None:
    """``--index`` and its ``--index-opt`` settings."""
    parser.add_argument("--index", default=default, metavar=metavar, help=help)
    parser.add_argument(
        "--index-opt",
        action="append",
        default=[],
        metavar=_PLUGIN_OPTION,
        help=option_help,
    )


def add_shared_index_options(parser: argparse.ArgumentParser, use: str) -> None:
    """``--index NAME`` of a shared index, used directly instead of a controller (``use``:
    what the command does with it, e.g. "register with")."""
    _add_index_options(
        parser,
        default=None,
        metavar="NAME",
        help=f"{use} a shared index directly instead of a controller (e.g. redis, with "
        "--index-opt redis.url=redis://HOST:PORT)",
        option_help="an option of the shared index (repeatable)",
    )


def add_secret_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file", default=None, help="shared secret (else $KVFABRIC_SECRET, if set)"
    )


def _add_tenants_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--tenants", default=None, metavar="FILE", help=help)


_TENANTS_HELP = (
    "serve tenants: a TOML file with one [NAME] table per tenant (secret_file, quota as a "
    "size, optional ttl as a duration); each tenant's clients connect with tenant=NAME and "
    "that tenant's secret, and see only their own keys (docs/tenants.md). Needs "
    "--secret-file"
)


TIMEOUT_HELP = (
    "how long to wait for one answer from the controller (or the shared index) before "
    "taking it for away"
)


def add_timeout_option(parser: argparse.ArgumentParser) -> None:
    """``--timeout``: one meaning wherever it is taken (:data:`TIMEOUT_HELP`)."""
    parser.add_argument("--timeout", default="2s", metavar="DURATION", help=TIMEOUT_HELP)


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option, hidden from ``--help``: it still sets the option
    (``dest``), and leaves a warning naming the spelling to use instead in the namespace's
    ``deprecations`` (the command prints it once, on stderr)."""

    def __init__(self, option_strings: list[str], dest: str, *, instead: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        warnings = list(getattr(namespace, "deprecations", []))
        warnings.append(
            f"`{parser.prog} {option_string}` is deprecated; use {self.instead} (the same value)"
        )
        namespace.deprecations = warnings
        setattr(namespace, self.dest, values)


def _add_transports(parser: argparse.ArgumentParser, help: str) -> None:
    """``--transport`` (``help``: what they serve) and their ``--transport-opt`` settings."""
    parser.add_argument("--transport", default="tcp,shm", help=help)
    parser.add_argument(
        "--transport-opt",
        action="append",
        default=[],
        metavar=_PLUGIN_OPTION,
        help="an option of a transport plugin, e.g. tcp.pool=4 (repeatable)",
    )


def _add_bind(
    parser: argparse.ArgumentParser, *, host_help: str, advertise_help: str, port_help: str
) -> None:
    """Where transport servers listen: ``--host``, ``--advertise``, ``--port``."""
    parser.add_argument("--host", default="127.0.0.1", help=host_help)
    parser.add_argument("--advertise", default=None, help=advertise_help)
    parser.add_argument("--port", type=_port, default=0, help=port_help)


# -- the groups of options of each kind of process ----------------------------------------


def _add_controller_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        default=CONTROLLER_ADDRESS,
        metavar="HOST:PORT",
        help="address the controller binds (HOST:PORT or tcp://HOST:PORT; 0.0.0.0 for all "
        "interfaces)",
    )
    _add_index_options(
        parser,
        default="memory",
        metavar=None,
        help="index plugin (`kvfabric plugins` lists them)",
        option_help="an option of the index plugin (repeatable)",
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
        help="share of the capacity not leased to writers kept free ahead of need, by "
        "evicting least recently used",
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
    parser.add_argument(
        "--max-frame",
        default="4MiB",
        metavar="SIZE",
        help="the largest control frame taken (at least 1MiB); a larger one is dropped "
        "unread and its connection closed (clients send large requests in chunks of at "
        "most 256KiB)",
    )
    parser.add_argument(
        "--max-client-bytes",
        default="50%",
        metavar="SIZE|PERCENT",
        help="what one client may hold reserved (grants not yet published, extents "
        "leased), as bytes or a share of the store's capacity; its puts past it are "
        "NO_SPACE, other clients' are not affected",
    )
    parser.add_argument(
        "--max-client-grants",
        type=_positive_count,
        default=65536,
        metavar="N",
        help="grants not yet published plus extents leased that one client may hold",
    )


def _add_kv_events_options(parser: argparse.ArgumentParser, *, relays: bool = False) -> None:
    """Where the index's KV events are published, in vLLM's format (controller, serve)."""
    parser.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish KV events (what the store holds: blocks stored, removed, cleared) on "
        "a ZeroMQ PUB socket, as vLLM's --kv-events-config does: tcp://*:PORT binds (a "
        "subscriber connects), tcp://HOST:PORT connects to a subscriber that binds "
        "(default: none)"
        + (
            ". With --index redis, the controller relays the changes every client and node "
            "makes in its namespace: run one per namespace"
            if relays
            else ""
        ),
    )
    parser.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="bind a ZeroMQ ROUTER socket that answers a start sequence number with the "
        "event batches kept since (vLLM's replay_endpoint; e.g. tcp://127.0.0.1:5558)",
    )
    parser.add_argument(
        "--kv-events-topic",
        default="",
        metavar="TOPIC",
        help="the topic frame of every event message (vLLM's topic; llm-d expects kv@POD@MODEL)",
    )


def _add_image_options(parser: argparse.ArgumentParser) -> None:
    """A controller's own transport servers, for the lookup image."""
    _add_transports(
        parser,
        "comma-separated transports serving the index's lookup image, which clients read "
        "one-sided instead of asking the controller (none: lookups by RPC only)",
    )
    _add_bind(
        parser,
        host_help="address image transports bind",
        advertise_help="host clients use to reach them (for 0.0.0.0)",
        port_help="image transport port (0: any free one)",
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
        metavar=_PLUGIN_OPTION,
        help="an option of the backend plugin (repeatable)",
    )
    _add_transports(parser, "comma-separated transports to serve")
    parser.add_argument("--path", default=None, help="backend path (file-backed backends)")
    _add_bind(
        parser,
        host_help="address data transports bind",
        advertise_help="host clients use to reach this node (for 0.0.0.0)",
        port_help="data port (0: any free one)",
    )
    parser.add_argument("--name", default=None, help="stable node name (default: random)")
    parser.add_argument(
        "--heartbeat",
        default="1s",
        metavar="DURATION",
        help="how often the node reports to the controller (keep it well under the "
        "controller's --node-timeout)",
    )
    add_timeout_option(parser)


def _add_metrics_options(parser: argparse.ArgumentParser, *, controller: bool) -> None:
    """``--metrics-port`` and ``--metrics-host``; with ``controller`` (whose scrapes ask
    the controller for its counters) ``--metrics-timeout``."""
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics, and /healthz "
        "(alive) and /readyz (ready to serve) beside them (0: any free port, printed at "
        "start-up; default: no endpoint)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics endpoint binds (0.0.0.0 for all interfaces)",
    )
    if not controller:
        return
    parser.add_argument(
        "--metrics-timeout",
        default="2s",
        metavar="DURATION",
        help="how long a scrape of the controller's endpoint waits for its counters",
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    add_secret_option(parser)
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="what is logged on stderr",
    )


# -- the commands --------------------------------------------------------------------------


def _run_controller(args: argparse.Namespace) -> int:
    from kvfabric._tools.server_run import run_controller

    return run_controller(args)


def _run_node(args: argparse.Namespace) -> int:
    from kvfabric._tools.server_run import run_node

    return run_node(args)


def _run_serve(args: argparse.Namespace) -> int:
    from kvfabric._tools.server_run import run_serve

    return run_serve(args)


def add_server_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    controller = sub.add_parser(
        "controller",
        help="run the index (one per deployment)",
        description="Run the controller: the index of what is stored where, behind one "
        "ZeroMQ port. Data nodes register with it; clients send it their lookups.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_controller_options(controller)
    _add_kv_events_options(controller, relays=True)
    _add_tenants_option(controller, _TENANTS_HELP)
    _add_image_options(controller)
    _add_metrics_options(controller, controller=True)
    controller.add_argument(
        "--timeout",
        dest="metrics_timeout",
        action=DeprecatedAlias,
        instead="--metrics-timeout",
        metavar="DURATION",
        help=argparse.SUPPRESS,
    )
    _add_common(controller)
    controller.set_defaults(func=_run_controller)

    node = sub.add_parser(
        "node",
        help="run a data node (one per host or memory pool)",
        description="Run a data node: memory served over data transports, registered with "
        "a controller. It waits (and says so on stderr) until the controller answers.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_controller_address(node, CONTROLLER_ADDRESS)
    add_shared_index_options(node, "register with")
    _add_node_options(node)
    _add_tenants_option(
        node,
        "the controller's tenants file: this node's tcp port then also admits each tenant's "
        "clients (by their tenant's secret)",
    )
    _add_metrics_options(node, controller=False)
    _add_common(node)
    node.set_defaults(func=_run_node)

    serve = sub.add_parser(
        "serve",
        help="controller and one data node in one process",
        description="Run a controller and one data node in one process: a whole store on one host.",
        epilog=_UNITS_EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_controller_options(serve)
    _add_kv_events_options(serve)
    _add_tenants_option(serve, _TENANTS_HELP)
    _add_node_options(serve)
    _add_metrics_options(serve, controller=True)
    _add_common(serve)
    serve.set_defaults(func=_run_serve)
