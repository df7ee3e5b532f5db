"""Publishing in the redis index: the second of a put's two rounds, and giving grants up.

A publish makes written grants visible with their CRC, in one round: each copy in the arena
holding it, the key's home entry listing the others, so lookups still read the home alone.
Grants of a key that were not named, and grants left over from refused allocations, are
aborted in the same round; their slots retire. With ``wait_replicas`` each master waits
until that many of its replicas have the publish, so a failover cannot lose it; a publish
they did not acknowledge in time is reported as not stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from kvfabric.indexes.redis_allocation import PutsInFlight
from kvfabric.indexes.redis_calls import ArenaCalls, ok, raise_unexpected
from kvfabric.indexes.redis_events import encode_block
from kvfabric.indexes.redis_layout import Arena, version_bytes
from kvfabric.indexes.redis_registry import RegistryView
from kvfabric.spi import Counters, EngineBlock, GrantRef

__all__ = ["Publisher"]


class Publisher:
    """``publish`` and ``abort`` of the redis index."""

    def __init__(
        self,
        calls: ArenaCalls,
        view: RegistryView,
        puts: PutsInFlight,
        counters: Counters,
        *,
        replicas: int,
        wait_replicas: int,
    ) -> None:
        self._calls = calls
        self._view = view
        self._puts = puts
        self._counters = counters
        self._replicas = replicas
        self._wait = wait_replicas

    def publish(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock] | None = None
    ) -> list[bool]:
        """Publish the copies that landed, in one round: each in the arena holding it, the
        home's entry listing the others. A key whose home copy did not land is not
        published (its other copies stay stored: the next put of the key finds them and
        writes no bytes for them); grants of a key that were not named are aborted in the
        same round, with grants left over from refused allocations. ``blocks``: what the
        writer said of some keys, for the KV events (``kvf1_publish_described`` carries each
        item's encoded block, b"" for a key without one); None: nothing more is sent."""
        view = self._view.current()
        out = [False] * len(grants)
        if not grants or not view.ring:
            return out
        by_key: dict[bytes, list[int]] = {}
        for i, grant in enumerate(grants):
            by_key.setdefault(grant.key, []).append(i)
        puts = self._puts.take(by_key)
        items: list[tuple[Arena, list[Any]]] = []
        answers: list[int] = []
        """The grant each publish item answers for."""
        homes: dict[bytes, int] = {}
        """Key -> the item publishing its home copy (-1: it did not land)."""
        links: list[tuple[Arena, list[Any]]] = []
        aborts: list[tuple[Arena, list[Any]]] = []
        for key, positions in by_key.items():
            put = puts.get(key)
            landed = {
                grants[i].version: i
                for i in positions
                if put is not None and grants[i].version in put.copies
            }
            for i in positions:
                if grants[i].version not in landed:
                    # Not one of a multi-copy put's grants: published at the key's home.
                    items.append(
                        (
                            view.ring.arena_of(key),
                            [key, version_bytes(grants[i].version), grants[i].crc, b""],
                        )
                    )
                    answers.append(i)
            if put is None:
                continue
            for version, (_, arena) in put.copies.items():
                if version not in landed:
                    aborts.append((arena, [key, version_bytes(version)]))
            others = [
                put.copies[v][0].with_crc(grants[i].crc)
                for v, i in landed.items()
                if not (put.granted and v == put.home_version)
            ]
            for v, i in landed.items():
                if not (put.granted and v == put.home_version):
                    items.append((put.copies[v][1], [key, version_bytes(v), grants[i].crc, b""]))
                    answers.append(i)
            if put.granted:
                i = landed.get(put.home_version, -1)
                homes[key] = len(items) if i >= 0 else -1
                if i >= 0:
                    listed = [*others, *put.existing][: self._replicas - 1]
                    wire = b"".join(d.to_bytes() for d in listed)
                    args = [key, version_bytes(put.home_version), grants[i].crc, wire]
                    items.append((put.home, args))
                    answers.append(i)
            elif others:
                wire = b"".join(d.to_bytes() for d in others)
                links.append((put.home, [key, version_bytes(put.home_version), wire]))
        calls = self._calls
        function = "kvf1_publish"
        if blocks:
            function = "kvf1_publish_described"
            encoded = {key: encode_block(block) for key, block in blocks.items()}
            for _, args in items:
                args.append(encoded.get(cast(bytes, args[0])) or b"")
        groups = calls.by_arena(items)
        batch = [calls.call(arena, function, *args) for arena, _, args in groups]
        batch += [
            calls.call(arena, "kvf1_link", self._replicas - 1, *args)
            for arena, _, args in calls.by_arena(links)
        ]
        batch += calls.abort_calls(aborts, self._puts.take_orphans())
        result = calls.run(batch, wait_replicas=self._wait)
        flags = [False] * len(items)
        published = len(groups)
        for (_, positions, _), reply, durable in zip(
            groups, result.values[:published], result.durable[:published], strict=True
        ):
            raise_unexpected(reply)
            if not ok(reply):
                continue
            for position, flag in zip(positions, reply[1], strict=True):
                flags[position] = bool(flag) and durable
            if not durable:
                self._counters.update(unreplicated_publishes=sum(bool(f) for f in reply[1]))
        for value in result.values[len(groups) :]:
            raise_unexpected(value)
        for position, i in enumerate(answers):
            out[i] = flags[position]
        # A key is readable through its home: its other copies count only with it.
        for key, home in homes.items():
            if home < 0 or not flags[home]:
                for i in by_key[key]:
                    out[i] = False
        return out

    def abort(self, grants: Sequence[GrantRef]) -> None:
        view = self._view.current()
        if not grants or not view.ring:
            return
        puts = self._puts.take(g.key for g in grants)
        aborts: list[tuple[Arena, list[Any]]] = []
        for grant in grants:
            put = puts.get(grant.key)
            held = put.copies.get(grant.version) if put is not None else None
            arena = held[1] if held is not None else view.ring.arena_of(grant.key)
            aborts.append((arena, [grant.key, version_bytes(grant.version)]))
        calls = self._calls
        for value in calls.run(calls.abort_calls(aborts, self._puts.take_orphans())).values:
            raise_unexpected(value)
