"""The ``kvfabric`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvfabric.errors import KvfabricError

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvfabric._tools.demo import DemoConfig, run_demo

    config = DemoConfig(
        url=args.url,
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    report = run_demo(config)
    return 1 if report.wrong_values else 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from kvfabric.spi.plugins import installed_plugins, plugin_manager

    manager = plugin_manager()
    rows = [("kind", "name", "status", "distribution", "entry point")]
    for plugin in installed_plugins():
        status = "ok"
        try:
            if plugin.kind == "transport":
                manager.transport(plugin.name)
            elif plugin.kind == "backend":
                manager.backend(plugin.name)
            else:
                from importlib import import_module

                import_module(plugin.target.partition(":")[0])
        except (KvfabricError, ImportError) as exc:
            status = f"unavailable: {exc}"
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
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfabric._tools.bench import run_bench
    from kvfabric.spi.units import parse_size

    sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s)
    run_bench(sizes=sizes, count=args.count, repeat=args.repeat, redis=not args.no_redis)
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from kvfabric._control.client import ControlClient
    from kvfabric._control.remote_index import fetch_stats
    from kvfabric._control.security import Credentials, load_secret
    from kvfabric._tools.stats_format import FORMATS
    from kvfabric.spi.units import parse_duration

    secret = load_secret(args.secret_file)
    endpoint = args.controller
    if endpoint.startswith("kvfabric://"):
        endpoint = "tcp://" + endpoint.removeprefix("kvfabric://").split("?")[0]
    client = ControlClient(
        endpoint,
        timeout=parse_duration(args.timeout),
        credentials=Credentials.from_secret(secret) if secret else None,
    )
    try:
        scopes = fetch_stats(client)
    finally:
        client.close()
    print(FORMATS[args.format](scopes))
    return 0


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfabric", description="A remote KV-cache tier for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="show prefix reuse, dedup and validation in a minute")
    demo.add_argument("--url", default="embedded://?capacity=512MiB", help="store to use")
    demo.add_argument("--sessions", type=int, default=8)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--system-tokens", type=int, default=4096)
    demo.add_argument("--kv-bytes-per-token", type=int, default=2048)
    demo.set_defaults(func=_cmd_demo)

    plugins = sub.add_parser("plugins", help="list installed transports, backends, adapters")
    plugins.set_defaults(func=_cmd_plugins)

    from kvfabric._tools.server_cli import add_server_commands

    add_server_commands(sub)

    bench = sub.add_parser("bench", help="kvfabric vs memcpy, raw sockets and Redis")
    bench.add_argument("--sizes", default="256KiB,4MiB", help="chunk sizes, comma-separated")
    bench.add_argument("--count", type=int, default=64, help="chunks per batch")
    bench.add_argument("--repeat", type=int, default=5)
    bench.add_argument("--no-redis", action="store_true", help="skip the Redis rows")
    bench.set_defaults(func=_cmd_bench)

    stats = sub.add_parser("stats", help="print the controller's and each node's counters")
    stats.add_argument("--controller", default="tcp://127.0.0.1:7100")
    stats.add_argument("--secret-file", default=None)
    stats.add_argument("--timeout", default="2s")
    stats.add_argument(
        "--format",
        choices=("table", "prometheus", "json"),
        default="table",
        help="a table, Prometheus text exposition, or JSON",
    )
    stats.set_defaults(func=_cmd_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):
        from kvfabric._tools.server_cli import configure_logging

        configure_logging(args.log_level)
    try:
        return int(args.func(args))
    except KvfabricError as exc:
        print(f"kvfabric: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
