"""The ``kvfabric`` command line.

Nothing here (nor in what ``demo``, ``bench`` and the server commands import) imports
pytest or :mod:`kvfabric.testing`: the commands run on a plain ``pip install kvfabric``.
Errors are one ``kvfabric: error: ...`` line on stderr and exit status 2. Options come from
flags, ``KVFABRIC_*`` variables and ``--config FILE``, in that order of precedence
(:mod:`kvfabric._tools.config_sources`). Output into a pipe closed early (``| head``) ends
the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvfabric import __version__
from kvfabric._tools.bench_cli import add_bench_arguments
from kvfabric._tools.config_sources import apply_sources, commands_of
from kvfabric._tools.server_options import (
    HelpFormatter,
    add_controller_address,
    add_secret_option,
    add_server_commands,
    add_shared_index_options,
    add_timeout_option,
)
from kvfabric.errors import AuthenticationError, ControllerUnavailableError, KvfabricError

__all__ = ["build_parser", "main"]

_SIGPIPE_STATUS = 141
"""What a shell reports for a command ended by SIGPIPE (128 + 13), as `head` leaves it."""

_DEMO_DESCRIPTION = """\
An LMCache-like workload against a store, in about a second on the default embedded
store. SESSIONS chat sessions share one SYSTEM_TOKENS-token system prompt and each add
TURNS turns of their own; per request the "engine" looks up how many leading 256-token
chunks are stored, loads them, computes the rest and offers every chunk for storage.

It prints progress on stderr (requests done / all requests, elapsed), then per turn the
prefix hits and bytes loaded vs computed, and in sum: bytes offered vs stored (the dedup:
chunks stored once already move no bytes when offered again), control round trips per
lookup+get (none where the lookup reads the index's lookup image, one where the index
keeps none), validation failures and wrong values (both 0), and read throughput next to
a plain memcpy of the same chunks (the ceiling of any local read; a get also checksums
every byte, so a ratio well under 1 is expected)."""


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvfabric._tools.demo import DemoConfig, check_demo_store, run_demo

    config = DemoConfig(
        url=args.url,
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    check_demo_store(config)
    report = run_demo(config)
    return 1 if report.wrong_values else 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from importlib import import_module

    from kvfabric._plugins import install_hint, installed_plugins, plugin_manager
    from kvfabric.spi.options import Plugin

    manager = plugin_manager()
    rows = [("kind", "name", "status", "distribution", "entry point")]
    problems: list[str] = []
    options: list[str] = []
    for plugin in installed_plugins():
        status = "ok"
        try:
            cls: type[Plugin] | None = None
            if plugin.kind == "transport":
                cls = manager.transport(plugin.name)
            elif plugin.kind == "backend":
                cls = manager.backend(plugin.name)
            elif plugin.kind == "index":
                cls = manager.index(plugin.name)
            else:
                import_module(plugin.target.partition(":")[0])
            for spec in cls.options if cls is not None else ():
                options.append(f"  {plugin.name}.{spec.describe()}")
        except (KvfabricError, ImportError) as exc:
            status = "unavailable"
            reason = str(exc)
            problems.append(f"  {plugin.kind} {plugin.name}: {reason}")
            hint = install_hint(plugin.kind, plugin.name)
            if hint and "pip install" not in reason:
                problems.append(f"    install: {hint}")
        rows.append(
            (
                plugin.kind,
                plugin.name,
                status,
                f"{plugin.distribution} {plugin.version}",
                plugin.target,
            )
        )
    _print_table(rows)
    if options:
        print(
            "\noptions (?NAME.OPTION=VALUE in a store URL; on the server commands "
            "--transport-opt, --backend-opt, --index-opt NAME.OPTION=VALUE):"
        )
        print("\n".join(options))
    if problems:
        print("\nunavailable here:")
        print("\n".join(problems))
        print(
            "  (from a clone of the repository, install extras as '.[NAME]' instead of "
            "'kvfabric[NAME]')"
        )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfabric._tools.bench_cli import cmd_bench

    return cmd_bench(args)


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvfabric._control.client import ControlClient
    from kvfabric._control.remote_index import fetch_stats
    from kvfabric._control.security import Credentials, load_secret
    from kvfabric._tools.endpoints import control_endpoint
    from kvfabric._tools.server_build import duration
    from kvfabric._tools.stats_format import FORMATS

    if args.index:
        print(FORMATS[args.format](_shared_index_stats(args)))
        return 0
    secret = load_secret(args.secret_file)
    endpoint = control_endpoint(args.controller, "--controller")
    client = ControlClient(
        endpoint,
        timeout=duration(args.timeout, "--timeout"),
        credentials=Credentials.from_secret(secret) if secret else None,
    )
    try:
        scopes = fetch_stats(client)
    except AuthenticationError:
        raise  # its message says what to change
    except ControllerUnavailableError as exc:
        secured = " and the same secret" if secret else ""
        raise ControllerUnavailableError(
            f"{exc} (`kvfabric controller` or `kvfabric serve` runs one; give its address "
            f"with --controller HOST:PORT{secured})"
        ) from None
    finally:
        client.close()
    print(FORMATS[args.format](scopes))
    return 0


def _shared_index_stats(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """A shared index's counters (per shard for redis) and what it lists of each node,
    read from the index itself: there is no controller to ask. The nodes' own counters
    (bytes served, connections) are on each node's --metrics-port."""
    from kvfabric._tools.server_build import index_from_options

    index = index_from_options(args.index, args.index_opt)
    try:
        scopes: dict[str, dict[str, int]] = {"index": index.shared_stats()}
        for node in index.nodes():
            scopes[f"node {node.id} {node.name}"] = {
                "incarnation": node.incarnation,
                "regions": len(node.regions),
                "capacity_bytes": sum(r.size for r in node.regions),
            }
    finally:
        index.close()
    return scopes


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfabric",
        description="A remote KV-cache tier for LLM serving.",
        epilog="`kvfabric COMMAND --help` describes each command, its options and defaults.",
    )
    parser.add_argument("--version", action="version", version=f"kvfabric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="show prefix reuse, dedup and validation (about a second)",
        description=_DEMO_DESCRIPTION,
        formatter_class=_DemoFormatter,
    )
    demo.add_argument(
        "--url",
        default="embedded://?capacity=512MiB",
        help="store to use: embedded://?... runs everything in this process; "
        "kvfabric://HOST:PORT uses a running `kvfabric serve` or controller",
    )
    demo.add_argument("--sessions", type=_positive, default=8, help="chat sessions")
    demo.add_argument("--turns", type=_positive, default=4, help="turns per session")
    demo.add_argument(
        "--system-tokens",
        type=_positive,
        default=4096,
        help="tokens of the system prompt every session shares",
    )
    demo.add_argument(
        "--kv-bytes-per-token",
        type=_positive,
        default=2048,
        help="KV-cache bytes per token (2048: 512 KiB per 256-token chunk)",
    )
    demo.set_defaults(func=_cmd_demo)

    plugins = sub.add_parser(
        "plugins",
        help="list installed transports, backends, indexes and adapters",
        description="List every installed plugin, whether it can be used here, and for "
        "those that cannot, why and how to install what they need.",
    )
    plugins.set_defaults(func=_cmd_plugins)

    add_server_commands(sub)

    bench = sub.add_parser(
        "bench",
        help="kvfabric vs memcpy, raw sockets, Redis, Mooncake Store and InfiniStore",
        description="Time kvfabric (over tcp, shm and ucx where installed, against real "
        "controller and node processes) next to memcpy, a raw socket, Redis and, where "
        "their venv is given, Mooncake Store and InfiniStore; print tables of medians and "
        "ratios, and the targets kvfabric is held to, each marked met or not. The Redis rows "
        "need redis-py ('kvfabric[bench]') and redis-server on PATH. 'kvfabric bench "
        "serving ...' runs the serving benchmark instead (vLLM engines, time to first "
        "token; from a clone: docs/serving-benchmark.md); 'kvfabric bench serving --help' "
        "lists its options.",
        formatter_class=HelpFormatter,
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    stats = sub.add_parser(
        "stats",
        help="print the controller's and each node's counters",
        description="Print the counters of a running controller, its index and every data "
        "node: a table, Prometheus text (the same as --metrics-port serves) or JSON.",
        formatter_class=HelpFormatter,
    )
    add_controller_address(stats, "127.0.0.1:7100")
    add_shared_index_options(stats, "read")
    add_secret_option(stats)
    add_timeout_option(stats)
    stats.add_argument(
        "--format",
        choices=("table", "prometheus", "json"),
        default="table",
        help="a table, Prometheus text exposition, or JSON",
    )
    stats.set_defaults(func=_cmd_stats)
    for command in commands_of(parser).values():
        command.add_argument(
            "--config",
            default=None,
            metavar="FILE",
            help="read options from this TOML file: keys named as the options "
            '(capacity = "64GiB"), at the top level or in a table per command ([node]); '
            "every option can also be set as KVFABRIC_NAME (--foo-bar: KVFABRIC_FOO_BAR). "
            "Flags win over the environment, the environment over the file "
            "(default: $KVFABRIC_CONFIG)",
        )
    return parser


class _DemoFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the description's paragraphs kept as written."""


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command's options from its flags, then ``KVFABRIC_*`` variables, then its
    ``--config`` file (see :mod:`kvfabric._tools.config_sources`)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    first = parser.parse_args(argv)
    fill = apply_sources(parser, first.command, first.config)
    args = parser.parse_args(argv)
    fill(args)
    for warning in getattr(args, "deprecations", []):
        print(f"kvfabric: warning: {warning}", file=sys.stderr)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:2] == ["bench", "serving"]:
        # The serving benchmark's options are its script's own; handed over untouched.
        from kvfabric._tools.bench_serving import run_serving_bench

        try:
            return run_serving_bench(given[2:])
        except KvfabricError as exc:
            print(f"kvfabric: error: {exc}", file=sys.stderr)
            return 2
    try:
        args = _parse(given)
    except KvfabricError as exc:
        print(f"kvfabric: error: {exc}", file=sys.stderr)
        return 2
    if hasattr(args, "log_level"):
        from kvfabric._tools.server_run import configure_logging

        configure_logging(args.log_level)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe is found here, not at exit
        return status
    except BrokenPipeError:
        # The reader went away (`kvfabric stats | head`): stop quietly, as Unix tools do.
        # Python would otherwise flush stdout again at exit, and fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _SIGPIPE_STATUS
    except KvfabricError as exc:
        print(f"kvfabric: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
