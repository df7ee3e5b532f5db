"""Helpers for fault tests with real processes: wait for a recovery, read back exactly.

A fault test kills or restarts a process and asserts what a long-lived client sees and how
soon it is whole again. :func:`wait_for` polls the outcome and says how long it took
(generous bounds, for busy machines: the bound tells a hang from slowness, never a timing
to meet); :func:`exact_hits` reads keys back and fails at once on a wrong value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvfabric import Store

__all__ = ["RECOVERY_BOUND", "exact_hits", "wait_for"]

RECOVERY_BOUND = 30.0
"""Seconds a recovery may take before a test calls it a hang."""


def wait_for(what: str, check: Callable[[], bool], bound: float = RECOVERY_BOUND) -> float:
    """Poll ``check`` until it holds; the seconds it took (printed). AssertionError past
    ``bound``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > bound:
            raise AssertionError(f"{what}: not within {bound:g}s")
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    print(f"\n{what}: {elapsed:.2f}s")
    return elapsed


def exact_hits(store: Store, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
    """How many of ``keys`` read back as ``values``; a wrong value fails at once."""
    got = store.batched_get(keys)
    wrong = [i for i, g in enumerate(got) if g is not None and bytes(g) != values[i]]
    assert wrong == [], f"wrong values for {len(wrong)} keys"
    return sum(g is not None for g in got)
