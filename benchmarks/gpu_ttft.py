"""Time to first token on a GPU: a real model shape's prefill against loading its KV from kvfabric.

    python benchmarks/gpu_ttft.py [--model llama-3.1-8b] [--lengths 2048,8192,32768]
                                  [--transports shm,tcp] [--chunk 256] [--device cuda]

What a serving engine's TTFT is made of, measured on this host, without the engine: a model
of a real shape (random weights, bf16, built on the device with ``transformers``) prefills
prompts of each length (``recompute``); its KV cache is cut into chunks of ``--chunk``
tokens (one value per chunk holding every layer's K and V, as the vLLM connector stores a
block), stored in a real ``kvfabric`` deployment on 127.0.0.1 (a controller and a data node,
child processes), then looked up, read into pinned host buffers, copied to the device, and
the last token prefilled on top of the loaded cache (``loaded``). Both paths end at the
same next-token logits; the script prints how far apart they are.

It prints, per prompt length and transport: recompute TTFT, loaded TTFT and its parts
(lookup, get, host-to-device copy, the last token's prefill), the KV bytes moved and the
load bandwidth, and the model's prefill FLOPs and KV bytes per token (the ratio that decides
whether loading beats recomputing). It does not run an engine: an engine adds its own
scheduling and its own copy into paged blocks (docs/serving-benchmark.md has the serving
benchmark on real ``vllm serve`` processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import kvfabric
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.keys import chain_keys

MODELS: dict[str, dict[str, int]] = {
    # Shapes from the models' published configs; the weights here are random.
    "llama-3.1-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "qwen2.5-7b": dict(
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "tiny": dict(  # for a run on a CPU, to check the script
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
}


@dataclass
class Row:
    length: int
    transport: str
    recompute_s: float
    lookup_s: float
    get_s: float
    h2d_s: float
    tail_s: float
    kv_bytes: int
    hits: int
    chunks: int
    max_logit_diff: float

    @property
    def loaded_s(self) -> float:
        return self.lookup_s + self.get_s + self.h2d_s + self.tail_s


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(
    torch: Any, device: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[float, Any]:
    _sync(torch, device)
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(torch, device)
    return time.perf_counter() - started, out


def _layers_kv(cache: Any) -> list[tuple[Any, Any]]:
    """Every layer's (K, V) of a transformers cache, whichever version made it."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _new_cache(transformers: Any, config: Any) -> Any:
    try:
        return transformers.DynamicCache(config=config)
    except TypeError:
        return transformers.DynamicCache()


class KVLayout:
    """A chunk of the KV cache as one value: every layer's K then V for the chunk's tokens."""

    def __init__(self, kv: list[tuple[Any, Any]], chunk: int) -> None:
        k0 = kv[0][0]  # [batch, kv_heads, tokens, head_dim]
        self.layers = len(kv)
        self.heads = k0.shape[1]
        self.head_dim = k0.shape[3]
        self.dtype = k0.dtype
        self.chunk = chunk
        self.piece = self.heads * chunk * self.head_dim * k0.element_size()
        self.value_bytes = 2 * self.layers * self.piece

    def values(self, torch: Any, kv: list[tuple[Any, Any]], chunks: int) -> list[np.ndarray]:
        """The chunks' values in host memory (bytes as uint8)."""
        out = []
        for c in range(chunks):
            span = slice(c * self.chunk, (c + 1) * self.chunk)
            parts = [t[0, :, span, :].contiguous() for k, v in kv for t in (k, v)]
            joined = torch.cat([p.reshape(-1) for p in parts]).view(torch.uint8).cpu()
            out.append(joined.numpy())
        return out

    def to_device(self, torch: Any, host: Any, chunks: int, device: str) -> list[tuple[Any, Any]]:
        """Pinned ``[chunks, value bytes]`` → per layer (K, V) on the device."""
        on_device = host[:chunks].to(device, non_blocking=True)
        shaped = on_device.view(self.dtype).view(
            chunks, self.layers, 2, self.heads, self.chunk, self.head_dim
        )
        kv = []
        for layer in range(self.layers):
            k = shaped[:, layer, 0].permute(1, 0, 2, 3).reshape(self.heads, -1, self.head_dim)
            v = shaped[:, layer, 1].permute(1, 0, 2, 3).reshape(self.heads, -1, self.head_dim)
            kv.append((k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()))
        return kv


@contextlib.contextmanager
def _deployment(capacity: int, transports: list[str]) -> Iterator[LocalCluster]:
    with LocalCluster(nodes=1, transports=transports, capacity=str(capacity)) as cluster:
        yield cluster


def run(args: argparse.Namespace) -> list[Row]:
    import torch
    import transformers

    device = args.device
    torch.manual_seed(0)
    shape = MODELS[args.model]
    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=max(args.lengths) + 64,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    started = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    print(
        f"model {args.model} built on {device} in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )
    params = sum(p.numel() for p in model.parameters())
    kv_per_token = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * (config.hidden_size // config.num_attention_heads)
        * (2 if dtype == torch.bfloat16 else 4)
    )
    print(
        f"# {args.model}: {params / 1e9:.2f} B parameters, prefill ~{2 * params / 1e9:.1f} GFLOP "
        f"per token (plus attention), KV {kv_per_token} bytes per token "
        f"({2 * params / kv_per_token:.0f} FLOP per KV byte)"
    )
    rows: list[Row] = []
    longest = max(args.lengths)
    capacity = int(longest * kv_per_token * 1.3) + (256 << 20)
    names = sorted({t.partition("?")[0] for t in args.transports})
    with _deployment(capacity, names) as cluster, torch.inference_mode():
        for length in args.lengths:
            chunks = (length - 1) // args.chunk  # full chunks, leaving at least one token
            tokens = torch.randint(0, config.vocab_size, (1, length), device=device)
            model(tokens, use_cache=True)  # warm-up (kernels, allocator)
            samples = []
            out = None
            for _ in range(args.repeat):
                seconds, out = _timed(torch, device, model, tokens, use_cache=True)
                samples.append(seconds)
            recompute = statistics.median(samples)
            assert out is not None
            full_logits = out.logits[0, -1].float()
            kv = _layers_kv(out.past_key_values)
            layout = KVLayout(kv, args.chunk)
            values = layout.values(torch, kv, chunks)
            del out, kv
            ids = tokens[0].tolist()
            keys = chain_keys(
                ids[: chunks * args.chunk],
                args.chunk,
                namespace=args.model.encode(),
                full_only=True,
            )
            host = torch.empty(
                (chunks, layout.value_bytes),
                dtype=torch.uint8,
                pin_memory=device.startswith("cuda"),
            )
            for transport in args.transports:
                name, _, extra = transport.partition("?")
                options = dict(pair.split("=", 1) for pair in extra.split("&") if pair)
                url = cluster.url(
                    transport=name,
                    timeout="30s",
                    control_timeout="30s",
                    max_value=str(layout.value_bytes),
                    **options,
                )
                with kvfabric.connect(url) as store:
                    outcomes = store.batched_put(keys, values)
                    assert all(
                        o in (kvfabric.PutOutcome.STORED, kvfabric.PutOutcome.DEDUPLICATED)
                        for o in outcomes
                    ), outcomes
                    best: dict[str, float] | None = None
                    diff = float("nan")
                    hits = 0
                    for _ in range(args.repeat):
                        with kvfabric.connect(url) as reader:  # a fresh client: nothing cached
                            sample, diff, hits = _load_once(
                                torch, transformers, config, model, reader, keys, host, layout,
                                tokens, full_logits, device,
                            )  # fmt: skip
                        if best is None or sum(sample.values()) < sum(best.values()):
                            best = sample
                    assert best is not None
                    store.delete(keys)
                rows.append(
                    Row(
                        length=length,
                        transport=transport,
                        recompute_s=recompute,
                        lookup_s=best["lookup"],
                        get_s=best["get"],
                        h2d_s=best["h2d"],
                        tail_s=best["tail"],
                        kv_bytes=hits * layout.value_bytes,
                        hits=hits,
                        chunks=chunks,
                        max_logit_diff=diff,
                    )
                )
                _print_row(rows[-1])
            del values, host
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def _load_once(
    torch: Any,
    transformers: Any,
    config: Any,
    model: Any,
    reader: kvfabric.Store,
    keys: list[bytes],
    host: Any,
    layout: KVLayout,
    tokens: Any,
    full_logits: Any,
    device: str,
) -> tuple[dict[str, float], float, int]:
    """One load as an engine would do it: lookup, get into pinned pages, copy to the device,
    prefill what is left; its parts' times, the logits' distance to recompute's, the hits."""
    t_lookup, hits = _timed(torch, device, reader.batched_contains, keys)
    dests = [host[i].numpy() for i in range(hits)]
    t_get, got = _timed(torch, device, reader.batched_get, keys[:hits], into=dests)
    assert all(g is not None for g in got), "a chunk did not load"
    t_h2d, loaded = _timed(torch, device, layout.to_device, torch, host, hits, device)
    cache = _new_cache(transformers, config)
    for layer, (k, v) in enumerate(loaded):
        cache.update(k, v, layer)
    tail_tokens = tokens[:, hits * layout.chunk :]
    t_tail, tail = _timed(torch, device, model, tail_tokens, past_key_values=cache, use_cache=True)
    diff = float((tail.logits[0, -1].float() - full_logits).abs().max())
    return {"lookup": t_lookup, "get": t_get, "h2d": t_h2d, "tail": t_tail}, diff, hits


def _print_row(r: Row) -> None:
    gbps = r.kv_bytes / (r.get_s + r.h2d_s) / 1e9 if r.get_s + r.h2d_s else 0.0
    print(
        f"{r.length:>7} {r.transport:<4} recompute {r.recompute_s * 1e3:8.1f} ms | loaded "
        f"{r.loaded_s * 1e3:8.1f} ms (lookup {r.lookup_s * 1e3:.2f}, get {r.get_s * 1e3:.1f}, "
        f"h2d {r.h2d_s * 1e3:.1f}, tail {r.tail_s * 1e3:.1f}) | {r.recompute_s / r.loaded_s:5.1f}x "
        f"| {r.hits}/{r.chunks} chunks, {r.kv_bytes / 2**20:.0f} MiB, {gbps:.1f} GB/s "
        f"| max logit diff {r.max_logit_diff:.3g}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    parser.add_argument(
        "--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768]
    )
    parser.add_argument(
        "--transports",
        type=lambda s: s.split(","),
        default=["shm", "tcp"],
        help="transports to load over, each with URL options if wanted: "
        "shm,shm?shm.copy_threads=1,tcp?tcp.read_lanes=4",
    )
    parser.add_argument("--chunk", type=int, default=256, help="tokens per stored value")
    parser.add_argument(
        "--repeat", type=int, default=3, help="samples per measurement (best/median)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    print(f"# host: {os.cpu_count()} CPUs; device {args.device}", flush=True)
    rows = run(args)
    if args.json:
        args.json.write_text(
            json.dumps([r.__dict__ | {"loaded_s": r.loaded_s} for r in rows], indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
