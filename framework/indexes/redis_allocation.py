"""Allocation in the redis index: the first of a put's two rounds.

Each key's arena allocates atomically with the entry (``kvf1_allocate``): per key *exists*
(retention +1), *in flight*, a *grant* of a slot under a lease, or *no space*, evicting
inside the arena when the value does not fit. A batch is one call per arena, all in one
round. With ``replicas=k`` every copy of a key is allocated in that same round, each by the
arena that will hold it (the first k arenas clockwise on distinct nodes), and the home's
answer decides; what the publish then needs to know is kept in :class:`PutsInFlight`. An
arena this client did not know was replaced is asked again once, after the registry is read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvfabric.descriptor import Descriptor
from kvfabric.indexes.redis_calls import ArenaCalls, Group, raise_unexpected
from kvfabric.indexes.redis_layout import Arena, alternates, version_bytes
from kvfabric.indexes.redis_registry import NodeRegistry, RegistryView, View
from kvfabric.indexes.redis_shards import Call
from kvfabric.indexes.redis_unpublish import Unpublisher
from kvfabric.spi import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    Counters,
    record_size,
)

__all__ = ["Allocator", "Put", "PutsInFlight"]

_KINDS = {
    1: AllocationKind.GRANTED,
    2: AllocationKind.EXISTS,
    3: AllocationKind.IN_FLIGHT,
    4: AllocationKind.NO_SPACE,
}


@attrs.define
class Put:
    """A put of several copies this client was granted and has not published yet: what its
    publish needs to know (which arena holds which copy, what the home must list)."""

    home: Arena
    home_version: int
    """The home's grant (``granted``) or, for a stored key being repaired, its entry."""
    granted: bool
    copies: dict[int, tuple[Descriptor, Arena]]
    """Version -> the copy granted and the arena holding it."""
    existing: list[Descriptor]
    """Copies already stored elsewhere, for the home to list."""
    deadline: float


class PutsInFlight:
    """Puts of several copies between their allocate and publish, by key; and grants this
    client could not use (their key's home refused it), aborted with its next round."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._puts: dict[bytes, Put] = {}
        self._orphans: list[tuple[Arena, bytes, int]] = []

    def hold(self, key: bytes, put: Put) -> None:
        with self._lock:
            self._puts[key] = put

    def take(self, keys: Iterable[bytes]) -> dict[bytes, Put]:
        """The puts of ``keys`` there are, no longer held."""
        with self._lock:
            return {key: self._puts.pop(key) for key in keys if key in self._puts}

    def forget_expired(self) -> None:
        """Puts whose writer never published: their leases ran out, Redis dropped them."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, put in self._puts.items() if put.deadline < now]:
                del self._puts[key]

    def orphan(self, key: bytes, grants: Sequence[tuple[Descriptor, Arena]]) -> None:
        """Grants of copies whose key was refused: aborted with this client's next round."""
        if grants:
            with self._lock:
                self._orphans += [(arena, key, d.version) for d, arena in grants]
            self._counters.update(orphan_grants=len(grants))

    def take_orphans(self) -> list[tuple[Arena, list[Any]]]:
        """The orphaned grants as abort items (arena, [key, version]), no longer held."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        return [(arena, [key, version_bytes(version)]) for arena, key, version in orphans]


class Allocator:
    """``allocate`` of the redis index, with one copy of each key or several."""

    def __init__(
        self,
        calls: ArenaCalls,
        view: RegistryView,
        registry: NodeRegistry,
        unpublisher: Unpublisher,
        puts: PutsInFlight,
        counters: Counters,
        *,
        replicas: int,
        lease: float,
        headroom: float,
    ) -> None:
        self._calls = calls
        self._view = view
        self._registry = registry
        self._unpublisher = unpublisher
        self._puts = puts
        self._counters = counters
        self._replicas = replicas
        self._lease = lease
        self._lease_ms = max(1, int(lease * 1000))
        self._headroom = repr(float(headroom))

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        view = self._view.current()
        allocations = [Allocation(kind=AllocationKind.NO_SPACE)] * len(requests)
        if not requests or not view.ring:
            return AllocateResult(allocations=tuple(allocations))
        if self._replicas > 1:
            return self._allocate_copies(view, requests, retry=True)
        groups = self._calls.by_arena(
            (view.ring.arena_of(r.key), [r.key, r.length, record_size(r.length)]) for r in requests
        )
        evictions = 0
        notices: list[Any] = []
        for attempt in range(2):
            answers = _Answers.of(groups, self._calls.run(self._allocate_calls(groups)).values)
            evictions += answers.evictions
            notices += answers.notices
            for indexes, kinds, entries in answers.allocated:
                for i, kind, raw in zip(indexes, kinds, entries, strict=True):
                    allocation_kind = _KINDS[int(kind)]
                    descriptor = Descriptor.from_bytes(raw) if raw else None
                    allocations[i] = Allocation(kind=allocation_kind, descriptor=descriptor)
            if not answers.gone or attempt:
                break
            # Arenas this client did not know were replaced (or never initialised): read the
            # registry again and send those keys where they belong now.
            groups = self._regroup(answers.gone, requests)
        if notices:
            self._unpublisher.drop_at_homes(notices)
        return AllocateResult(allocations=tuple(allocations), evictions=evictions)

    def _allocate_calls(self, groups: list[Group]) -> list[Call]:
        grace_ms = self._calls.grace_ms
        return [
            self._calls.call(
                arena, "kvf1_allocate", self._lease_ms, grace_ms, self._headroom, *args
            )
            for arena, _, args in groups
        ]

    def _allocate_copies(
        self,
        view: View,
        requests: Sequence[AllocationRequest],
        *,
        retry: bool,
        aborts_first: Sequence[Call] = (),
    ) -> AllocateResult:
        """Allocate every copy of every key in one round: each key's arenas
        (:meth:`Ring.copies_of`) allocate as for a key of their own, and the home's answer
        decides. A home that says EXISTS lists the copies it lacks, granted as repairs; one
        that refuses (IN_FLIGHT, NO_SPACE) leaves the other grants to abort later."""
        homes = [view.ring.copies_of(r.key, self._replicas) for r in requests]
        where = [(i, rank) for i, arenas in enumerate(homes) for rank in range(len(arenas))]
        groups = self._calls.by_arena(
            (arena, [r.key, r.length, record_size(r.length)])
            for r, arenas in zip(requests, homes, strict=True)
            for arena in arenas
        )
        calls = self._allocate_calls(groups)
        # ``aborts_first`` go ahead in the same pipelines: a master runs them in order.
        replies = self._calls.run([*aborts_first, *calls]).values
        for value in replies[: len(aborts_first)]:
            raise_unexpected(value)
        replied = _Answers.of(groups, replies[len(aborts_first) :])
        evictions = replied.evictions
        answers: list[list[tuple[AllocationKind, bytes] | None]] = [[None] * len(h) for h in homes]
        for positions, kinds, entries in replied.allocated:
            for position, kind, raw in zip(positions, kinds, entries, strict=True):
                i, rank = where[position]
                answers[i][rank] = (_KINDS[int(kind)], raw)
        if replied.notices:
            self._unpublisher.drop_at_homes(replied.notices)
        gone = [arena for arena, _, _ in replied.gone]
        allocations: list[Allocation] = []
        again: list[int] = []
        deadline = time.monotonic() + self._lease
        stale = {a.id for a in gone}
        for i, (request, arenas, answer) in enumerate(zip(requests, homes, answers, strict=True)):
            grants = [
                (Descriptor.from_bytes(a[1]), arenas[rank])
                for rank, a in enumerate(answer)
                if rank and a is not None and a[0] is AllocationKind.GRANTED
            ]
            stored = [
                Descriptor.from_bytes(a[1])
                for rank, a in enumerate(answer)
                if rank and a is not None and a[0] is AllocationKind.EXISTS
            ]
            home = answer[0]
            if retry and any(a.id in stale for a in arenas):
                # One of its arenas was gone: its grants go back, and it is asked again.
                if home is not None and home[0] is AllocationKind.GRANTED:
                    grants.append((Descriptor.from_bytes(home[1]), arenas[0]))
                self._puts.orphan(request.key, grants)
                again.append(i)
                allocations.append(Allocation(kind=AllocationKind.NO_SPACE))
                continue
            if home is None or home[0] not in (AllocationKind.GRANTED, AllocationKind.EXISTS):
                self._puts.orphan(request.key, grants)
                kind = AllocationKind.NO_SPACE if home is None else home[0]
                allocations.append(Allocation(kind=kind))
                continue
            first = Descriptor.from_bytes(home[1])
            granted = home[0] is AllocationKind.GRANTED
            if granted:
                shortfall = self._replicas - 1 - len(grants) - len(stored)
                self._counters.update(
                    replica_grants=len(grants), replica_shortfall=max(0, shortfall)
                )
            else:
                stored = [*alternates(home[1], view.nodes), *stored]
                self._counters.update(replica_repairs=len(grants))
            if granted or grants:
                put = Put(
                    home=arenas[0],
                    home_version=first.version,
                    granted=granted,
                    copies={d.version: (d, arena) for d, arena in grants},
                    existing=stored,
                    deadline=deadline,
                )
                if granted:
                    put.copies[first.version] = (first, arenas[0])
                self._puts.hold(request.key, put)
            allocations.append(
                Allocation(kind=home[0], descriptor=first, replicas=tuple(d for d, _ in grants))
            )
        if again:
            # Arenas this client did not know were replaced, or not initialised yet (a node
            # registering): read the registry again, initialise those it lists, and ask the
            # keys' arenas now (once), the grants they got given back first.
            self._counters.update(stale_arenas=len(gone))
            view = self._view.refresh()
            self._registry.init_arenas(
                view, [view.arenas[a.id] for a in gone if a.id in view.arenas]
            )
            retried = self._allocate_copies(
                view,
                [requests[i] for i in again],
                retry=False,
                aborts_first=self._calls.abort_calls(self._puts.take_orphans()),
            )
            evictions += retried.evictions
            for i, allocation in zip(again, retried.allocations, strict=True):
                allocations[i] = allocation
        return AllocateResult(allocations=tuple(allocations), evictions=evictions)

    def _regroup(self, gone: list[Group], requests: Sequence[AllocationRequest]) -> list[Group]:
        """The requests of arenas found gone, grouped by the arenas the registry has now."""
        self._counters.update(stale_arenas=len(gone))
        view = self._view.refresh()
        registered = [a for a, _, _ in gone if a.id in view.arenas]
        if registered:
            self._registry.init_arenas(view, [view.arenas[a.id] for a in registered])
        if not view.ring:
            return []
        indexes = [i for _, group_indexes, _ in gone for i in group_indexes]
        regrouped = self._calls.by_arena(
            (
                view.ring.arena_of(requests[i].key),
                [requests[i].key, requests[i].length, record_size(requests[i].length)],
            )
            for i in indexes
        )
        # Map the regrouped positions back to the request positions.
        return [(arena, [indexes[j] for j in where], args) for arena, where, args in regrouped]


@attrs.frozen
class _Answers:
    """What the arenas of a ``kvf1_allocate`` round answered."""

    evictions: int
    notices: list[Any]
    """Records of keys held elsewhere that the arenas evicted (their homes drop them)."""
    gone: list[Group]
    """Groups whose arena is gone (replaced, or not initialised yet by a registering node)."""
    allocated: list[tuple[list[int], list[Any], list[Any]]]
    """Per arena that allocated: its items' positions, their kinds and their entries."""

    @classmethod
    def of(cls, groups: list[Group], replies: Sequence[Any]) -> _Answers:
        """Where a call failed nothing was granted: its keys stay NO_SPACE (an unexpected
        failure raises)."""
        evictions = 0
        notices: list[Any] = []
        gone: list[Group] = []
        allocated: list[tuple[list[int], list[Any], list[Any]]] = []
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                raise_unexpected(reply)
                continue
            if reply[0] == b"gone":
                gone.append(group)
                continue
            _, evicted, kinds, entries, found = reply
            evictions += int(evicted)
            notices += found
            allocated.append((group[1], kinds, entries))
        return cls(evictions=evictions, notices=notices, gone=gone, allocated=allocated)
