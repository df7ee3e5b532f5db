"""Publishing the tier's KV events as vLLM's ``ZmqEventPublisher`` does.

A subscriber written for vLLM's events reads kvfabric's unchanged: a ZeroMQ PUB socket sends
each batch as ``[topic, sequence (8 bytes, big-endian), payload]`` (the payload a msgpack
``KVEventBatch``: :mod:`kvfabric._control.kv_event_wire`), sequence numbers counting up by
one, and a ROUTER socket answers a replay request (an 8-byte big-endian start sequence) with
every batch still kept from that one on, each as ``[topic, sequence, payload]``, then the
end marker ``[b"", -1 (8 bytes, signed), b""]``. As in vLLM, an endpoint with a wildcard
(``tcp://*:5557``) or an ``ipc://`` / ``inproc://`` one is bound and any other is
connected to (a subscriber that binds, as llm-d's KV-cache manager does); the replay
endpoint is always bound.

The index reports changes into :class:`EventQueue` (its :class:`~kvfabric.spi.IndexEvents`)
under its own lock, and that only appends to a bounded queue: a slow subscriber, or a slow
publisher thread, never slows the store. The publisher thread takes what has queued (at
most :data:`MAX_BATCH_CHANGES` at a time), encodes it as one batch and sends it; ZeroMQ
drops a batch for a subscriber past the PUB socket's high-water mark, which that subscriber
sees as a gap in the sequence and fills from the replay socket (the last
:data:`REPLAY_BATCHES` batches are kept, at most :data:`REPLAY_BYTES` of them). When
changes come faster than the thread sends them, the queue drops its oldest (counted,
``kv_events_dropped``) and the next batch skips a sequence number: subscribers see a gap
there too, one that replay cannot fill (the changes were never sent), so they know their
view may be stale.

The first batch a publisher sends is ``AllBlocksCleared`` (its owner queues it: a
controller starts with an empty index), and its sequence numbers start from the wall clock
in microseconds rather than from 0: a publisher that replaces one (a restarted controller)
numbers its batches above its predecessor's, so a subscriber that was following the old one
sees a gap, asks the replay socket for what it missed, and gets the clear first — whereas
numbers starting again from 0 would look like no gap at all, and a clear sent before the
subscriber's connection came back would be lost without a trace.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import zmq

from kvfabric._control.kv_event_wire import Change, EventKind, encode_batch
from kvfabric.errors import ConfigError
from kvfabric.spi.events import EngineBlock, EngineHash, IndexEvents

__all__ = [
    "END_SEQ",
    "MAX_BATCH_CHANGES",
    "QUEUE_CHANGES",
    "REPLAY_BATCHES",
    "REPLAY_BYTES",
    "EventQueue",
    "KvEventPublisher",
    "binds",
]

log = logging.getLogger("kvfabric._control.kv_events")

QUEUE_CHANGES = 100_000
"""Changes waiting for the publisher thread, at most (vLLM's ``max_queue_size``)."""
MAX_BATCH_CHANGES = 4096
"""Changes in one batch, at most."""
REPLAY_BATCHES = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps``)."""
REPLAY_BYTES = 64 << 20
"""Bytes of batches kept for replay, at most: a busy tier's batches are far larger than an
engine's step's, so the count alone would not bound the memory."""
PUB_HWM = 100_000
"""Batches ZeroMQ queues per subscriber before it drops them for that one (vLLM's ``hwm``)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""
_IDLE_WAIT_MS = 20
"""How long the publisher thread waits for a replay request while nothing is queued: the
most an event waits before it is sent."""


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (else it connects), by vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventQueue(IndexEvents):
    """The changes an index reports, bounded: past :data:`QUEUE_CHANGES` the oldest go
    (counted). Thread-safe; never blocks beyond a short lock."""

    def __init__(self, bound: int = QUEUE_CHANGES) -> None:
        self._queue: collections.deque[Change] = collections.deque()
        self._bound = bound
        self._lock = threading.Lock()
        self.dropped = 0
        """Changes dropped because the queue was full."""

    def _put(self, change: Change) -> None:
        with self._lock:
            if len(self._queue) >= self._bound:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(change)

    def stored(self, key: bytes, block: EngineBlock | None) -> None:
        self._put((EventKind.STORED, key, block))

    def removed(self, key: bytes, engine_hash: EngineHash | None) -> None:
        self._put((EventKind.REMOVED, key, engine_hash))

    def cleared(self) -> None:
        self._put((EventKind.CLEARED, b"", None))

    def take(self, most: int) -> tuple[list[Change], int]:
        """Up to ``most`` changes, oldest first, and how many were dropped so far."""
        with self._lock:
            n = min(most, len(self._queue))
            popleft = self._queue.popleft
            return [popleft() for _ in range(n)], self.dropped

    def __len__(self) -> int:
        return len(self._queue)


class KvEventPublisher:
    """The PUB and replay sockets and the thread that feeds them (see the module docstring).

    Its sockets are made (bound or connected) when it is constructed, so a bad endpoint or
    a port in use fails the command at start; then :meth:`start`, and :meth:`close` to send
    what is queued and stop.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        queue: EventQueue | None = None,
        clock: Callable[[], float] = time.time,
        first_seq: int | None = None,
    ) -> None:
        """``endpoint``: the PUB socket's; ``replay``: the ROUTER socket's (None: no
        replay); ``topic``: the first frame of every message; ``first_seq``: the first
        batch's sequence number (default: the wall clock in microseconds)."""
        self.queue = queue if queue is not None else EventQueue()
        self._topic = topic.encode()
        self._clock = clock
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.linger = 0
        self._pub.sndhwm = PUB_HWM
        self._replay: zmq.Socket[bytes] | None = None
        self.endpoint = self._open(self._pub, endpoint, "--kv-events", bind=binds(endpoint))
        self.replay_endpoint = ""
        if replay is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.linger = 0
            self.replay_endpoint = self._open(self._replay, replay, "--kv-events-replay", bind=True)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque()
        self._buffer_bytes = 0
        self._next_seq = first_seq if first_seq is not None else time.time_ns() // 1000
        self._dropped_seen = 0
        self._counters = dict.fromkeys(
            (
                "kv_events_published",
                "kv_event_batches",
                "kv_event_gaps",
                "kv_event_replay_requests",
                "kv_events_replayed",
            ),
            0,
        )
        self._closed = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfabric-kv-events", daemon=True)

    def _open(self, sock: zmq.Socket[bytes], endpoint: str, option: str, *, bind: bool) -> str:
        try:
            if bind:
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            self._close_sockets()
            how = "bind" if bind else "connect to"
            raise ConfigError(f"{option}: cannot {how} {endpoint!r}: {exc.strerror}") from None

    def start(self) -> None:
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """What was published, dropped and replayed, and what waits (names as exported)."""
        return {
            **self._counters,
            "kv_events_dropped": self.queue.dropped,
            "kv_events_queued": len(self.queue),
        }

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (once; again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                stopping = self._stopping.is_set()
                wait = 0 if len(self.queue) or stopping else _IDLE_WAIT_MS
                if self._replay is not None and self._replay.poll(wait, zmq.POLLIN):
                    self._serve_replays()
                elif self._replay is None and wait:
                    self._stopping.wait(wait / 1000)
                sent = self._send_queued()
                if stopping and not sent:
                    return
        except Exception:  # the store goes on; only its events stop
            log.exception("kv events: the publisher thread failed; no more events are sent")

    def _send_queued(self) -> bool:
        changes, dropped = self.queue.take(MAX_BATCH_CHANGES)
        if not changes:
            return False
        if dropped != self._dropped_seen:
            # Changes were lost before they were sent: a sequence number no batch has, so
            # subscribers see a gap (which replay cannot fill).
            self._dropped_seen = dropped
            self._next_seq += 1
            self._counters["kv_event_gaps"] += 1
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(changes, self._clock())
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        buffer = self._buffer
        buffer.append((seq, payload))
        self._buffer_bytes += len(payload)
        while len(buffer) > REPLAY_BATCHES or self._buffer_bytes > REPLAY_BYTES:
            self._buffer_bytes -= len(buffer.popleft()[1])
        self._counters["kv_event_batches"] += 1
        self._counters["kv_events_published"] += len(changes)
        return True

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            self._counters["kv_event_replay_requests"] += 1
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: a replay request that is not [id, '', seq]: ignored")
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
                    self._counters["kv_events_replayed"] += 1
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
