"""Lookups in the redis index: the read-only calls every client makes most.

A batched lookup groups its keys by arena and sends one ``FCALL_RO`` per arena, pipelined per
master: one round trip per shard that holds any of the keys. Reading entries moves Redis's
own LRU clock of them, which eviction samples, while the function replicates nothing. A
shard that does not answer makes its keys misses; an arena found gone (replaced) makes the
view be read again before the next call.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.indexes.redis_calls import ArenaCalls, Group, raise_unexpected
from kvfabric.indexes.redis_layout import ENTRY_HEAD, PENDING, alternates
from kvfabric.indexes.redis_registry import RegistryView, View
from kvfabric.spi import Copies, Counters

__all__ = ["Lookups"]


class Lookups:
    """``lookup_prefix``, ``resolve`` and ``exists`` (with the copies each key has)."""

    def __init__(self, calls: ArenaCalls, view: RegistryView, counters: Counters) -> None:
        self._calls = calls
        self._view = view
        self._counters = counters

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        found = self._read(keys)
        out: list[Descriptor | None] = []
        for descriptor in found.descriptors:
            if descriptor is None:
                break
            out.append(descriptor)
        listed = {i: a for i, a in found.alternates.items() if i < len(out)}
        self._counters.update(lookups=1, lookup_keys=len(keys), prefix_hits=len(out))
        return Copies(descriptors=out, alternates=listed)

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        found = self._read(keys)
        self._counters.update(
            resolves=1, resolve_hits=sum(d is not None for d in found.descriptors)
        )
        return found

    def _read(self, keys: Sequence[bytes]) -> Copies:
        view = self._view.current()
        found: list[Descriptor | None] = [None] * len(keys)
        copies: dict[int, tuple[Descriptor, ...]] = {}
        if not keys or not view.ring:
            return Copies(descriptors=found)
        for arena, indexes, reply in self._ask(view, keys, "kvf1_lookup"):
            published = [
                (i, entry)
                for i, entry in zip(indexes, reply[1], strict=True)
                if entry is not None and entry[DESCRIPTOR_SIZE] != PENDING
            ]
            if not published:
                continue
            wire = b"".join(entry[:DESCRIPTOR_SIZE] for _, entry in published)
            for (i, entry), descriptor in zip(
                published, Descriptor.many_from_bytes(wire), strict=True
            ):
                # A record restored into another node's arena: only while that node is.
                if descriptor.node == arena.node or descriptor.node in view.nodes:
                    found[i] = descriptor
                    if len(entry) > ENTRY_HEAD:
                        others = alternates(entry, view.nodes)
                        if others:
                            copies[i] = others
        return Copies(descriptors=found, alternates=copies)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        view = self._view.current()
        self._counters.update(exists_calls=1)
        out = [False] * len(keys)
        if not keys or not view.ring:
            return out
        for _, indexes, reply in self._ask(view, keys, "kvf1_exists"):
            for i, flag in zip(indexes, reply[1:], strict=True):
                out[i] = bool(flag)
        return out

    def _ask(self, view: View, keys: Sequence[bytes], function: str) -> list[Group]:
        """``function`` of every arena holding any of ``keys``, in one round: (arena, the
        positions of its keys, its reply) for each arena that answered. A shard that is down
        answers for none of its keys (misses); an arena gone answers for none either."""
        calls = self._calls
        groups = calls.group_keys(view.ring, keys)
        batch = [calls.call(arena, function, *args, read_only=True) for arena, _, args in groups]
        answered: list[Group] = []
        for (arena, indexes, _), reply in zip(groups, calls.run(batch).values, strict=True):
            if isinstance(reply, Exception):
                raise_unexpected(reply)
                continue
            if reply[0] is None:
                self._view.gone()
                continue
            answered.append((arena, indexes, reply))
        return answered
