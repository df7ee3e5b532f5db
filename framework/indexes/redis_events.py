"""KV events of the redis index: one relay reads what every client's functions wrote.

With the index in Redis, publishes, deletes and evictions happen inside the server-side
functions every client calls, so no process sees them all. While events are wanted, those
functions append each change of what is readable to a stream of the arena they changed
(``<P>v``, in the arena's hash slot, so also in Redis Cluster; capped at about 10,000
entries), in the order it happened: ``('n', entry number)`` then ``('s', key + encoded
block)`` per key stored and ``('r', key)`` per key removed. They do so only while a relay
keeps the arena's ``ev`` deadline ahead (``kvf1_events_on``, renewed every third of
:data:`EVENTS_TTL_MS`): without a relay they write nothing.

:class:`EventRelay` is that relay, run by the controller started with ``--index redis
--kv-events`` (one per namespace): every round it reads each arena's stream from its
cursor (``XREAD``, the arenas of one master in one pipeline, all masters at once) and tells
its :class:`~kvfabric.spi.IndexEvents` (the controller's publisher) of each change. Where it
cannot know what it missed — an arena's entry numbers skip (its stream was trimmed past the
cursor, or it expired, or the arena was made again), or the namespace's registry was made
afresh (Redis lost it) — it tells ``cleared`` and goes on from there: subscribers then start
their view afresh, as after a controller's restart. A relay starts at the end of every
stream (its owner told ``cleared`` first). The relay remembers the engine hash of each key
it saw stored with one, so that the key's removal names the same block.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from kvfabric.indexes.redis_calls import ArenaCalls
from kvfabric.indexes.redis_layout import Arena
from kvfabric.indexes.redis_registry import RegistryView
from kvfabric.indexes.redis_shards import Call
from kvfabric.keys import KEY_SIZE
from kvfabric.spi import EngineBlock, IndexEvents

__all__ = ["EVENTS_TTL_MS", "READ_ENTRIES", "EventRelay", "decode_block", "encode_block"]

log = logging.getLogger("kvfabric.indexes.redis_events")

EVENTS_TTL_MS = 30_000
"""How long an arena's functions keep writing events after the relay last asked."""
READ_ENTRIES = 256
"""Stream entries read per arena per round, at most (each holds one call's changes)."""
_IDLE_WAIT = 0.05
"""Seconds between rounds that found nothing to read."""
_START = b"$"
"""An arena's cursor before it is read: start at its stream's end."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Any])


def encode_block(block: EngineBlock) -> bytes:
    """What a publish carries of a key's block, for the stream (msgpack)."""
    return _encoder.encode(
        [
            block.hash,
            block.parent,
            list(block.token_ids),
            block.block_size,
            block.lora_id,
            block.lora_name,
        ]
    )


def decode_block(data: bytes) -> EngineBlock:
    """A block as :func:`encode_block` wrote it."""
    hash_, parent, tokens, block_size, lora_id, lora_name = _decoder.decode(data)
    return EngineBlock(
        hash=hash_,
        parent=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=lora_id,
        lora_name=lora_name,
    )


class EventRelay:
    """Reads every arena's event stream and tells ``events`` (see the module docstring)."""

    def __init__(self, calls: ArenaCalls, view: RegistryView, events: IndexEvents) -> None:
        self._calls = calls
        self._view = view
        self._events = events
        self._cursors: dict[int, tuple[bytes, int]] = {}
        """Arena -> (last entry id read, its number); ``_START`` and -1 before the first
        round read the arena, number -1 where the next entry's is not known."""
        self._born: bytes | None = None
        self._hashes: dict[bytes, bytes | int] = {}
        self._renewed = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvfabric-redis-kv-events", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                busy = self.round()
            except Exception:  # Redis away: try again; what was missed shows as a gap
                log.warning("kv events: reading the redis index's streams failed", exc_info=True)
                busy = False
            if not busy:
                self._stopping.wait(_IDLE_WAIT)

    def round(self, *, now: float | None = None) -> bool:
        """Read every arena's stream once; whether some arena had more than one round's
        worth. Renews the arenas' deadlines every third of :data:`EVENTS_TTL_MS`."""
        clock = time.monotonic() if now is None else now
        view = self._view.refresh()
        if view.born != self._born:
            if self._born is not None:
                # The registry was made afresh: what its arenas held is gone.
                self._events.cleared()
                self._hashes.clear()
            self._born = view.born
            self._cursors = {}
            self._renewed = 0.0
        arenas = sorted(view.arenas.values(), key=lambda a: a.id)
        renew = clock - self._renewed >= EVENTS_TTL_MS / 3000 or any(
            a.id not in self._cursors for a in arenas
        )
        calls: list[Call] = []
        if renew:
            self._renewed = clock
            calls += [self._calls.call(arena, "kvf1_events_on", EVENTS_TTL_MS) for arena in arenas]
        for arena in arenas:
            cursor = self._cursors.setdefault(arena.id, (_START, -1))[0]
            calls.append(self._read(arena, cursor))
        if not calls:
            return False
        values = self._calls.run(calls).values
        reads = values[len(arenas) :] if renew else values
        busy = False
        for arena, value in zip(arenas, reads, strict=True):
            if isinstance(value, Exception):
                continue
            busy |= self._apply(arena, value)
        for arena_id in [a for a in self._cursors if a not in view.arenas]:
            del self._cursors[arena_id]
        return busy

    @staticmethod
    def _read(arena: Arena, cursor: bytes) -> Call:
        stream = arena.prefix + b"v"
        if cursor == _START:
            return Call(slot=arena.slot, args=("XREVRANGE", stream, "+", "-", "COUNT", 1))
        return Call(
            slot=arena.slot,
            args=("XREAD", "COUNT", READ_ENTRIES, "STREAMS", stream, cursor),
        )

    def _apply(self, arena: Arena, value: Any) -> bool:
        cursor, number = self._cursors[arena.id]
        if cursor == _START:
            # The stream's end: the next entry is the first this relay tells.
            if value:
                entry_id, fields = value[0]
                self._cursors[arena.id] = (entry_id, int(fields[1]))
            else:
                self._cursors[arena.id] = (b"0-0", -1)
            return False
        if not value:
            return False
        # XREAD answers {stream: entries} (RESP3) or [[stream, entries]] (RESP2).
        entries = next(iter(value.values())) if isinstance(value, dict) else value[0][1]
        for entry_id, fields in entries:
            n = int(fields[1])
            if number >= 0 and n != number + 1:
                # Entries went unread (trimmed, expired, or the arena made again).
                self._events.cleared()
                self._hashes.clear()
            number = n
            self._tell(fields)
            cursor = entry_id
        self._cursors[arena.id] = (cursor, number)
        return len(entries) >= READ_ENTRIES

    def _tell(self, fields: list[bytes]) -> None:
        events = self._events
        hashes = self._hashes
        for i in range(2, len(fields), 2):
            value = fields[i + 1]
            key = value[:KEY_SIZE]
            if fields[i] == b"s":
                block = decode_block(value[KEY_SIZE:]) if len(value) > KEY_SIZE else None
                if block is not None:
                    hashes[key] = block.hash
                else:
                    hashes.pop(key, None)
                events.stored(key, block)
            else:
                events.removed(key, hashes.pop(key, None))
