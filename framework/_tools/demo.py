"""``kvfabric demo``: an LMCache-like workload showing prefix reuse, dedup and validation.

Several chat sessions share one long system prompt and add turns of their own. For every
request the "engine" asks how many leading 256-token chunks are stored (one lookup), loads
them into its own buffers, computes the rest, and offers every chunk of the prompt for
storage. The lookup reads the index's lookup image (a control round trip only where the index
keeps none), the load uses the descriptors the lookup found, and each distinct chunk is
stored once. The KV bytes are synthetic but depend only on the chunk's prefix, so
every loaded chunk is checked against what the engine would have computed.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import attrs
import numpy as np

import kvfabric
from kvfabric._node.capacity import check_capacity
from kvfabric._plugins import plugin_manager
from kvfabric._tools.progress import Progress
from kvfabric.keys import chain_keys
from kvfabric.spi.units import format_size
from kvfabric.urls import EmbeddedOptions, parse_url

__all__ = ["DemoConfig", "DemoReport", "check_demo_store", "run_demo"]


@attrs.frozen(kw_only=True)
class DemoConfig:
    url: str = "embedded://?capacity=512MiB"
    sessions: int = 8
    turns: int = 4
    system_tokens: int = 4096
    turn_tokens: tuple[int, int] = (384, 768)
    chunk_tokens: int = 256
    kv_bytes_per_token: int = 2048
    """KV bytes per token: 2048 gives 512 KiB chunks (a small model; Llama-3-8B is 128 KiB)."""
    seed: int = 0


@attrs.define
class _TurnRow:
    requests: int = 0
    chunks: int = 0
    hits: int = 0
    rpcs: int = 0
    loaded: int = 0
    computed: int = 0


@attrs.frozen(kw_only=True)
class DemoReport:
    requests: int
    prefix_hits: int
    chunks: int
    lookup_get_rpcs: int
    bytes_offered: int
    bytes_stored: int
    dedup_hits: int
    validation_failures: int
    wrong_values: int
    bytes_loaded: int
    get_seconds: float
    memcpy_seconds: float
    seconds: float


def _chunk_kv(key: bytes, size: int) -> np.ndarray:
    """What the engine would compute for this chunk: a function of its prefix only."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, size, dtype=np.uint8)


def _memcpy_seconds(nbytes: int, working_set: int, pool: list[np.ndarray]) -> float:
    """A plain memcpy of the same bytes, chunk by chunk, from a source as large as what the
    store holds into the same destination buffers: the floor for any local read."""
    chunk = pool[0].nbytes
    sources = max(1, min(working_set, 512 << 20) // chunk)
    src = np.random.default_rng(1).integers(0, 256, sources * chunk, dtype=np.uint8)
    copies = max(1, nbytes // chunk)
    started = time.perf_counter()
    for n in range(copies):
        start = (n % sources) * chunk
        np.copyto(pool[n % len(pool)], src[start : start + chunk])
    return time.perf_counter() - started


def check_demo_store(config: DemoConfig) -> None:
    """Refuse an embedded capacity this machine cannot give before allocating any of it."""
    url = parse_url(config.url)
    if isinstance(url.options, EmbeddedOptions):
        options = url.options
        check_capacity(
            options.capacity,
            min(options.region_size, options.capacity),
            plugin_manager().backend(options.backend),
            option="capacity",
            region_option="region_size",
        )


def run_demo(config: DemoConfig, out: TextIO = sys.stdout) -> DemoReport:
    rng = np.random.default_rng(config.seed)
    chunk_bytes = config.chunk_tokens * config.kv_bytes_per_token
    system = rng.integers(0, 32000, config.system_tokens).tolist()
    histories: list[list[int]] = [[] for _ in range(config.sessions)]
    namespace = b"demo-model|fp16|chunk256"
    expected: dict[bytes, np.ndarray] = {}
    rows = [_TurnRow() for _ in range(config.turns)]
    wrong = offered = loaded = 0
    get_seconds = 0.0
    started = time.perf_counter()
    total = config.sessions * config.turns
    progress = Progress(total, "kvfabric demo", unit="requests")
    pool: list[np.ndarray] = []

    with kvfabric.connect(config.url) as store:
        for turn in range(config.turns):
            row = rows[turn]
            # Sessions interleave, as requests from many users do.
            for session in range(config.sessions):
                low, high = config.turn_tokens
                histories[session] += rng.integers(0, 32000, int(rng.integers(low, high))).tolist()
                prompt = system + histories[session]
                keys = chain_keys(prompt, config.chunk_tokens, namespace, full_only=True)
                while len(pool) < len(keys):
                    pool.append(np.empty(chunk_bytes, dtype=np.uint8))

                rpcs_before = store.stats()["control_rpcs"]
                t0 = time.perf_counter()
                hits = store.batched_contains(keys)
                values = store.batched_get(keys[:hits], into=pool[:hits])
                get_seconds += time.perf_counter() - t0
                row.rpcs += store.stats()["control_rpcs"] - rpcs_before

                for key, value in zip(keys[:hits], values, strict=True):
                    if value is None or not np.array_equal(
                        np.frombuffer(value, np.uint8), expected[key]
                    ):
                        wrong += 1
                    else:
                        loaded += chunk_bytes
                        row.loaded += chunk_bytes
                computed = [_chunk_kv(k, chunk_bytes) for k in keys[hits:]]
                for key, kv in zip(keys[hits:], computed, strict=True):
                    expected.setdefault(key, kv)
                # The engine offers its whole prompt's KV; stored chunks move no bytes.
                kv_all = list(pool[:hits]) + computed
                store.batched_put(keys, kv_all)
                offered += chunk_bytes * len(keys)
                row.requests += 1
                row.chunks += len(keys)
                row.hits += hits
                row.computed += len(computed) * chunk_bytes
                progress.advance(note=f"turn {turn + 1}, hits {hits}/{len(keys)}")
        progress.finish()
        stats = store.stats()

    report = DemoReport(
        requests=total,
        prefix_hits=sum(r.hits for r in rows),
        chunks=sum(r.chunks for r in rows),
        lookup_get_rpcs=sum(r.rpcs for r in rows),
        bytes_offered=offered,
        bytes_stored=stats["payload_bytes_written"],
        dedup_hits=stats["dedup_hits"],
        validation_failures=stats["validation_failures"],
        wrong_values=wrong,
        bytes_loaded=loaded,
        get_seconds=get_seconds,
        memcpy_seconds=_memcpy_seconds(loaded, stats["payload_bytes_written"], pool),
        seconds=time.perf_counter() - started,
    )
    _print_report(config, rows, report, out)
    return report


def _print_report(
    config: DemoConfig, rows: list[_TurnRow], report: DemoReport, out: TextIO
) -> None:
    chunk_bytes = config.chunk_tokens * config.kv_bytes_per_token
    w = out.write
    w(
        f"\nkvfabric demo: {config.sessions} sessions x {config.turns} turns sharing a "
        f"{config.system_tokens}-token system prompt; {config.chunk_tokens}-token chunks of "
        f"{format_size(chunk_bytes)}; store {config.url}\n\n"
    )
    w(
        f"{'turn':>4}  {'requests':>8}  {'chunks/req':>10}  {'prefix hits/req':>15}  "
        f"{'hit rate':>8}  {'RPCs per lookup+get':>19}  {'loaded':>10}  {'computed':>10}\n"
    )
    for n, row in enumerate(rows, 1):
        w(
            f"{n:>4}  {row.requests:>8}  {row.chunks / row.requests:>10.1f}  "
            f"{row.hits / row.requests:>15.1f}  {row.hits / max(row.chunks, 1):>8.0%}  "
            f"{row.rpcs / row.requests:>19.1f}  {format_size(row.loaded):>10}  "
            f"{format_size(row.computed):>10}\n"
        )
    w("(prefix hits: leading chunks the store held; loaded: read from it instead of computed)\n")
    dedup = report.bytes_offered / max(report.bytes_stored, 1)
    get_gbs = report.bytes_loaded / max(report.get_seconds, 1e-9) / 1e9
    copy_gbs = report.bytes_loaded / max(report.memcpy_seconds, 1e-9) / 1e9
    lines = [
        (
            "bytes offered for storage",
            format_size(report.bytes_offered),
            "every chunk of every prompt, as an engine offers them",
        ),
        (
            "bytes stored",
            format_size(report.bytes_stored),
            f"dedup {dedup:.1f}x: {report.dedup_hits} chunks offered were stored once "
            "already, so they moved no bytes",
        ),
        (
            "control RPCs per lookup+get",
            f"{report.lookup_get_rpcs / report.requests:.2f}",
            "the lookup reads the index's lookup image (no RPC; one where the index keeps "
            "none) and the load uses the descriptors it found",
        ),
        (
            "validation failures",
            str(report.validation_failures),
            "records whose checksum did not match (each one read as a miss)",
        ),
        (
            "wrong values",
            str(report.wrong_values),
            "loaded chunks unlike what the engine computes: must be 0",
        ),
        (
            "lookup+get throughput",
            f"{get_gbs:.2f} GB/s",
            f"memcpy of the same chunks here: {copy_gbs:.2f} GB/s, ratio "
            f"{get_gbs / max(copy_gbs, 1e-9):.2f} (memcpy is the ceiling; a get also "
            "checksums every byte)",
        ),
        ("total time", f"{report.seconds:.1f} s", ""),
    ]
    w("\n")
    for label, value, note in lines:
        w(f"  {label:<28}{value:>12}   {note}".rstrip() + "\n")
