"""What an index reports of the entries it holds, and what a writer says of each key.

kvfabric publishes what the tier holds as KV events in vLLM's format (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), so a cache-aware router reads it like another
engine. The events come from the index itself, the one place that sees every publish,
delete, eviction and lost node: its owner hands it an :class:`IndexEvents` with
:meth:`~kvfabric.spi.IndexPlugin.report_events`, and the index calls it as entries come
and go. The calls are made under the index's own locks, so an implementation only queues
what it is told (kvfabric's is a bounded queue a publisher thread drains): a slow
subscriber never slows the store.

An event names a block by the engine's own hash where the writer said what that is: a put
may carry an :class:`EngineBlock` per key (``Store.batched_put(keys, values,
blocks=...)``; the vLLM connector attaches vLLM's block hashes, parents and token ids).
The index remembers each entry's engine hash so that its removal names the same block;
without one, events name the block by its kvfabric key.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TypeAlias

import attrs

__all__ = ["MAX_BLOCK_TOKENS", "MAX_HASH_BYTES", "EngineBlock", "EngineHash", "IndexEvents"]

EngineHash: TypeAlias = "bytes | int"
"""An engine's name for a block, as vLLM's events carry it: bytes (a SHA-256 digest, vLLM's
default) or an unsigned 64-bit integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""

MAX_HASH_BYTES = 64
"""The longest engine hash taken, in bytes."""
MAX_BLOCK_TOKENS = 1 << 16
"""The most token ids one block may carry."""


def _check_hash(value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if type(value) is bytes:
        if not 0 < len(value) <= MAX_HASH_BYTES:
            raise ValueError(f"an engine hash of {len(value)} bytes (1 to {MAX_HASH_BYTES})")
        return
    if type(value) is int:
        if not 0 <= value < 1 << 64:
            raise ValueError(f"an integer engine hash is unsigned 64-bit, got {value}")
        return
    raise TypeError(f"an engine hash is bytes or int, got {type(value).__name__}")


def _hash(_: object, __: object, value: EngineHash) -> None:
    _check_hash(value, optional=False)


def _parent(_: object, __: object, value: EngineHash | None) -> None:
    _check_hash(value, optional=True)


def _token_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _tokens(_: object, __: object, value: tuple[int, ...]) -> None:
    if len(value) > MAX_BLOCK_TOKENS:
        raise ValueError(f"{len(value)} token ids in one block (at most {MAX_BLOCK_TOKENS})")
    if any(type(t) is not int or not 0 <= t < 1 << 32 for t in value):
        raise ValueError("token ids are integers from 0 to 2**32 - 1")


@attrs.frozen(kw_only=True)
class EngineBlock:
    """What the events should say of one key: the block as the engine knows it.

    The fields are those of vLLM's ``BlockStored``; a router that tracks the engine's block
    hashes matches kvfabric's events with no knowledge of kvfabric's keys.
    """

    hash: EngineHash = attrs.field(validator=_hash)
    """The engine's hash of the block (vLLM: ``request.block_hashes[i]``)."""
    parent: EngineHash | None = attrs.field(default=None, validator=_parent)
    """The hash of the block before it in its prompt; None for a prompt's first block."""
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_tuple, validator=_tokens)
    """The block's tokens (vLLM: ``block_size`` of them for a full block)."""
    block_size: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Tokens per block (0: not said)."""
    lora_id: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )
    """The LoRA adapter's id, where the block was computed with one."""
    lora_name: str | None = None
    """The LoRA adapter's name, where the block was computed with one."""


class IndexEvents(abc.ABC):
    """What an index tells of its entries as they come and go (its owner's sink).

    Called under the index's locks, from any thread, in the order the changes happen; each
    call only queues (it never blocks, never raises, never calls back into the index).
    """

    @abc.abstractmethod
    def stored(self, key: bytes, block: EngineBlock | None) -> None:
        """``key`` became readable: published by a writer (``block``: what the writer said
        of it, if anything), or restored from a node's records (``block`` None)."""

    @abc.abstractmethod
    def removed(self, key: bytes, engine_hash: EngineHash | None) -> None:
        """``key`` is no longer readable: deleted, evicted, found invalid, or lost with its
        node (its last copy). ``engine_hash``: the hash its ``stored`` carried, if any."""

    @abc.abstractmethod
    def cleared(self) -> None:
        """Every entry is gone at once (the index was emptied, or lost and started afresh):
        what was reported stored before is not held any more."""
