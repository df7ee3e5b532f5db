"""Calls to the redis index's server-side functions: made per arena, run as rounds.

Every change to an arena or to the registry is one function of ``redis_functions.lua``.
:class:`ArenaCalls` makes those calls (``FCALL_RO`` for reads, which replicate nothing),
groups a batch's items by arena so that each arena gets one call per :data:`CALL_ITEMS` of
its keys (a call runs whole inside Redis, which serves no one else meanwhile: a batch of a
hundred thousand keys is many bounded calls in the same pipelines, not one long one), and
runs a batch's calls as one round over the masters
(:class:`~kvfabric.indexes.redis_shards.ShardSet`). It decides what an outage means for a
round: some masters down is the caller's business (misses, no grant), all of them down
raises; a function failing inside Redis is a bug and always raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

from kvfabric.errors import ControllerUnavailableError
from kvfabric.indexes.redis_layout import Arena, Ring, arena_prefix, key_slot, registry_key
from kvfabric.indexes.redis_shards import Call, Round, ShardSet
from kvfabric.spi import Counters

__all__ = ["CALL_ITEMS", "ArenaCalls", "Group", "ok", "raise_unexpected"]

CALL_ITEMS = 1024
"""Items (keys) one function call takes at most: Redis runs a call whole, serving no other
client meanwhile, so a call's time stays bounded whatever the batch (more calls go in the
same pipeline: no round trip more)."""

Group: TypeAlias = tuple[Arena, list[int], list[Any]]
"""A batch's items for one arena: the arena, the items' positions, their arguments joined."""


class ArenaCalls:
    """The function calls of one namespace, and the rounds that run them."""

    def __init__(
        self,
        shards: ShardSet,
        *,
        namespace: str,
        grace_ms: int,
        counters: Counters,
    ) -> None:
        self._shards = shards
        self._ns = namespace
        self._grace_ms = grace_ms
        self._counters = counters
        self._registry = registry_key(namespace)
        self._registry_slot = key_slot(self._registry)

    @property
    def grace_ms(self) -> int:
        """How long a slot let go waits before reuse, as every function that retires one is
        told."""
        return self._grace_ms

    def registry(self, function: str, *args: Any, read_only: bool = False) -> Any:
        """Call a registry function (one round trip to the registry's master); raises what
        it returns."""
        command = "FCALL_RO" if read_only else "FCALL"
        return self._shards.execute(
            self._registry_slot, command, function, 1, self._registry, *args
        )

    @staticmethod
    def call(arena: Arena, function: str, *args: Any, read_only: bool = False) -> Call:
        command = "FCALL_RO" if read_only else "FCALL"
        return Call(slot=arena.slot, args=(command, function, 1, arena.meta, *args))

    def call_at(self, arena: int, function: str, *args: Any) -> Call:
        """A call to an arena known by its id alone (one this client's view may not list)."""
        prefix = arena_prefix(self._ns, arena)
        return Call(slot=key_slot(prefix), args=("FCALL", function, 1, prefix + b"m", *args))

    def unpublish_call(self, arena: int, counter: str, args: list[Any]) -> Call:
        """``kvf1_unpublish`` of (key, version or b"") pairs, counted under ``counter``."""
        return self.call_at(arena, "kvf1_unpublish", self._grace_ms, counter, *args)

    def abort_calls(self, *items: list[tuple[Arena, list[Any]]]) -> list[Call]:
        """``kvf1_abort`` of (key, version) per grant, one call per arena."""
        return [
            self.call(arena, "kvf1_abort", self._grace_ms, *args)
            for arena, _, args in self.by_arena(item for group in items for item in group)
        ]

    def run(self, calls: Sequence[Call], *, wait_replicas: int = 0) -> Round:
        """One round; raises ControllerUnavailableError when no master answered at all."""
        result = self._shards.run(calls, wait_replicas=wait_replicas)
        failed = sum(isinstance(v, ControllerUnavailableError) for v in result.values)
        if failed:
            self._counters.update(unavailable_calls=1)
            if failed == len(calls):
                first = next(v for v in result.values if isinstance(v, Exception))
                raise first
        return result

    def flags(self, groups: list[Group], function: str, *head: Any) -> list[bool]:
        """Run ``function`` per arena; the flags it returns, in the order of the items."""
        total = sum(len(indexes) for _, indexes, _ in groups)
        flags = [False] * total
        calls = [self.call(arena, function, *head, *args) for arena, _, args in groups]
        for (_, indexes, _), value in zip(groups, self.run(calls).values, strict=True):
            raise_unexpected(value)
            if ok(value):
                for i, flag in zip(indexes, value[1], strict=True):
                    flags[i] = bool(flag)
        return flags

    @staticmethod
    def by_arena(items: Iterable[tuple[Arena, list[Any]]]) -> list[Group]:
        """Items grouped by arena: (arena, item positions, concatenated arguments), an
        arena's items in groups of at most :data:`CALL_ITEMS`."""
        groups: list[Group] = []
        current: dict[int, Group] = {}
        for position, (arena, args) in enumerate(items):
            group = current.get(arena.id)
            if group is None or len(group[1]) >= CALL_ITEMS:
                group = current[arena.id] = (arena, [], [])
                groups.append(group)
            group[1].append(position)
            group[2].extend(args)
        return groups

    @staticmethod
    def group_keys(ring: Ring, keys: Sequence[bytes]) -> list[Group]:
        """``keys`` by the arena each belongs to (the ring must not be empty), in groups of
        at most :data:`CALL_ITEMS`."""
        return [
            (
                arena,
                where[start : start + CALL_ITEMS],
                [keys[i] for i in where[start : start + CALL_ITEMS]],
            )
            for arena, where in ring.group(keys)
            for start in range(0, len(where), CALL_ITEMS)
        ]


def ok(value: Any) -> bool:
    """Whether a function's reply is ``ok`` (not ``gone``, not an error)."""
    return isinstance(value, list) and bool(value) and value[0] == b"ok"


def raise_unexpected(value: Any) -> None:
    """A function failing inside Redis is a bug, not an outage: never read it as a miss."""
    if isinstance(value, Exception) and not isinstance(value, ControllerUnavailableError):
        raise value
