"""The vLLM connector's keys: the namespace of one rank's blocks, and their kvfabric keys.

A key is vLLM's own block hash folded with :func:`kvfabric.fold_key` into a namespace of
everything that decides what a block's bytes are: the value format, the vLLM version, the
model, dtypes, block size, hash algorithm, the KV layout of the worker that wrote it, its
parallel rank and the request's cache salt. Two instances that would compute the same KV for
a block therefore agree on its key without re-hashing tokens, and nothing else does.

Both roles build keys here: the scheduler for every rank (from the layout each worker
reported at start-up), a worker for its own rank. vLLM is not imported: its config objects
are read by attribute, so the key rules can be checked without an engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import attrs

from kvfabric.keys import fold_key, namespace_bytes

__all__ = ["VALUE_FORMAT", "KeySpace", "Rank", "block_keys", "engine_parts"]

VALUE_FORMAT = "kvfabric.vllm/1"
"""Version of what one value holds; bump it when that changes so old values never match."""

Rank = tuple[int, int]
"""(pipeline-parallel rank, tensor-parallel rank): whose shard of the KV a value holds."""


def block_keys(namespace: bytes, block_hashes: Iterable[bytes]) -> list[bytes]:
    """The kvfabric keys of vLLM block hashes within a namespace (``KeySpace.namespace``)."""
    return [fold_key(h, namespace) for h in block_hashes]


def engine_parts(
    vllm_config: Any, kv_layout: str, *, vllm_version: str, model_id: str | None = None
) -> tuple[str, ...]:
    """The namespace parts every rank of one engine shares.

    ``vllm_config``: vLLM's ``VllmConfig``; ``kv_layout``: the KV-cache layout vLLM resolved
    (``KVCacheConfig.kv_cache_layout``); ``model_id``: the weights' identity when the model
    path does not name them alike on every instance.
    """
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return (
        VALUE_FORMAT,
        f"vllm={vllm_version}",
        f"model={model_id or model.model}",
        f"revision={model.revision}",
        f"dtype={model.dtype}",
        f"kv_cache_dtype={cache.cache_dtype}",
        f"block_size={cache.block_size}",
        f"hash={cache.prefix_caching_hash_algo}",
        f"kv_cache_layout={kv_layout}",
        f"pp={parallel.pipeline_parallel_size},tp={parallel.tensor_parallel_size}",
    )


@attrs.frozen(kw_only=True)
class KeySpace:
    """The keys of one engine's blocks, per rank, worker layout and cache salt."""

    engine_parts: tuple[str, ...]

    def namespace(self, rank: Rank, layout: str, cache_salt: str | None) -> bytes:
        """The fold namespace of one rank's blocks for one cache salt."""
        parts = [
            *self.engine_parts,
            layout,
            f"rank=pp{rank[0]},tp{rank[1]}",
            "" if cache_salt is None else "salt=" + cache_salt,
        ]
        # Hashed once here so that folding each block hashes 32 bytes, not the whole text.
        return hashlib.blake2b(namespace_bytes(parts), digest_size=32).digest()

    def keys(
        self, block_hashes: Iterable[bytes], *, rank: Rank, layout: str, cache_salt: str | None
    ) -> list[bytes]:
        """The keys of ``block_hashes`` written by ``rank`` with worker layout ``layout``."""
        return block_keys(self.namespace(rank, layout, cache_salt), block_hashes)
