"""One tenant's account: the bytes its values hold, its least recently used first.

The index knows nothing of tenants; the controller keeps, per tenant, each index key it
published with the record's length, in order of last use (a publish, a lookup or read that
found it, a dedup hit, a use report). Its quota is enforced before the index grants
anything: a grant that would take the tenant past its quota first removes the tenant's own
least recently used values, never another's, so one tenant's burst cannot empty another's
cache. With a ``ttl``, values older than it (since published) are removed at the next tick.

Grants not yet published count too (until published, aborted or their lease ends), so a
tenant's puts in flight cannot together pass the quota. The index may also remove a
tenant's value for its own reasons (capacity pressure across tenants, a lost data node, a
record reported invalid); such an entry is found gone when the ledger asks the index about
its keys — at each stats read, after the nodes change or an eviction, and when the entry
reaches the head of the queue — and then stops counting.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence

from kvfabric.descriptor import Descriptor

__all__ = ["TenantLedger"]


class TenantLedger:
    """Bytes held and reserved by one tenant, with its values in order of last use."""

    def __init__(self, quota: int, ttl: float | None) -> None:
        self.quota = quota
        self.ttl = ttl
        self._held: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """Index key -> record bytes, least recently used first."""
        self._published_at: collections.deque[tuple[float, bytes]] = collections.deque()
        """(when, key) in publish order: what the ttl looks at (stale pairs are skipped)."""
        self._stamp: dict[bytes, float] = {}
        self._pending: dict[tuple[bytes, int], tuple[int, float]] = {}
        """(key, version) of a grant not yet published -> (record bytes, lease end)."""
        self.held_bytes = 0
        self.pending_bytes = 0
        self.counters: collections.Counter[str] = collections.Counter()

    # -- what the tenant holds ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def over_by(self, wanted: int) -> int:
        """Bytes past the quota if ``wanted`` more were reserved now (0: it fits)."""
        return max(0, self.held_bytes + self.pending_bytes + wanted - self.quota)

    def oldest(self, count: int) -> list[bytes]:
        """Up to ``count`` keys, least recently used first."""
        out = []
        for key in self._held:
            out.append(key)
            if len(out) == count:
                break
        return out

    def used(self, keys: Iterable[bytes]) -> None:
        """Keys of this tenant found or reported used: most recently used now."""
        held = self._held
        for key in keys:
            if key in held:
                held.move_to_end(key)

    def forget(self, keys: Iterable[bytes]) -> int:
        """Keys no longer in the index (removed, evicted, expired): bytes freed."""
        freed = 0
        for key in keys:
            length = self._held.pop(key, None)
            if length is not None:
                freed += length
                self._stamp.pop(key, None)
        self.held_bytes -= freed
        return freed

    # -- grants and publishes -------------------------------------------------------------

    def holds(self, key: bytes) -> bool:
        return key in self._held

    def length_of(self, key: bytes) -> int:
        return self._held.get(key, 0)

    def granted(self, grants: Sequence[Descriptor], lease: float, header: int) -> None:
        """Grants (every copy) the index made: each record's ``header`` plus payload
        counts until it is published or given up, or the lease ends."""
        until = time.monotonic() + (lease if lease > 0 else 30.0)
        pending = self._pending
        for grant in grants:
            ref = (grant.key, grant.version)
            before = pending.get(ref, (0, until))[0]
            pending[ref] = (before + header + grant.length, until)
            self.pending_bytes += header + grant.length

    def settled(self, key: bytes, version: int, published: bool) -> None:
        """A grant published (``published``) or given up."""
        entry = self._pending.pop((key, version), None)
        if entry is None:
            return
        length = entry[0]
        self.pending_bytes -= length
        if not published:
            return
        previous = self._held.pop(key, None)
        if previous is not None:
            self.held_bytes -= previous
        self._held[key] = length
        self.held_bytes += length
        now = time.monotonic()
        self._stamp[key] = now
        if self.ttl is not None:
            self._published_at.append((now, key))

    def restored(self, key: bytes, length: int) -> None:
        """A record of this tenant's a node reported after a controller restart."""
        if key in self._held:
            return
        self._held[key] = length
        self.held_bytes += length
        now = time.monotonic()
        self._stamp[key] = now
        if self.ttl is not None:
            self._published_at.append((now, key))

    def expire_leases(self, now: float) -> None:
        """Grants whose lease ended unpublished no longer count."""
        gone = [ref for ref, (_, until) in self._pending.items() if until <= now]
        for key, version in gone:
            self.settled(key, version, published=False)

    def expired(self, now: float) -> list[bytes]:
        """Keys whose ttl ran out (still held, published when the stamp says)."""
        if self.ttl is None:
            return []
        out = []
        limit = now - self.ttl
        queue = self._published_at
        while queue and queue[0][0] <= limit:
            when, key = queue.popleft()
            if self._stamp.get(key) == when:
                out.append(key)
        return out

    def keys(self) -> list[bytes]:
        return list(self._held)

    def stats(self) -> dict[str, int]:
        return {
            "quota_bytes": self.quota,
            "used_bytes": self.held_bytes,
            "reserved_bytes": self.pending_bytes,
            "entries": len(self._held),
            "ttl_seconds": int(self.ttl) if self.ttl is not None else 0,
            "quota_evictions": 0,
            "ttl_expirations": 0,
            **self.counters,
        }
