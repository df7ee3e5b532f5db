"""Use reports: the keys lookups found in the lookup image, told to the index in batches.

A lookup answered from the image never reaches the index, so the index's LRU would take a
key read a thousand times for one never read. The store hands each lookup's hits here (one
list append, nothing per key); a background thread sends them, deduplicated, at most once
per ``interval`` (``Index.touch``: one ``TOUCH`` message to a controller). That keeps
eviction meaningful at no cost on the lookup path, and the controller pays for one message a
second per client instead of work per lookup. Reports are best effort: one that fails is
counted and dropped, and past ``limit`` pending keys new ones are dropped (counted) until
the thread catches up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvfabric.errors import KvfabricError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.counters import Counters

__all__ = ["TouchReporter"]

log = logging.getLogger("kvfabric")


class TouchReporter:
    """Batches keys used without the index and reports them off the lookup path."""

    def __init__(
        self,
        touch: Callable[[Sequence[bytes]], None],
        counters: Counters,
        *,
        interval: float = 1.0,
        limit: int = 1 << 16,
    ) -> None:
        """``touch``: sends one report (``Index.touch``). ``counters`` gets ``touch_rpcs``,
        ``touch_failures`` and ``touches_dropped``."""
        self._touch = touch
        self._counters = counters
        self._interval = interval
        self._limit = limit
        self._lock = threading.Lock()
        self._pending: list[Sequence[bytes]] = []
        self._pending_keys = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, keys: Sequence[bytes]) -> None:
        """Keys a lookup used (the caller must not change the sequence afterwards)."""
        with self._lock:
            if self._closed:
                return
            if self._pending_keys + len(keys) > self._limit:
                self._counters.add("touches_dropped", len(keys))
                return
            self._pending.append(keys)
            self._pending_keys += len(keys)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvfabric-touch", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        """Send what is pending now (one report), on the caller's thread."""
        with self._lock:
            batches, self._pending, self._pending_keys = self._pending, [], 0
        if not batches:
            return
        # A lookup hands over the caller's own list (no copy): what a caller put in it
        # afterwards is not sent unless it is a key.
        keys = list(
            dict.fromkeys(
                key
                for batch in batches
                for key in batch
                if type(key) is bytes and len(key) == KEY_SIZE
            )
        )
        try:
            self._touch(keys)
        except KvfabricError as exc:
            self._counters.add("touch_failures")
            log.debug("kvfabric: use report of %d keys failed: %s", len(keys), exc)
            return
        self._counters.add("touch_rpcs")

    def close(self) -> None:
        """Stop the thread; what is still pending is dropped (reports are best effort)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
