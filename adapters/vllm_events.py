"""What the vLLM connector's saves say of each block for the tier's KV events.

kvfabric publishes what it holds as KV events (``--kv-events``); a router that tracks vLLM's
own block hashes matches them only if each stored block is named as vLLM names it. So each
save carries, beside its keys, vLLM's view of its blocks (:class:`EngineView`: the hashes,
the hash before the first, the tokens and the LoRA adapter, taken from the request in the
scheduler), and the worker turns that into one :class:`~kvfabric.EngineBlock` per key on its
saver thread, off the engine's step. A hash is converted as vLLM converts its own for
events (``maybe_convert_block_hash``: bytes, or a 64-bit integer under
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so kvfabric's events carry exactly the values
vLLM's own would.

With tensor parallelism each rank stores its own key for a block, and each rank's store is
an event naming the same vLLM hash: a block is whole in kvfabric while every rank's copy is.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

# Typed where vLLM is installed; Any where it is not (kvfabric's lint env).
from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
    maybe_convert_block_hash,
)

from kvfabric import EngineBlock

__all__ = ["EngineView", "engine_blocks"]


@attrs.frozen(kw_only=True)
class EngineView:
    """vLLM's view of the blocks one save stores (scheduler → worker, pickled with it)."""

    parent: bytes | None
    """vLLM's hash of the block before the first saved (None: the first is the prompt's)."""
    token_ids: tuple[int, ...]
    """The saved blocks' tokens, ``block_size`` per block."""
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


def engine_blocks(block_hashes: Sequence[bytes], view: EngineView) -> list[EngineBlock]:
    """One block per hash, as vLLM's own ``BlockStored`` would describe it."""
    blocks: list[EngineBlock] = []
    size = view.block_size
    parent = None if view.parent is None else maybe_convert_block_hash(view.parent)
    for i, raw in enumerate(block_hashes):
        block_hash = maybe_convert_block_hash(raw)
        blocks.append(
            EngineBlock(
                hash=block_hash,
                parent=parent,
                token_ids=view.token_ids[i * size : (i + 1) * size],
                block_size=size,
                lora_id=view.lora_id,
                lora_name=view.lora_name,
            )
        )
        parent = block_hash
    return blocks
