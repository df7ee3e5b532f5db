"""``PutOutcome``: what ``Store.batched_put`` says happened to each key."""

from __future__ import annotations

import enum

__all__ = ["PutOutcome"]


class PutOutcome(enum.Enum):
    STORED = "stored"
    DEDUPLICATED = "deduplicated"
    """Already stored (by anyone): no bytes moved."""
    IN_FLIGHT = "in_flight"
    """Another writer is storing it right now: skipped."""
    NO_SPACE = "no_space"
    FAILED = "failed"
    """The write or the controller failed; nothing was published."""
