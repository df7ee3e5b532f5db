"""Repeated log records, rate-limited per key, with a count of what was held back.

A client that logged every failed call wrote thousands of identical lines while its node
or controller was away, burying the one line that said why. :class:`LimitedLog` lets the
first record of each *key* (what went wrong, and where: ``("read", node)``) through, holds
back those that follow within ``interval`` seconds, and adds to the next one let through
how many were held back and over how long: ``... (12 more like this in the last 60 s)``.
Held-back records cost a lock and a counter, never a formatted message. A key's count is
reported with its next record; one that never recurs keeps its count (``suppressed``
says it).

Safe across ``fork``: the lock is made anew in the child, since a thread of the parent may
have held it when the process forked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LimitedLog"]

# Keys whose windows ended are forgotten once there are more than this many.
_MAX_KEYS = 1024
_ALL: weakref.WeakSet[LimitedLog] = weakref.WeakSet()


class _Window:
    __slots__ = ("held", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.held = 0


class LimitedLog:
    """At most one record per key per ``interval`` seconds on ``logger``; thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}
        _ALL.add(self)

    def warning(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args)

    def info(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at INFO."""
        return self.log(logging.INFO, key, msg, *args)

    def error(self, key: Hashable, msg: str, *args: Any) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, key, msg, *args)

    def log(self, level: int, key: Hashable, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless a record of ``key`` went out less than ``interval``
        seconds ago (then it is counted instead); whether it went out."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.started < self.interval:
                window.held += 1
                return False
            if window is None and len(self._windows) >= _MAX_KEYS:
                self._forget_ended(now)
            self._windows[key] = _Window(now)
        if window is not None and window.held:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, window.held, now - window.started)
        self.logger.log(level, msg, *args)
        return True

    def suppressed(self, key: Hashable) -> int:
        """Records of ``key`` held back since its last one went out."""
        with self._lock:
            window = self._windows.get(key)
            return 0 if window is None else window.held

    def _forget_ended(self, now: float) -> None:
        ended = [k for k, w in self._windows.items() if now - w.started >= self.interval]
        for key in ended:
            del self._windows[key]

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


def _reinit_after_fork() -> None:
    for limited in list(_ALL):
        limited._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)
