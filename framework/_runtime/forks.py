"""After ``os.fork()``: telling an inherited object from one made in this process.

A child of a fork inherits a copy of every client object its parent made, and with it things
only the parent may use: ZeroMQ contexts and sockets whose I/O threads stayed behind, tcp
connections whose streams the parent still reads, UCX workers, thread pools whose threads
did not survive, locks a parent thread held at that instant, extents the parent writes into.
So each such object remembers :func:`generation` when it makes its per-process state, and
compares it on each call (one integer compare per batched call, nothing per key): in a child
it differs, and the object builds that state again.

What the child inherited it leaves alone. Nothing is closed, shut down, terminated or given
back from the child — the parent still uses all of it — and it is kept referenced
(:func:`abandon`) so that the garbage collector never finalizes it here either. The only
exception is what a hook registered with :func:`in_child` does on purpose (closing the
child's copy of a descriptor, which the parent's copy keeps open).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["abandon", "generation", "in_child", "rebuild_lock"]

log = logging.getLogger("kvfabric")

_generation = 0
_abandoned: list[object] = []
_hooks: list[Callable[[], None]] = []
_rebuild_lock = threading.Lock()


def generation() -> int:
    """How many forks separate this process from the one that imported kvfabric: equal to
    what an object remembered means the object was made in this very process."""
    return _generation


def rebuild_lock() -> threading.Lock:
    """The lock under which an inherited object builds its state again (one per process, so
    never one a parent thread held at the fork)."""
    return _rebuild_lock


def abandon(inherited: object) -> None:
    """Keep what a child inherited referenced for good: the parent's resources are never
    closed from here, not even by the garbage collector."""
    _abandoned.append(inherited)


def in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every child right after a fork, before anything else runs there.

    The child has one thread then: a hook may read what other threads left mid-way, but must
    take no lock (one a parent thread held stays held in the child) and must not block.
    """
    _hooks.append(hook)


def _after_fork_in_child() -> None:
    global _generation, _rebuild_lock
    _generation += 1
    _rebuild_lock = threading.Lock()
    for hook in _hooks:
        try:
            hook()
        except Exception:  # one hook failing must not keep the others from running
            log.exception("kvfabric: a fork hook failed in the child")


os.register_at_fork(after_in_child=_after_fork_in_child)
