"""What the peer scripts share: arguments, the row format, and ``kvfabric bench``'s own timing.

The peer scripts run under the peers' own interpreter (a separate virtual environment that
holds Mooncake Store or InfiniStore, never kvfabric), inside a private network namespace
that ``kvfabric bench`` made for them. They measure the workload kvfabric's rows measure with
the code that measures kvfabric: ``framework/_tools/bench_timing.py`` of this clone, which
needs only the standard library, loaded by its path. They print one line per row:
``ROW_MARKER`` and the row as JSON. A peer that cannot run prints ``UNAVAILABLE_MARKER`` and
why, and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "GET_SAMPLES",
    "LOOKUP_SAMPLES",
    "WARM_UP_BYTES",
    "Phase",
    "beside_busy",
    "emit",
    "median_seconds",
    "parse_args",
    "unavailable",
]


def _bench_timing() -> ModuleType:
    """``kvfabric._tools.bench_timing`` from this clone's source, without importing kvfabric."""
    path = Path(__file__).resolve().parents[2] / "framework" / "_tools" / "bench_timing.py"
    spec = importlib.util.spec_from_file_location("kvfabric_bench_timing", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_timing = _bench_timing()
Phase = _timing.Phase
GET_SAMPLES: int = _timing.GET_SAMPLES
LOOKUP_SAMPLES: int = _timing.LOOKUP_SAMPLES
WARM_UP_BYTES: int = _timing.WARM_UP_BYTES
median_seconds = _timing.median_seconds
beside_busy = _timing.beside_busy


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="262144,4194304", help="chunk sizes in bytes")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy-seconds", type=float, default=1.0)
    parser.add_argument("--capacity", type=int, default=2 << 30, help="server memory, bytes")
    args = parser.parse_args()
    args.sizes = tuple(int(s) for s in args.sizes.split(",") if s)
    return args


def unavailable(reason: str) -> None:
    print(_timing.UNAVAILABLE_MARKER + reason, flush=True)
    sys.exit(0)


def emit(
    system: str,
    phase: str,
    size: int,
    count: int,
    seconds: float,
    note: str = "",
    kept: float | None = None,
) -> None:
    row: dict[str, Any] = {
        "system": system,
        "phase": phase,
        "size": size,
        "count": count,
        "seconds": seconds,
        "note": note,
        "kept": kept,
    }
    print(_timing.ROW_MARKER + json.dumps(row), flush=True)
