"""The index as one tenant's requests see it: its own keys only, within its quota.

A :class:`TenantIndexView` stands in for the index behind a tenant's
:class:`~kvfabric._control.client_requests.ClientRequests`, so every request a tenant sends
is decoded and answered exactly as any client's, after two things the controller does
whatever the client sent:

- **every key is made the tenant's**: its tag bytes (8 to 12) are set to the tenant's tag
  (a well-behaved client sends them so already), so lookups, reads, writes, deletes, use
  reports and invalid-record reports reach only the tenant's namespace; a key of another
  tenant's, sent as it is, becomes a key of this tenant's and misses;
- **writes stay within the quota**: before the index grants anything, the tenant's own
  least recently used values are removed until what it holds and has reserved, plus what
  it asks for, fits (:class:`~kvfabric._control.tenant_ledger.TenantLedger`); what cannot
  fit even then is answered ``NO_SPACE``.

Extents are not leased to tenants: records carved into an extent are placed by the
client, and their accounting would then rest on what it reports. A tenant's client writes
through ``allocate`` (two round trips per put).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvfabric._control.refusal import Refusal
from kvfabric._control.tenant_ledger import TenantLedger
from kvfabric._runtime.record import HEADER_SIZE
from kvfabric._wire.protocol import ErrorCode
from kvfabric.spi.index import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
    IndexPlugin,
    NodeInfo,
)

__all__ = ["TenantIndexView"]

_NO_SPACE = Allocation(kind=AllocationKind.NO_SPACE)
_EVICT_BATCH = 64
"""Least recently used keys taken at a time when a tenant must make room."""


class TenantIndexView:
    """One tenant's view of the index (the methods a client's requests call)."""

    def __init__(self, index: IndexPlugin, tag: bytes, ledger: TenantLedger) -> None:
        self._index = index
        self._tag = tag
        self.ledger = ledger
        self.evicted_elsewhere = False
        """Whether the index evicted entries while serving this tenant (so any tenant's
        ledger may count some that are gone)."""

    def own(self, keys: Sequence[bytes]) -> list[bytes]:
        """``keys`` made this tenant's (unchanged where they already are)."""
        tag = self._tag
        return [k if k[8:12] == tag else k[:8] + tag + k[12:] for k in keys]

    def _own_grants(self, grants: Sequence[GrantRef]) -> list[GrantRef]:
        tag = self._tag
        return [
            g if g.key[8:12] == tag else attrs.evolve(g, key=g.key[:8] + tag + g.key[12:])
            for g in grants
        ]

    # -- lookups ------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        return self._index.nodes()

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        keys = self.own(keys)
        copies = self._index.lookup_copies(keys)
        self.ledger.used(keys[: len(copies.descriptors)])
        return copies

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        keys = self.own(keys)
        copies = self._index.resolve_copies(keys)
        self.ledger.used(k for k, d in zip(keys, copies.descriptors, strict=True) if d)
        return copies

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._index.exists(self.own(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        keys = self.own(keys)
        self._index.touch(keys)
        self.ledger.used(keys)

    # -- writes -------------------------------------------------------------------------

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        tag = self._tag
        requests = [
            r if r.key[8:12] == tag else attrs.evolve(r, key=r.key[:8] + tag + r.key[12:])
            for r in requests
        ]
        admitted = self._make_room(requests)
        result = self._index.allocate(requests[:admitted])
        if result.evictions:
            self.evicted_elsewhere = True
        grants = []
        used = []
        for allocation in result.allocations:
            if allocation.kind is AllocationKind.GRANTED and allocation.descriptor is not None:
                grants.append(allocation.descriptor)
                grants.extend(allocation.replicas)
            elif allocation.kind is AllocationKind.EXISTS and allocation.descriptor is not None:
                used.append(allocation.descriptor.key)
        self.ledger.granted(grants, result.lease, HEADER_SIZE)
        self.ledger.used(used)
        if admitted < len(requests):
            refused = (_NO_SPACE,) * (len(requests) - admitted)
            result = attrs.evolve(result, allocations=result.allocations + refused)
        return result

    def _make_room(self, requests: Sequence[AllocationRequest]) -> int:
        """Remove this tenant's least recently used values until ``requests`` fit in its
        quota; how many of them (from the first) may be asked of the index."""
        ledger = self.ledger
        asked = {r.key for r in requests}
        wanted = [0 if ledger.holds(r.key) else HEADER_SIZE + r.length for r in requests]
        over = ledger.over_by(sum(wanted))
        while over > 0 and len(ledger) > 0:
            victims = [k for k in ledger.oldest(_EVICT_BATCH) if k not in asked]
            if not victims:
                break
            victims = victims[: _enough(ledger, victims, over)]
            self._index.unpublish(victims)
            freed = ledger.forget(victims)
            ledger.counters["quota_evictions"] += len(victims)
            over -= freed
        if over <= 0:
            return len(requests)
        # Even with nothing of its own left to remove, not all of it fits: the first
        # requests that do.
        room = ledger.quota - ledger.held_bytes - ledger.pending_bytes
        admitted = 0
        for need in wanted:
            if need > room:
                break
            room -= need
            admitted += 1
        ledger.counters["quota_refusals"] += len(requests) - admitted
        return admitted

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        grants = self._own_grants(grants)
        flags = self._index.publish(grants)
        for grant, published in zip(grants, flags, strict=True):
            self.ledger.settled(grant.key, grant.version, published)
        return flags

    def abort(self, grants: Sequence[GrantRef]) -> None:
        grants = self._own_grants(grants)
        self._index.abort(grants)
        for grant in grants:
            self.ledger.settled(grant.key, grant.version, published=False)

    def unpublish(self, keys: Sequence[bytes]) -> int:
        keys = self.own(keys)
        removed = self._index.unpublish(keys)
        self.ledger.forget(keys)
        return removed

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        records = self._own_grants(records)
        dropped = self._index.drop_invalid(records)
        if dropped:
            keys = [r.key for r in records]
            present = self._index.exists(keys)
            self.ledger.forget(k for k, there in zip(keys, present, strict=True) if not there)
        return dropped

    # -- extents: not for tenants ---------------------------------------------------------

    def leases_extents(self) -> bool:
        return False

    def lease_extents(self, *args: Any) -> list[Extent]:
        raise Refusal(ErrorCode.FORBIDDEN, "a tenant's client writes through allocate")

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes]
    ) -> list[CarveOutcome]:
        raise Refusal(ErrorCode.FORBIDDEN, "a tenant's client writes through allocate")


def _enough(ledger: TenantLedger, victims: list[bytes], over: int) -> int:
    """How many of ``victims`` (oldest first) free at least ``over`` bytes."""
    freed = 0
    for count, key in enumerate(victims, 1):
        freed += ledger.length_of(key)
        if freed >= over:
            return count
    return len(victims)
