"""What the vLLM connector's two roles tell each other.

At start-up each worker sends the scheduler its KV layout (:class:`KVFabricHandshake`, vLLM's
connector handshake), so that both build keys from the same text. Each step the scheduler
sends the workers the blocks to load and to save (:class:`KVFabricMetadata`), with the
descriptors its lookup resolved, so that a load needs no round trip of its own. vLLM pickles
both when the scheduler and the workers are separate processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import attrs

# Typed where vLLM is installed; Any where it is not (kvfabric's lint env).
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvfabric.adapters.vllm_events import EngineView
from kvfabric.adapters.vllm_keys import Rank

__all__ = ["KVFabricHandshake", "KVFabricMetadata", "Transfer"]


# vLLM's metadata bases are plain classes that vLLM's own connectors subclass as dataclasses;
# these do the same.
@dataclass
class KVFabricHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc, unused-ignore]
    """What a worker tells the scheduler at start-up: its KV layout, as namespace text."""

    layout: str


@attrs.frozen(kw_only=True)
class Transfer:
    """Blocks of one request to move between kvfabric and the paged KV cache."""

    req_id: str
    cache_salt: str | None
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    descriptors: tuple[tuple[Rank, tuple[bytes, ...]], ...] = ()
    """For loads: where each rank's blocks are, as the scheduler's lookup found them (wire
    form), so the worker's read needs no round trip of its own."""
    engine: EngineView | None = None
    """For saves: vLLM's view of the blocks, for the tier's KV events."""


@dataclass
class KVFabricMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler → workers, once per step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
