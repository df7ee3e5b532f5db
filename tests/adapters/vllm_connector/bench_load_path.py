"""Measure the connector's load path against a zero-copy alternative (prints a table).

    python tests/adapters/vllm_connector/bench_load_path.py [--blocks 64] [--repeat 5]

Against real kvfabric processes (``kvfabric.testing.Cluster``), over ``shm`` and ``tcp``,
for a KV cache shaped like vLLM's on CPU (per layer ``[num_blocks, kv_heads, block_size,
2 * head_size]``, all layers in one allocation):

- ``staged``: one value per block (its page of every layer); ``batched_get(into=staging
  rows)``, then ``PagedKV.scatter`` copies every page into place in one call (the
  connector's path: a load abandoned at its deadline may still land, and must land in its
  own buffer, never in pages vLLM has reused).
- ``scattered``: the same values landed straight in the pages with
  ``batched_get_scattered``: one copy, but no way to keep a late read out of the pages.
- ``per-layer``: the zero-copy alternative. One value per (block, layer), read with
  ``batched_get(into=the pages themselves)``: no second copy, but ``layers`` times the keys.
- ``memcpy``: one plain copy of the same bytes, the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import kvfabric
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.testing import Cluster

GEOMETRIES = {
    # name: (layers, kv heads, block size, head size, dtype)
    "test model (4 layers, 64 KiB pages)": (4, 4, 32, 64, torch.float32),
    "8B-like (32 layers, 128 KiB pages)": (32, 8, 32, 128, torch.bfloat16),
}


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: page faults, prefetch, connections
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench(
    url: str, geometry: tuple[int, int, int, int, torch.dtype], blocks: int, repeat: int
) -> tuple[int, dict[str, float]]:
    layers, heads, block_size, head_size, dtype = geometry
    num_blocks = blocks * 2
    # One allocation, layer after layer, as vLLM's CPU worker lays it out.
    storage = torch.zeros(layers, num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    caches = {f"layer{i}": storage[i] for i in range(layers)}
    pages = PagedKV(caches, num_blocks)
    block_ids = list(range(1, 2 * blocks, 2))  # not adjacent, as in a real cache
    store = kvfabric.connect(url)
    try:
        source = pages.new_values(blocks).random_(0, 256)
        namespace = ["bench", str(geometry)]  # one per geometry: values differ in size
        block_keys = [kvfabric.fold_key(i, [*namespace, "block"]) for i in range(blocks)]
        store.batched_put(block_keys, [row.numpy() for row in source])
        layer_views = [caches[f"layer{i}"].view(torch.uint8) for i in range(layers)]
        layer_keys = [
            kvfabric.fold_key(i * layers + layer, [*namespace, "layer"])
            for i in range(blocks)
            for layer in range(layers)
        ]
        page_bytes = pages.value_bytes // layers
        store.batched_put(
            layer_keys,
            [
                source[i, layer * page_bytes : (layer + 1) * page_bytes].numpy()
                for i in range(blocks)
                for layer in range(layers)
            ],
        )
        landing = pages.new_values(blocks)
        rows = list(enumerate(block_ids))

        def staged_get() -> None:
            values = store.batched_get(block_keys, into=landing.numpy())
            assert all(v is not None and v.nbytes == pages.value_bytes for v in values)

        def staged() -> None:
            staged_get()
            pages.scatter(landing, rows)

        def scattered() -> None:
            targets = pages_of = [pages.host_pages_of(b) for b in block_ids]
            assert all(t is not None for t in targets)
            flags = store.batched_get_scattered(block_keys, pages_of)  # type: ignore[arg-type]
            assert all(flags)

        def per_layer() -> None:
            into = [layer_views[layer][b].numpy() for b in block_ids for layer in range(layers)]
            values = store.batched_get(layer_keys, into=into)
            assert all(v is not None and v.nbytes == page_bytes for v in values)

        memcpy_target = torch.empty_like(source)
        result = {
            "staged get": median_seconds(staged_get, repeat),
            "staged get+scatter (what the connector does)": median_seconds(staged, repeat),
            "scattered get": median_seconds(scattered, repeat),
            "per-layer (zero-copy)": median_seconds(per_layer, repeat),
            "memcpy": median_seconds(
                lambda: memcpy_target.numpy().__setitem__(..., source), repeat
            ),
        }
        return pages.value_bytes * blocks, result
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with Cluster(nodes=1, capacity="2GiB") as cluster:
        for name, geometry in GEOMETRIES.items():
            for transport in ("shm", "tcp"):
                size, result = bench(
                    cluster.url(transport=transport), geometry, args.blocks, args.repeat
                )
                base = result["staged get+scatter (what the connector does)"]
                print(f"\n{name}, {args.blocks} blocks, {size / 2**20:.0f} MiB, over {transport}")
                for what, seconds in result.items():
                    print(
                        f"  {what:48s} {seconds * 1e3:8.2f} ms {size / seconds / 1e9:6.2f} GB/s"
                        f"  {seconds / base:5.2f}x of staged"
                    )


if __name__ == "__main__":
    main()
