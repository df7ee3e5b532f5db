"""A KV-event subscriber for the tests: what a router does with vLLM's events.

It follows a publisher as vLLM's example subscriber does: a SUB socket for the batches, and
when a batch's sequence number skips ahead, a request to the replay socket for the batches
from the one after the last seen (answered with the batches kept, then the end marker).
``decode`` turns a payload into ``(ts, events, rank)`` with each event a map (``"type"``
and its fields): the core env decodes plain msgpack, the vllm env with vLLM's own classes.
:meth:`Subscriber.view` applies the events in order, as a router's index of blocks would.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

import kvfabric
from kvfabric import EngineBlock, PutOutcome
from kvfabric.keys import chain_keys

Decoded = tuple[float, list[dict[str, Any]], Any]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def plain_decode(payload: bytes) -> Decoded:
    """msgpack alone, no schema: what any subscriber in any language can do."""
    ts, events, *rest = msgspec.msgpack.decode(payload)
    return ts, events, rest[0] if rest else None


class Subscriber:
    """Subscribes to ``endpoint`` (connects; or binds, as llm-d's manager does) and asks
    ``replay`` for gaps."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None,
        *,
        decode: Callable[[bytes], Decoded] = plain_decode,
        bind: bool = False,
        topic: bytes = b"",
    ) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.linger = 0
        if bind:
            self._sub.bind(endpoint)
            self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(endpoint)
            self.endpoint = endpoint
        self._replay_endpoint = replay
        self._decode = decode
        self.last_seq: int | None = None
        self.batches: list[tuple[int, Decoded]] = []
        self.gaps = 0
        self.replayed = 0

    def disconnect(self) -> None:
        """Away (as a subscriber that restarts), keeping what it saw: :meth:`reconnect`."""
        self._sub.close(linger=0)

    def reconnect(self) -> None:
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.linger = 0
        self._sub.connect(self.endpoint)

    def replay_from(self, start: int) -> int:
        """Ask the replay socket for every batch from ``start``; returns how many came."""
        assert self._replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(self._replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = 0
            while True:
                if not dealer.poll(30_000):
                    raise AssertionError("the replay socket did not answer")
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_SEQ:
                    return got
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq is None or seq > self.last_seq:
                    self._take(seq, payload)
                    got += 1
        finally:
            dealer.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> int:
        """Take what has arrived (filling gaps by replay); returns how many batches."""
        taken = 0
        while self._sub.poll(timeout_ms if not taken else 0):
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq is not None and seq <= self.last_seq:
                continue  # already had it through replay
            if self.last_seq is not None and seq > self.last_seq + 1 and self._replay_endpoint:
                self.gaps += 1
                self.replayed += self.replay_from(self.last_seq + 1)
            if self.last_seq is None or seq > self.last_seq:
                self._take(seq, payload)
            taken += 1
        return taken

    def _take(self, seq: int, payload: bytes) -> None:
        self.batches.append((seq, self._decode(payload)))
        self.last_seq = seq

    def events(self) -> list[dict[str, Any]]:
        return [event for _, (_, events, _) in self.batches for event in events]

    def view(self) -> set[bytes | int]:
        """The blocks a router following these events believes the tier holds."""
        held: set[bytes | int] = set()
        for event in self.events():
            if event["type"] == "BlockStored":
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                held.difference_update(event["block_hashes"])
            else:
                held.clear()
        return held

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()


# -- what the tests put, and what a subscriber should then believe ----------------------

_namespaces = itertools.count()


class Named:
    """The keys a test put, each with the name its events carry (its engine hash, or the
    key itself where the writer attached none). Values are ``value_bytes`` each."""

    def __init__(self, value_bytes: int = 64 << 10) -> None:
        self.names: dict[bytes, bytes | int] = {}
        self._value_bytes = value_bytes

    def put(
        self, store: kvfabric.Store, n: int, *, blocks: list[EngineBlock] | None = None
    ) -> list[bytes]:
        namespace = f"kv-events-{os.getpid()}-{next(_namespaces)}".encode()
        keys = chain_keys(list(range(n)), 1, namespace=namespace)
        outcomes = store.batched_put(
            keys, [bytes([i % 251]) * self._value_bytes for i in range(n)], blocks=blocks
        )
        assert outcomes == [PutOutcome.STORED] * n
        for i, key in enumerate(keys):
            self.names[key] = blocks[i].hash if blocks else key
        return keys

    def held(self, store: kvfabric.Store) -> set[bytes | int]:
        keys = list(self.names)
        there = store.batched_exists(keys)
        return {self.names[k] for k, held in zip(keys, there, strict=True) if held}


def engine_chain(n: int, first: int) -> list[EngineBlock]:
    """An engine's chain of ``n`` full 16-token blocks, hashed as 8-byte digests."""
    hashes = [(first + i).to_bytes(8, "big") for i in range(n)]
    return [
        EngineBlock(
            hash=hashes[i],
            parent=hashes[i - 1] if i else None,
            token_ids=range(16 * i, 16 * i + 16),
            block_size=16,
        )
        for i in range(n)
    ]


def follows(sub: Subscriber, named: Named, store: kvfabric.Store) -> bool:
    """Whether ``sub``, having read what has come, believes what ``store`` holds."""
    sub.poll()
    return sub.view() == named.held(store)
