"""The prefetch cache: descriptors a lookup already resolved, kept for the read that follows.

Per client, thread-safe, bounded by entry count and by age. It holds only leading runs of
hits from recent lookups, and is a speed shortcut, never a source of truth: every read is
validated, and a descriptor that fails validation is dropped and resolved again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvfabric.descriptor import Descriptor

__all__ = ["PrefetchCache"]


class PrefetchCache:
    def __init__(
        self,
        *,
        max_entries: int = 65536,
        ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or ttl < 0:
            raise ValueError("max_entries and ttl must not be negative")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, tuple[float, Descriptor]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def remember(self, descriptors: Sequence[Descriptor]) -> None:
        """Keep a lookup's leading run of hits; the oldest entries make room."""
        if self.max_entries == 0 or not descriptors:
            return
        with self._lock:
            expires = self._clock() + self.ttl
            items = self._items
            for d in descriptors[-self.max_entries :]:
                items[d.key] = (expires, d)
                items.move_to_end(d.key)
            while len(items) > self.max_entries:
                items.popitem(last=False)

    def take(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """The cached descriptor of each key (``None`` if absent or expired)."""
        with self._lock:
            now = self._clock()
            items = self._items
            out: list[Descriptor | None] = []
            for key in keys:
                hit = items.get(key)
                if hit is None:
                    out.append(None)
                elif hit[0] <= now:
                    del items[key]
                    out.append(None)
                else:
                    out.append(hit[1])
            return out

    def drop(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
