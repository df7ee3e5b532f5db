"""The counters every built-in index keeps alike, named once.

Both the memory and the redis index count their lookups and what their writes did under
these names, so ``kvfabric stats`` and the metrics read the same names whichever index
serves; each index adds the counters only it has.
"""

from __future__ import annotations

__all__ = ["LOOKUP_COUNTERS", "WRITE_COUNTERS"]

LOOKUP_COUNTERS = (
    "lookups",
    "lookup_keys",
    "prefix_hits",
    "resolves",
    "resolve_hits",
    "exists_calls",
)
"""Lookups (``lookup_copies``), the keys they asked and found, resolves and ``exists``."""

WRITE_COUNTERS = (
    "grants",
    "dedup_hits",
    "in_flight",
    "no_space",
    "oversize",
    "published",
    "publish_rejected",
    "aborted",
    "unpublished",
    "evictions",
    "early_reuse",
    "lease_expiries",
    "invalid_reports",
    "restored",
    "restore_duplicates",
    "restore_overlaps",
)
"""What allocations, publishes, removals, evictions and restores did."""
