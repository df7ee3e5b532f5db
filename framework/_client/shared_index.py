"""``kvfabric://HOST:PORT?index=NAME``: a client of a *shared* index, with no controller.

The index plugin (e.g. ``redis``) keeps its state where HOST:PORT points; the client calls
it directly for metadata and moves bytes with the data nodes as any client does. Two jobs
fall to every user of a shared index, done here by one background thread per store:

- **upkeep**: ``index.tick()`` every half second (expired leases, nodes that fell silent);
- **membership**: after each tick the nodes the index lists are compared (id and
  incarnation) with the last ones seen, starting from those the store learned when it
  connected; a change makes the store relearn its routes before the next read or write, as
  a controller's membership generation does.
"""

from __future__ import annotations

import logging
import threading

from kvfabric._client.record_io import RecordIO
from kvfabric._client.store import Store, StoreParts
from kvfabric.errors import ConfigError, KvfabricError
from kvfabric.spi.index import IndexPlugin

__all__ = ["IndexUpkeep", "check_shared", "client_parts"]

log = logging.getLogger("kvfabric")

TICK_INTERVAL = 0.5
"""Seconds between a client's ticks of a shared index."""


def check_shared(cls: type[IndexPlugin]) -> None:
    if not cls.shared:
        raise ConfigError(
            f"index {cls.name!r} lives inside the process that serves it: connect to that "
            f"controller (kvfabric://CONTROLLER:PORT, without index=); only a shared index "
            "(e.g. redis) is used directly"
        )


def client_parts(index: IndexPlugin, records: RecordIO, store: Store) -> StoreParts:
    """The parts of ``store`` as a client of the shared ``index``: the index closes with the
    store, after its upkeep stops."""
    upkeep: list[IndexUpkeep] = []

    def stop_upkeep() -> None:
        for job in upkeep:
            job.stop()

    return StoreParts(
        index=index,
        records=records,
        # Run in reverse: the upkeep stops before the index closes under it.
        on_close=[index.close, stop_upkeep],
        start=lambda: upkeep.append(IndexUpkeep(index, store)),
    )


class IndexUpkeep:
    """The background tick and membership check of one store's shared index."""

    def __init__(
        self, index: IndexPlugin, store: Store, *, interval: float | None = TICK_INTERVAL
    ) -> None:
        """``interval=None`` starts no thread: the caller runs :meth:`check` (tests)."""
        self._index = index
        self._store = store
        # The baseline is what the store routes by, not the first tick's answer: nodes that
        # changed between the store's connect and that tick (a Redis restarted empty, the
        # nodes back under new incarnations) must count as a change, or the store keeps
        # routing to the old ones. Comparing costs no call: the tick lists the nodes anyway.
        self._known: frozenset[tuple[int, int]] | None = store.learned_nodes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval is not None:
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="kvfabric-index-tick", daemon=True
            )
            self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.check()

    def check(self) -> bool:
        """One tick of the index and one membership check; whether the nodes changed."""
        try:
            self._index.tick()
            nodes = frozenset((n.id, n.incarnation) for n in self._index.nodes())
        except KvfabricError as exc:
            log.debug("kvfabric: shared index upkeep failed (%s); retrying", exc)
            return False
        changed = self._known is not None and nodes != self._known
        if changed:
            self._store.membership_changed(len(nodes))
        self._known = nodes
        return changed

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
