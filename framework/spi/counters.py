"""Thread-safe named counters: what a plugin counts for ``stats()`` and metrics.

A transport or an adapter makes one with the names it counts (``Counters(("bytes_read",
"reads"))``), adds to them from any thread, and returns ``snapshot()`` from its ``stats()``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["Counters"]


class Counters:
    """Named integer counters, every one starting at 0; safe to add to from any thread."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def update(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
