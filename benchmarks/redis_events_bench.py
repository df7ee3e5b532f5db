"""What KV events cost the redis index's put path:
``python benchmarks/redis_events_bench.py [--rounds 200] [--keys 64] [--repeat 5]``.

One ``redis-server`` (started here, as the tests start theirs) holds one 1 GiB arena; the
redis index takes ``--rounds`` puts of ``--keys`` fresh 4 KiB keys each (``allocate`` then
``publish``), timed three ways, interleaved:

- ``events off`` — no relay asks for events: the functions write no stream (the baseline);
- ``events on, keys`` — the arena is asked for events (``kvf1_events_on``, as a relay
  asks; no relay reads here, so that only the functions' own cost is timed) and the
  functions append each publish's keys to the arena's stream;
- ``events on, blocks`` — the same, each key published with an engine block (a 16-token
  chain, as the vLLM connector attaches), through ``publish_described``.

Printed: the medians over ``--repeat`` runs of the wall time per key seen by the client,
and of Redis's own time per ``FCALL`` (``INFO commandstats``, reset before each run: what
the one Redis thread every client shares spends), each with its ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

from kvfabric import EngineBlock
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationRequest,
    IndexConfig,
    NodeInfo,
    RegionInfo,
)

# The test suite's redis-server processes (tests/redis_servers.py): started the same way here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kv_events_bench import VALUE, engine_blocks, put_through
from redis_servers import RedisDeployment

KINDS = ("events off", "events on, keys", "events on, blocks")


def _blocks(keys: list[bytes]) -> dict[bytes, EngineBlock]:
    return engine_blocks(keys, [uuid.uuid4().bytes + uuid.uuid4().bytes for _ in keys])


def run(deployment: RedisDeployment, kind: str, rounds: int, n: int) -> tuple[float, float]:
    """(seconds per key at the client, Redis's microseconds per FCALL) of one run."""
    namespace = f"b{uuid.uuid4().hex[:10]}"
    index = RedisIndex.create(
        IndexConfig(
            grace=0.0, headroom=0.0, options={"url": deployment.url, "namespace": namespace}
        )
    )
    index.register_node(
        NodeInfo(name="bench", regions=(RegionInfo(id=0, size=1 << 30, rkey=7),), endpoints=())
    )
    batches = []
    for r in range(rounds):
        keys = [fold_key(r * n + i, namespace.encode()) for i in range(n)]
        batches.append((keys, _blocks(keys) if kind == "events on, blocks" else None))
    client = deployment.client(deployment.servers[0].port)
    try:
        index.allocate([AllocationRequest(key=b"w" * 32, length=VALUE)])  # arena made
        if kind != "events off":
            for meta in client.scan_iter(match=f"*{namespace}:a*:m"):
                client.fcall("kvf1_events_on", 1, meta, 600_000)
        client.config_resetstat()
        start = time.perf_counter()
        put_through(index, batches)
        elapsed = time.perf_counter() - start
        fcall = client.info("commandstats").get("cmdstat_fcall", {})
        if kind != "events off":
            assert _streams(client, namespace), "the relay's arena has no stream"
        else:
            assert not _streams(client, namespace), "a stream written without a relay"
    finally:
        index.purge()
        index.close()
        client.close()
    return elapsed / (rounds * n), float(fcall.get("usec_per_call", 0.0))


def _streams(client: object, namespace: str) -> list[bytes]:
    return list(client.scan_iter(match=f"*{namespace}:a*:v"))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    client_s: dict[str, list[float]] = {k: [] for k in KINDS}
    server_us: dict[str, list[float]] = {k: [] for k in KINDS}
    with RedisDeployment.single() as deployment:
        for _ in range(args.repeat):  # interleaved, so drift on a busy machine hits all alike
            for kind in KINDS:
                seconds, per_call = run(deployment, kind, args.rounds, args.keys)
                client_s[kind].append(seconds)
                server_us[kind].append(per_call)
    base_c = statistics.median(client_s["events off"])
    base_s = statistics.median(server_us["events off"])
    print(
        f"{'put path':<14} {'client us/key':>13} {'ratio':>6} {'redis us/FCALL':>15} {'ratio':>6}"
    )
    for kind in KINDS:
        c, s = statistics.median(client_s[kind]), statistics.median(server_us[kind])
        print(f"{kind:<14} {c * 1e6:13.2f} {c / base_c:6.2f} {s:15.1f} {s / base_s:6.2f}")


if __name__ == "__main__":
    main()
