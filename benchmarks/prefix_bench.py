"""kvfabric against memcpy, a raw socket, Redis, Mooncake Store and InfiniStore:
``python benchmarks/prefix_bench.py``.

The same as ``kvfabric bench`` (see kvfabric._tools.bench for what is measured); arguments pass
through, e.g. ``--sizes 4MiB --repeat 9 --no-redis --peers-python ../peers-venv/bin/python``.
"""

from __future__ import annotations

import sys

from kvfabric._tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
