"""What a writer says of its keys for the KV events, as a put carries it to the index.

``Store.batched_put(keys, values, blocks=...)`` takes one
:class:`~kvfabric.spi.EngineBlock` (or None) per key: the block as the engine knows it, so
that the tier's events name it in the engine's terms (:mod:`kvfabric.spi.events`). The put
keeps them by key and each publish sends those of the keys it publishes
(``Index.publish_described``); a put without them sends nothing more than before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from kvfabric.spi.events import EngineBlock

__all__ = ["Blocks", "blocks_for", "described"]

Blocks: TypeAlias = "Mapping[bytes, EngineBlock] | None"
"""What a writer said of its keys, by key (None: nothing)."""


def described(keys: Sequence[bytes], blocks: Sequence[EngineBlock | None] | None) -> Blocks:
    """A put's blocks by key (None where it attached none); raises for a list of the wrong
    length or an item that is not an :class:`~kvfabric.spi.EngineBlock`."""
    if blocks is None:
        return None
    if len(blocks) != len(keys):
        raise ValueError(f"{len(blocks)} blocks for {len(keys)} keys")
    for i, block in enumerate(blocks):
        if block is not None and not isinstance(block, EngineBlock):
            raise TypeError(f"block {i} is a {type(block).__name__}, not an EngineBlock")
    by_key = {k: b for k, b in zip(keys, blocks, strict=True) if b is not None}
    return by_key or None


def blocks_for(keys: Sequence[bytes], blocks: Blocks) -> Blocks:
    """The blocks of ``keys`` alone (what one publish sends), or None where none has one."""
    if not blocks:
        return None
    mine = {k: blocks[k] for k in keys if k in blocks}
    return mine or None
