"""What each client holds reserved, bounded per client: grants not yet published, extents.

A grant reserves its slot until it is published, aborted or its lease runs out; a leased
extent reserves its run of a region until it is given back or its lease runs out. Neither
can be evicted, so one client that allocates without publishing (buggy, stalled or hostile)
could otherwise hold the whole store and refuse every other client's puts. The controller
therefore keeps, per client, the bytes and the number of what it holds reserved, and
grants a client no more than its bound: the keys of an allocate past it are answered
``NO_SPACE`` without being placed (that client's own puts report ``NO_SPACE``, the outcome
engines already take as "not stored, no room now"; no other client's are affected), and a
lease past it gets fewer or no extents (the writer then allocates per key, under the same
bound).

A client is the random id it draws when it connects and sends with every request that
reserves (:func:`kvfabric._wire.protocol.write_client`), not its ZeroMQ routing identity,
which differs per pooled socket. The id is the client's own word: the bound holds a client
that misbehaves by mistake; one that draws new ids at will is bounded only by what the
store's secret keeps out.

This is the controller's own bookkeeping, beside the index's: it holds for whatever index
the controller serves, and counts what the index actually granted (a key found stored, or
in flight, reserves nothing). A grant the index dropped early (its node was lost) is
counted until its lease would have ended: the bound errs towards refusing, never towards
letting a client hold more.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from kvfabric._runtime.record import record_size
from kvfabric.spi.index import (
    AllocateResult,
    AllocationKind,
    AllocationRequest,
    Extent,
    GrantRef,
)

__all__ = ["ReservationLimits", "Reservations"]


@attrs.frozen(kw_only=True)
class ReservationLimits:
    """What one client may hold reserved at once."""

    share: float = 0.5
    """Bytes, as a share of the store's capacity (used when ``bytes`` is 0)."""
    bytes: int = 0
    """Bytes, absolute (0: ``share`` of the capacity)."""
    grants: int = 65536
    """Pending grants plus leased extents."""

    def bytes_of(self, capacity: int) -> int:
        return self.bytes if self.bytes else int(capacity * self.share)


@attrs.define
class _Held:
    """What one client holds reserved now."""

    count: int = 0
    bytes: int = 0


class Reservations:
    """Every client's reservations, by client id; not thread-safe (the controller's loop)."""

    def __init__(
        self,
        limits: ReservationLimits,
        capacity: Callable[[], int],
        counters: dict[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``capacity``: the store's capacity in bytes now (for a share of it)."""
        self.limits = limits
        self._capacity = capacity
        self._counters = counters
        self._clock = clock
        self._held: dict[int, _Held] = {}
        self._grants: dict[bytes, dict[int, tuple[int, int]]] = {}
        """Key -> version -> (client, bytes) of each grant not yet published."""
        self._deadlines: deque[tuple[float, bytes, int]] = deque()
        """(lease deadline, key, version) of each grant, in the order they were made (an
        index grants one lease to all, so the deadlines come in order)."""
        self._extents: dict[int, tuple[int, int, float]] = {}
        """Extent id -> (client, bytes, lease deadline)."""

    # -- grants ------------------------------------------------------------------------

    def admit(self, client: int, requests: Sequence[AllocationRequest]) -> int:
        """How many of ``requests``, from the first, ``client`` may be granted (the rest
        are refused ``NO_SPACE``), counting each as granted."""
        held = self._held.get(client) or _Held()
        limit_count = self.limits.grants
        limit_bytes = self.limits.bytes_of(self._capacity())
        count, used = held.count, held.bytes
        for admitted, request in enumerate(requests):
            used += record_size(request.length)
            count += 1
            if count > limit_count or used > limit_bytes:
                self._counters["reservations_refused"] += len(requests) - admitted
                return admitted
        return len(requests)

    def granted(self, client: int, result: AllocateResult) -> None:
        """What the index granted ``client`` (every copy of every key), until its lease."""
        deadline = self._clock() + result.lease
        for allocation in result.allocations:
            copies = allocation.replicas
            if allocation.descriptor is not None and allocation.kind is AllocationKind.GRANTED:
                copies = (allocation.descriptor, *copies)
            for d in copies:
                self._hold(client, d.key, d.version, record_size(d.length), deadline)

    def _hold(self, client: int, key: bytes, version: int, size: int, deadline: float) -> None:
        self._grants.setdefault(key, {})[version] = (client, size)
        self._deadlines.append((deadline, key, version))
        held = self._held.get(client)
        if held is None:
            held = self._held[client] = _Held()
        held.count += 1
        held.bytes += size

    def published(self, grants: Sequence[GrantRef], flags: Sequence[bool]) -> None:
        """A publish was served: a key published drops every grant of it (the copies not
        named go too); a grant refused is gone (its lease ran out, or it was never one)."""
        for grant, flag in zip(grants, flags, strict=True):
            if flag:
                for version in list(self._grants.get(grant.key, ())):
                    self._release(grant.key, version)
            else:
                self._release(grant.key, grant.version)

    def aborted(self, grants: Sequence[GrantRef]) -> None:
        for grant in grants:
            self._release(grant.key, grant.version)

    def _release(self, key: bytes, version: int) -> None:
        versions = self._grants.get(key)
        if versions is None:
            return
        holder = versions.pop(version, None)
        if not versions:
            del self._grants[key]
        if holder is not None:
            self._drop(*holder)

    def _drop(self, client: int, size: int) -> None:
        held = self._held[client]
        held.count -= 1
        held.bytes -= size
        if not held.count:
            del self._held[client]

    # -- extents -----------------------------------------------------------------------

    def extent_room(self, client: int) -> tuple[int, int]:
        """(bytes, extents) ``client`` may lease now."""
        held = self._held.get(client) or _Held()
        room = self.limits.bytes_of(self._capacity()) - held.bytes
        return max(room, 0), max(self.limits.grants - held.count, 0)

    def refused_extents(self, count: int) -> None:
        """``count`` extents asked for were not leased: the client's bound."""
        self._counters["extent_leases_refused"] += count

    def leased(self, client: int, extents: Sequence[Extent]) -> None:
        now = self._clock()
        for extent in extents:
            self._extents[extent.id] = (client, extent.size, now + extent.lease)
            held = self._held.get(client)
            if held is None:
                held = self._held[client] = _Held()
            held.count += 1
            held.bytes += extent.size

    def returned(self, extents: Sequence[int]) -> None:
        for extent_id in extents:
            holder = self._extents.pop(extent_id, None)
            if holder is not None:
                self._drop(holder[0], holder[1])

    # -- upkeep ------------------------------------------------------------------------

    def expire(self) -> None:
        """Leases that ran out free what they held."""
        now = self._clock()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, key, version = deadlines.popleft()
            self._release(key, version)
        for extent_id in [e for e, (_, _, deadline) in self._extents.items() if deadline <= now]:
            self.returned([extent_id])

    def stats(self) -> dict[str, int]:
        return {
            "reserving_clients": len(self._held),
            "reserved_bytes": sum(held.bytes for held in self._held.values()),
            "reserved_grants": sum(len(v) for v in self._grants.values()),
            "reserved_extents": len(self._extents),
        }
