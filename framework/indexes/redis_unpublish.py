"""Taking entries out of the redis index: deletes, invalid records, and what follows them.

An entry leaves at once (new lookups miss); its slot retires and is reused after the grace
period. With replicas, a delete takes every copy; a record readers found invalid takes only
that copy (the arena that granted it is named by the low bits of its version), and the key
stays readable from the others. A record restored into another arena than its key's is
known to both arenas, and each tells the other when its side goes (*notices*): an entry
whose record went is unpublished at its home, a record whose entry went is released where
it is held.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvfabric.indexes.redis_calls import ArenaCalls, ok, raise_unexpected
from kvfabric.indexes.redis_layout import Arena, version_bytes
from kvfabric.indexes.redis_registry import RegistryView
from kvfabric.spi import GrantRef

__all__ = ["Unpublisher"]


class Unpublisher:
    """``unpublish`` and ``drop_invalid``, and the notices of records held elsewhere."""

    def __init__(self, calls: ArenaCalls, view: RegistryView, *, replicas: int) -> None:
        self._calls = calls
        self._view = view
        self._replicas = replicas

    def unpublish(self, keys: Sequence[bytes]) -> int:
        return self._unpublish([(k, b"") for k in keys], "unpublished")

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        """Readers found these published records invalid: unpublish each that is still the
        published version, so the next put of its key stores it again. With replicas, the
        bad copy's own arena drops it and the home forgets it (the arena is told by the
        version's low bits, which name the arena that granted it)."""
        return self._unpublish(
            [(r.key, version_bytes(r.version)) for r in records], "invalid_reports"
        )

    def _unpublish(self, pairs: Sequence[tuple[bytes, bytes]], counter: str) -> int:
        view = self._view.current()
        if not pairs or not view.ring:
            return 0
        if self._replicas == 1:
            homes = [(view.ring.arena_of(key), [key, version]) for key, version in pairs]
            elsewhere: list[tuple[Arena, list[Any]]] = []
        else:
            homes, elsewhere = [], []
            for key, version in pairs:
                arenas = view.ring.copies_of(key, self._replicas)
                homes.append((arenas[0], [key, version]))
                for arena in arenas[1:]:
                    # Every copy for a delete; for an invalid copy, the arena holding it.
                    if not version or int.from_bytes(version, "little") & 0xFFF == arena.id % 4096:
                        elsewhere.append((arena, [key, version]))
        calls = self._calls
        groups = calls.by_arena(homes)
        others = calls.by_arena(elsewhere)
        # The homes count: each copy is their own or one they list. Deleting a key takes its
        # other copies too, counted apart.
        batch = [calls.unpublish_call(arena.id, counter, args) for arena, _, args in groups]
        batch += [
            calls.unpublish_call(arena.id, "replicas_dropped", args) for arena, _, args in others
        ]
        removed = 0
        notices: list[Any] = []
        for position, value in enumerate(calls.run(batch).values):
            raise_unexpected(value)
            if ok(value):
                if position < len(groups):
                    removed += int(value[1])
                notices += value[2]
        if notices:
            self._release_at_hosts(notices)
        return removed

    def drop_at_homes(self, notices: Iterable[Any]) -> int:
        """Entries whose records (in another arena) were evicted or dropped go too."""
        by_home: dict[int, list[Any]] = {}
        for home, _offset, key, version in notices:
            by_home.setdefault(int(home), []).extend([key, version])
        if not by_home:
            return 0
        calls = [
            self._calls.unpublish_call(home, "hosted_drops", args) for home, args in by_home.items()
        ]
        return sum(int(v[1]) for v in self._calls.run(calls).values if ok(v))

    def _release_at_hosts(self, notices: Iterable[Any]) -> None:
        """Slots holding records of entries that went elsewhere retire."""
        by_host: dict[int, list[Any]] = {}
        for host, offset, key, version in notices:
            by_host.setdefault(int(host), []).extend([offset, key, version])
        grace_ms = self._calls.grace_ms
        calls = [
            self._calls.call_at(host, "kvf1_release_hosted", grace_ms, *args)
            for host, args in by_host.items()
        ]
        if calls:
            self._calls.run(calls)
