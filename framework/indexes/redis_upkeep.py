"""The redis index's periodic upkeep, run by every client and data node that ticks.

Nothing in Redis runs on its own: whoever ticks reads the registry if it changed, removes
nodes whose liveness key expired, finishes dropping arenas, aborts the grants this client
orphaned, and now and then sweeps every arena's expired leases and retired slots. Arenas are
also swept by every allocation in them; the sweep keeps the gauges right where nobody writes.
"""

from __future__ import annotations

import time

from kvfabric.errors import ControllerUnavailableError
from kvfabric.indexes.redis_allocation import PutsInFlight
from kvfabric.indexes.redis_calls import ArenaCalls
from kvfabric.indexes.redis_registry import NodeRegistry, RegistryView

__all__ = ["Upkeep"]

# Seconds between sweeps of every arena by one ticking process.
_UPKEEP_INTERVAL = 5.0


class Upkeep:
    """``tick`` of the redis index."""

    def __init__(
        self,
        calls: ArenaCalls,
        view: RegistryView,
        registry: NodeRegistry,
        puts: PutsInFlight,
    ) -> None:
        self._calls = calls
        self._view = view
        self._registry = registry
        self._puts = puts
        self._last_sweep = time.monotonic()

    def tick(self) -> None:
        try:
            view = self._view.refresh()
            self._puts.forget_expired()
            orphans = self._puts.take_orphans()
            if orphans:
                self._calls.run(self._calls.abort_calls(orphans))
            self._registry.expire_silent()
            if view.dropped:
                self._registry.drop_arenas(sorted(view.dropped))
            now = time.monotonic()
            if now - self._last_sweep >= _UPKEEP_INTERVAL:
                self._last_sweep = now
                grace_ms = self._calls.grace_ms
                call = self._calls.call
                self._calls.run([call(a, "kvf1_tick", grace_ms) for a in view.arenas.values()])
        except ControllerUnavailableError:
            pass  # the next tick tries again
