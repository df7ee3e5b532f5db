"""The ``kvfabric bench`` command's options, and the command itself.

Kept apart from :mod:`kvfabric._tools.bench` so that building the CLI imports nothing the
measuring needs (numpy, redis-py).
"""

from __future__ import annotations

import argparse

__all__ = ["add_bench_arguments", "cmd_bench"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default="256KiB,4MiB", metavar="SIZE,...", help="chunk sizes, comma-separated"
    )
    parser.add_argument("--count", type=int, default=64, help="chunks per batch")
    parser.add_argument(
        "--repeat", type=int, default=3, help="samples per measurement (median shown)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure everything this many times: a report per round, then each target's "
        "median over the rounds and in how many it was met (a shared host's slow spells "
        "move single rounds)",
    )
    parser.add_argument(
        "--capacity",
        help="memory of each server (kvfabric's node, Mooncake's, InfiniStore's); default and "
        "at least: what the fresh puts need",
    )
    parser.add_argument(
        "--transports",
        default="tcp,shm,ucx",
        metavar="NAME,...",
        help="kvfabric transports to measure (those not installed are listed as such)",
    )
    parser.add_argument(
        "--busy-seconds",
        type=float,
        default=1.0,
        help="seconds of each side of the reads-beside-a-busy-thread loop",
    )
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis rows")
    parser.add_argument(
        "--no-peers", action="store_true", help="skip Mooncake Store and InfiniStore"
    )
    parser.add_argument(
        "--peers-python",
        metavar="PATH",
        help="python of a separate venv holding Mooncake Store and InfiniStore (default: "
        "$KVFABRIC_PEERS_PYTHON); they run in a private network namespace",
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from kvfabric._tools.bench import run_bench
    from kvfabric.errors import ConfigError
    from kvfabric.spi.units import parse_size

    for name in ("count", "repeat", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.busy_seconds <= 3600:  # NaN included
        raise ConfigError(f"--busy-seconds: more than 0 and at most 3600, got {args.busy_seconds}")
    sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s)
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes: one or more sizes of at least 1 byte, got {args.sizes!r}")
    transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    unknown = sorted(set(transports) - {"tcp", "shm", "ucx"})
    if unknown:
        raise ConfigError(f"--transports: unknown {', '.join(unknown)}; choose from tcp, shm, ucx")
    run_bench(
        sizes=sizes,
        count=args.count,
        repeat=args.repeat,
        redis=not args.no_redis,
        transports=transports,
        capacity=None if args.capacity is None else parse_size(args.capacity),
        busy_seconds=args.busy_seconds,
        peers=not args.no_peers,
        python_for_peers=args.peers_python,
        rounds=args.rounds,
    )
    return 0
