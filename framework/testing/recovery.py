"""Reading back after a fault: every value exact, or a miss.

A fault test kills or restarts a process, waits for the client to be whole again
(:func:`kvfabric.testing.wait_for`) and reads its keys back with :func:`exact_hits`, which
fails at once on a wrong value: after a fault a key may miss, never read wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric import Store

__all__ = ["exact_hits"]


def exact_hits(store: Store, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
    """How many of ``keys`` read back as ``values``; a wrong value fails at once."""
    got = store.batched_get(keys)
    wrong = [i for i, g in enumerate(got) if g is not None and bytes(g) != values[i]]
    assert wrong == [], f"wrong values for {len(wrong)} keys"
    return sum(g is not None for g in got)
