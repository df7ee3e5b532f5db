"""What KV events cost the index's put path, in process:
``python benchmarks/kv_events_bench.py [--rounds 200] [--keys 64] [--repeat 5]``.

One memory index (one 1 GiB region) takes ``--rounds`` puts of ``--keys`` fresh 4 KiB keys
each (``allocate`` then ``publish``, as a controller serves them), timed three ways:

- ``no events`` — the index as a controller without ``--kv-events`` runs it (the baseline);
- ``events, keys`` — the index reports every store to a publisher whose thread encodes and
  sends the batches on a PUB socket no one reads (ZeroMQ drops them), as with
  ``--kv-events``; the blocks are named by their keys;
- ``events, blocks`` — the same, each key published with an engine block (a 16-token chain,
  as the vLLM connector attaches), through ``publish_described``.

Each is timed until its publisher thread has sent everything (so the encoding's cost in the
process is counted), and the medians over ``--repeat`` runs are printed as µs per key with
the ratio to the baseline; then ``encode_batch``'s own cost per change of either kind. On a
busy machine the times move, the ratios less.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvfabric import EngineBlock
from kvfabric._control.kv_event_wire import EventKind, encode_batch
from kvfabric._control.kv_events import KvEventPublisher
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    Index,
    NodeInfo,
    RegionInfo,
)

VALUE = 4096


def _index() -> MemoryIndex:
    index = MemoryIndex(lease=30.0, grace=0.0, headroom=0.0)
    region = RegionInfo(id=0, size=1 << 30, rkey=42)
    index.register_node(NodeInfo(name="bench", regions=(region,), endpoints=()))
    return index


def engine_blocks(keys: list[bytes], hashes: list[bytes]) -> dict[bytes, EngineBlock]:
    """An engine's chain of 16-token blocks over ``keys``, named by ``hashes``."""
    return {
        key: EngineBlock(
            hash=hashes[i],
            parent=hashes[i - 1] if i else None,
            token_ids=range(16 * i, 16 * i + 16),
            block_size=16,
        )
        for i, key in enumerate(keys)
    }


def _blocks(keys: list[bytes], first: int) -> dict[bytes, EngineBlock]:
    return engine_blocks(keys, [(first + i).to_bytes(32, "big") for i in range(len(keys))])


def put_through(
    index: Index, batches: list[tuple[list[bytes], dict[bytes, EngineBlock] | None]]
) -> None:
    """Allocate and publish each batch of ``VALUE``-byte values, with its blocks if any."""
    for keys, blocks in batches:
        result = index.allocate([AllocationRequest(key=k, length=VALUE) for k in keys])
        grants = [
            GrantRef.of(a.descriptor, 0)
            for a in result.allocations
            if a.kind is AllocationKind.GRANTED and a.descriptor is not None
        ]
        if blocks is None:
            index.publish(grants)
        else:
            index.publish_described(grants, blocks)


def run(kind: str, rounds: int, n: int) -> float:
    """Seconds per key for ``rounds`` puts of ``n`` keys."""
    index = _index()
    publisher = None
    if kind != "no events":
        publisher = KvEventPublisher("tcp://127.0.0.1:1")  # connects: nothing there to read
        index.report_events(publisher.queue)
        publisher.start()
    batches = []
    for r in range(rounds):
        keys = [fold_key(r * n + i, b"kv-events-bench") for i in range(n)]
        blocks = _blocks(keys, r * n) if kind == "events, blocks" else None
        batches.append((keys, blocks))
    try:
        start = time.perf_counter()
        put_through(index, batches)
        while publisher is not None and publisher.stats()["kv_events_queued"]:
            time.sleep(0.001)
        elapsed = time.perf_counter() - start
    finally:
        if publisher is not None:
            publisher.close()
        index.close()
    return elapsed / (rounds * n)


def encode_cost(blocks: bool, n: int = 4096) -> float:
    """Seconds per change of one batch of ``n`` stores (one chain, with ``blocks``)."""
    keys = [i.to_bytes(32, "big") for i in range(n)]
    chain = _blocks(keys, 0) if blocks else {}
    changes = [(EventKind.STORED, k, chain.get(k)) for k in keys]
    start = time.perf_counter()
    for _ in range(10):
        encode_batch(changes, 1.0)
    return (time.perf_counter() - start) / (10 * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    kinds = ("no events", "events, keys", "events, blocks")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeat):  # interleaved, so drift on a busy machine hits all alike
        for kind in kinds:
            times[kind].append(run(kind, args.rounds, args.keys))
    base = statistics.median(times["no events"])
    print(f"{'put path':<16} {'us/key':>8} {'ratio':>6}")
    for kind in kinds:
        t = statistics.median(times[kind])
        print(f"{kind:<16} {t * 1e6:8.2f} {t / base:6.2f}")
    print(f"encode_batch, a change named by its key: {encode_cost(False) * 1e6:.2f} us")
    print(f"encode_batch, a change with an engine block: {encode_cost(True) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
