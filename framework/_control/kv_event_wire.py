"""KV events on the wire, in the msgpack form vLLM's subscribers decode.

vLLM's ``KVEventBatch`` (``vllm.distributed.kv_events``) is encoded by msgspec as an
array ``[ts, events, data_parallel_rank]``, and each event as a map tagged with its class
name under ``"type"``, then its fields in declaration order, the optional trailing ones
left out while unset:

- ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name"}``
- ``{"type": "BlockRemoved", "block_hashes", "medium"}``
- ``{"type": "AllBlocksCleared"}``

This module writes that form from plain lists and maps (with msgspec's encoder, the one
vLLM uses, so integers, floats and byte strings take the same msgpack types), so a
subscriber written for vLLM's events (its example subscriber, Dynamo's relay, llm-d's
KV-cache manager) decodes kvfabric's with the classes it has; a test in the vLLM
environment checks the bytes against vLLM's own encoding. ``medium`` is :data:`MEDIUM`.

:func:`encode_batch` turns what an index reported (:mod:`kvfabric.spi.events`) into one
payload, merging as vLLM's own events run: consecutive stores of one chain (each block's
parent the one before, the same block size and LoRA, full blocks) become one
``BlockStored`` with their hashes and tokens in order, and consecutive removals one
``BlockRemoved``. A block its writer said nothing of is named by its kvfabric key (32
bytes), alone in its event (nothing says which block comes before it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, TypeAlias

import msgspec

from kvfabric.keys import KEY_SIZE
from kvfabric.spi.events import EngineBlock, EngineHash

__all__ = ["MEDIUM", "Change", "EventKind", "decode_batch", "encode_batch", "to_events"]

MEDIUM = "kvfabric"
"""What every event's ``medium`` says: the block is held by the kvfabric tier."""


class EventKind(enum.IntEnum):
    STORED = 0
    REMOVED = 1
    CLEARED = 2


Change: TypeAlias = "tuple[EventKind, bytes, EngineBlock | EngineHash | None]"
"""One change an index reported: (STORED, key, block or None), (REMOVED, key, engine hash
or None) or (CLEARED, b"", None)."""

Event: TypeAlias = "dict[str, Any]"
"""One event in its wire form (a map, ``"type"`` first)."""

_encoder = msgspec.msgpack.Encoder()


def encode_batch(changes: Iterable[Change], ts: float, data_parallel_rank: int = 0) -> bytes:
    """One ``KVEventBatch`` payload of ``changes``, in order (see the module docstring)."""
    return _encoder.encode([ts, to_events(changes), data_parallel_rank])


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """A payload back as plain values (tests and tools; subscribers use their own)."""
    batch = msgspec.msgpack.decode(payload)
    ts, events, *rest = batch
    return ts, events, rest[0] if rest else None


def to_events(changes: Iterable[Change]) -> list[Event | msgspec.Raw]:
    """The events of ``changes``, consecutive ones merged where vLLM's would be."""
    events: list[Event | msgspec.Raw] = []
    append = events.append
    chain: EngineBlock | None = None
    """The last block of the BlockStored at the end of ``events``, while more may join it."""
    chained: Event = {}
    """That BlockStored."""
    removed: list[EngineHash] | None = None
    """The hashes of the BlockRemoved at the end of ``events``, while more may join it."""
    for kind, key, what in changes:
        if kind is EventKind.STORED:
            removed = None
            if what is None:
                # The commonest event, spliced from its encoding: no map built per key.
                append(msgspec.Raw(_KEY_STORED_HEAD + key + _KEY_STORED_TAIL))
                chain = None
                continue
            assert isinstance(what, EngineBlock)
            if chain is not None and _continues(chain, what):
                chained["block_hashes"].append(what.hash)
                chained["token_ids"].extend(what.token_ids)
                chain = what
                continue
            chained = _stored(
                what.hash,
                what.parent,
                what.token_ids,
                what.block_size,
                what.lora_id,
                what.lora_name,
            )
            append(chained)
            chain = what if _full(what) else None
            continue
        chain = None
        if kind is EventKind.REMOVED:
            engine_hash = key if what is None else what
            assert not isinstance(engine_hash, EngineBlock)
            if removed is None:
                removed = [engine_hash]
                append({"type": "BlockRemoved", "block_hashes": removed, "medium": MEDIUM})
            else:
                removed.append(engine_hash)
        else:
            removed = None
            append({"type": "AllBlocksCleared"})
    return events


def _stored(
    block_hash: EngineHash,
    parent: EngineHash | None,
    token_ids: Iterable[int],
    block_size: int,
    lora_id: int | None,
    lora_name: str | None,
) -> Event:
    # The order of the keys is part of the format: msgspec writes a struct's fields in
    # declaration order, and a byte-for-byte comparison with vLLM's payloads relies on it.
    return {
        "type": "BlockStored",
        "block_hashes": [block_hash],
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": MEDIUM,
        "lora_name": lora_name,
    }


def _full(block: EngineBlock) -> bool:
    """A whole block (its tokens fill it): only those join a chain, since a chain's tokens
    are ``block_size`` per hash."""
    return block.block_size > 0 and len(block.token_ids) == block.block_size


def _continues(chain: EngineBlock, block: EngineBlock) -> bool:
    """``block`` follows ``chain``'s last block in one BlockStored."""
    return (
        block.parent is not None
        and block.parent == chain.hash
        and type(block.parent) is type(chain.hash)
        and block.block_size == chain.block_size
        and block.lora_id == chain.lora_id
        and block.lora_name == chain.lora_name
        and _full(block)
    )


def _splice_template() -> tuple[bytes, bytes]:
    """The encoding of a BlockStored named by a key, cut around the key: a key's event is
    then ``head + key + tail``, byte for byte what encoding its map gives."""
    placeholder = b"\xa5" * KEY_SIZE
    encoded = _encoder.encode(_stored(placeholder, None, (), 0, None, None))
    at = encoded.index(placeholder)
    return encoded[:at], encoded[at + KEY_SIZE :]


_KEY_STORED_HEAD, _KEY_STORED_TAIL = _splice_template()
