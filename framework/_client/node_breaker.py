"""Data nodes this client stopped waiting for: one circuit breaker per node.

A read or write to a node that fails as a whole — a timeout (the node is frozen, swapped out,
cut off) or a failed connection — costs the call that made it up to the client's ``timeout``.
Until the controller drops that node, lookups still find its records; without a breaker every
later request would wait the same deadline again. So after such a failure the node *backs
off* for ``node_backoff`` seconds: lookups count keys whose copies lie only on it as misses
(the prefix stops there), and reads and writes skip it at once (a read falls over to another
copy where there is one; a write's records there fail). When the period ends, the next call
that needs the node is let through as a probe and the node is held off for one more period
meanwhile; a probe that fails doubles the period (up to :data:`MAX_BACKOFF`), one that gets
an answer puts the node back in use at once. A node the client learns anew (it registered
again, restarted) starts clean.

Thread-safe. Nothing here costs anything per key, and while every node is in use each call
costs one check of an empty table. The breaker belongs to the record I/O layer, which a
forked child makes again: a child starts with every node in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["MAX_BACKOFF", "NodeBreaker"]

MAX_BACKOFF = 30.0
"""Seconds a node that keeps failing its probes is held off at most (or ``node_backoff``,
if that is longer)."""


class _Backoff:
    """One node's period: how long, until when, and when it began."""

    __slots__ = ("period", "since", "until")

    def __init__(self, period: float, now: float) -> None:
        self.period = period
        self.since = now
        self.until = now + period


class NodeBreaker:
    """Which data nodes this client holds off, and until when; thread-safe."""

    def __init__(self, backoff: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``backoff``: seconds a node is held off after its first failure (0: never).
        ``clock``: seconds, monotonic (tests pass one they move by hand)."""
        self.backoff = backoff
        self.clock = clock
        self._cap = max(MAX_BACKOFF, backoff)
        self._lock = threading.Lock()
        self._held: dict[int, _Backoff] = {}

    @property
    def engaged(self) -> bool:
        """Whether any node is held off (or was, and is due its probe): a lock-free check
        the hot paths make before anything else."""
        return bool(self._held)

    def skipped(self, nodes: Iterable[int]) -> set[int]:
        """Of ``nodes``, which a call about to use them must skip now. A node whose period
        is over is not skipped: this call is its probe, and the node is held off one more
        period for every other call meanwhile."""
        if not self._held:
            return set()
        now = self.clock()
        out: set[int] = set()
        with self._lock:
            for node in nodes:
                held = self._held.get(node)
                if held is None:
                    continue
                if now < held.until:
                    out.add(node)
                else:
                    held.until = now + held.period
        return out

    def unavailable(self) -> frozenset[int]:
        """The nodes held off now (a lookup counts keys only there as misses)."""
        if not self._held:
            return frozenset()
        now = self.clock()
        with self._lock:
            return frozenset(node for node, held in self._held.items() if now < held.until)

    def now(self) -> float:
        """The breaker's clock: what a call notes before it uses the nodes, for
        :meth:`failed`."""
        return self.clock()

    def failed(self, node: int, started: float) -> bool:
        """A call started at ``started`` could not use ``node`` at all (timeout, connection):
        hold it off. Whether this began or lengthened a period (a call that was already
        waiting on the node when an earlier one failed changes nothing)."""
        if self.backoff <= 0:
            return False
        now = self.clock()
        with self._lock:
            held = self._held.get(node)
            if held is None:
                self._held[node] = _Backoff(self.backoff, now)
                return True
            if started < held.since:
                return False
            held.period = min(2 * held.period, self._cap)
            held.since = now
            held.until = now + held.period
            return True

    def succeeded(self, node: int) -> None:
        """``node`` answered a call: it is in use again."""
        if self._held:
            with self._lock:
                self._held.pop(node, None)

    def forget(self, nodes: Iterable[int]) -> None:
        """These nodes were learned anew (registered again, restarted): start clean."""
        if self._held:
            with self._lock:
                for node in nodes:
                    self._held.pop(node, None)
