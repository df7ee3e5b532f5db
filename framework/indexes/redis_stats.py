"""The redis index's counters and stats: what this client counts, and every arena's sums.

Arenas count in Redis what their functions did (grants, evictions, ...) and keep their
gauges there (entries, free bytes, ...); what only a client sees (its lookups, its rounds,
the arenas it found replaced) it counts itself, under :data:`CLIENT_COUNTERS`.
:class:`IndexStats` reads every arena in one round and adds this client's counts, totals and
per master.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfabric.indexes.index_counters import LOOKUP_COUNTERS, WRITE_COUNTERS
from kvfabric.spi import Counters

if TYPE_CHECKING:
    from kvfabric.indexes.redis_calls import ArenaCalls
    from kvfabric.indexes.redis_registry import RegistryView
    from kvfabric.indexes.redis_shards import ShardSet

__all__ = ["ARENA_COUNTERS", "CLIENT_COUNTERS", "ROUND_COUNTERS", "IndexStats"]

CLIENT_COUNTERS = (
    *LOOKUP_COUNTERS,
    "unavailable_calls",
    "unreplicated_publishes",
    "stale_arenas",
    "nodes_expired",
    "replica_grants",
    "replica_shortfall",
    "replica_repairs",
    "orphan_grants",
)
ROUND_COUNTERS = ("rounds", "round_trips", "failed_round_trips", "topology_refreshes")
"""This client's traffic to Redis (in ``stats``; per master too, ``shardN_round_trips``)."""

ARENA_COUNTERS = (
    *WRITE_COUNTERS,
    "hosted_drops",
    "replicas_dropped",
)

_GAUGES = ("n_pub", "n_pend", "size", "free", "retired", "payload")


class IndexStats:
    """The index's ``stats``: every arena's counters and gauges, and this client's."""

    def __init__(
        self,
        shards: ShardSet,
        calls: ArenaCalls,
        view: RegistryView,
        counters: Counters,
    ) -> None:
        self._shards = shards
        self._calls = calls
        self._view = view
        self._counters = counters

    def stats(self) -> dict[str, int]:
        view = self._view.refresh()
        arenas = list(view.arenas.values())
        call = self._calls.call
        result = self._calls.run([call(a, "kvf1_stats", read_only=True) for a in arenas])
        totals = dict.fromkeys(ARENA_COUNTERS, 0)
        gauges = dict.fromkeys(_GAUGES, 0)
        masters = self._shards.masters()
        per_shard: dict[str, dict[str, int]] = {m: {"entries": 0, "used": 0} for m in masters}
        for reply, shard in zip(result.values, result.shards, strict=True):
            if isinstance(reply, Exception) or not reply or reply[0] is None:
                continue
            fields = {
                reply[i].decode(): int(reply[i + 1]) if reply[i + 1].isdigit() else 0
                for i in range(0, len(reply), 2)
            }
            for name in totals:
                totals[name] += fields.get(name, 0)
            for name in gauges:
                gauges[name] += fields.get(name, 0)
            used = fields.get("size", 0) - fields.get("free", 0) - fields.get("retired", 0)
            slot = per_shard.setdefault(shard, {"entries": 0, "used": 0})
            slot["entries"] += fields.get("n_pub", 0)
            slot["used"] += used
        out = {
            **totals,
            **self._counters.snapshot(),
            "nodes": len(view.nodes),
            "arenas": len(arenas),
            "entries": gauges["n_pub"],
            "pending": gauges["n_pend"],
            "capacity_bytes": gauges["size"],
            "free_bytes": gauges["free"],
            "retired_bytes": gauges["retired"],
            "used_bytes": gauges["size"] - gauges["free"] - gauges["retired"],
            "stored_payload_bytes": gauges["payload"],
            "shards": len(masters),
            "rounds": self._shards.rounds,
            "round_trips": self._shards.round_trips,
            "failed_round_trips": self._shards.failed_round_trips,
            "topology_refreshes": self._shards.refreshes,
        }
        trips = self._shards.round_trips_by_master()
        for i, master in enumerate(sorted(per_shard)):
            out[f"shard{i}_entries"] = per_shard[master]["entries"]
            out[f"shard{i}_used_bytes"] = per_shard[master]["used"]
            out[f"shard{i}_round_trips"] = trips.get(master, 0)
        return out

    def shared_stats(self) -> dict[str, int]:
        # Lookups run read-only in Redis (FCALL_RO) and count nothing there: they, the
        # rounds and every other client-side counter belong to each client's own stats.
        local = {*CLIENT_COUNTERS, *ROUND_COUNTERS}
        return {
            name: value
            for name, value in self.stats().items()
            if name not in local and not name.endswith("_round_trips")
        }

    def round_trip_counts(self) -> dict[str, int]:
        return {
            "rounds": self._shards.rounds,
            "round_trips": self._shards.round_trips,
            **self._shards.round_trips_by_master(),
        }
