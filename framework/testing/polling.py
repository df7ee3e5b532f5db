"""Waiting in tests: poll for an outcome, never sleep for a time.

A test that must wait for something another thread or process does (a node registered, a
counter moved, a connection closed) polls for that outcome with :func:`wait_for`. A fixed
``time.sleep`` guessed long enough passes on a quiet machine and flakes on a busy one; a
poll returns as soon as the outcome holds, and its bound is generous because it only tells
a hang from slowness, never a timing to meet. The seconds each wait took are printed
(shown with ``pytest -rP`` and on failures): recovery times, for instance, read from there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["PATIENCE", "wait_for", "wait_until_stopped"]

T = TypeVar("T")

PATIENCE = 30.0
"""Seconds a wait may take before a test calls it a hang."""

_FIRST_POLL = 0.002
_SLOWEST_POLL = 0.1


def wait_for(
    what: str,
    check: Callable[[], T],
    bound: float = PATIENCE,
    *,
    until: Callable[[T], object] = bool,
    context: Callable[[], str] | None = None,
    every: float | None = None,
) -> T:
    """Call ``check`` until ``until`` holds for what it returns (by default: until it is
    true); return that value.

    ``what`` names the outcome waited for ("the node registered"). Past ``bound`` seconds
    an AssertionError names it, the last value ``check`` returned and what ``context``
    returns (the tail of a process's log, say). The polls start 2 ms apart and back off to
    100 ms, so a quick outcome is seen at once and a slow one costs little CPU; ``every``
    fixes the pause instead, for a check that acts (a put, a tick) and must not become a
    burst of them. An exception from ``check`` propagates (a failure, not a retry).
    """
    started = time.monotonic()
    pause = _FIRST_POLL if every is None else every
    while True:
        value = check()
        if until(value):
            print(f"\n{what}: {time.monotonic() - started:.2f}s")
            return value
        if time.monotonic() - started > bound:
            message = f"{what}: not within {bound:g}s (last seen: {value!r})"
            raise AssertionError(f"{message}\n{context()}" if context else message)
        time.sleep(pause)
        if every is None:
            pause = min(pause * 2, _SLOWEST_POLL)


def wait_until_stopped(pid: int, timeout: float = PATIENCE) -> None:
    """Block until every thread of process ``pid`` is stopped (SIGSTOP is delivered
    asynchronously).

    ``os.kill(pid, SIGSTOP)`` returns before the process stops: the kernel hands the
    signal to one thread, and only when that thread runs does it stop the others. On a busy
    machine that thread may wait its turn for a CPU while another thread, not yet told,
    keeps answering requests; a test that acts right after the kill can find the process
    still serving. ``/proc/<pid>/task/*/stat`` show state ``T`` once each thread stopped.
    """
    wait_for(
        f"every thread of process {pid} stopped by SIGSTOP",
        lambda: _thread_states(pid),
        timeout,
        until=lambda states: states and all(s in ("T", "t") for s in states),
    )


def _thread_states(pid: int) -> list[str]:
    """The scheduler state of each of ``pid``'s threads (one that exited meanwhile is
    left out)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                # The state follows the command name, which is in parentheses and may hold
                # spaces.
                states.append(f.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:
            continue
    return states
