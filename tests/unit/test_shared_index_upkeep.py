"""The upkeep thread of a shared index tells the store when the nodes changed, and always at
its first tick: the store may have learned the nodes before that tick, and a change in
between (a Redis restarted empty, the nodes registered again under other ids) would
otherwise never be seen (found as a put that failed for good in ~1 run in 10 of
``test_a_redis_restarted_empty_gets_the_nodes_and_their_records_back``).

The index is a real one (the memory index, which has the same ``tick``/``nodes`` a shared
index has); the store is a recorder of what it is told.
"""

from __future__ import annotations

import threading

from kvfabric._client.shared_index import IndexUpkeep
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.spi.index import NodeInfo, RegionInfo

_WAIT = 10.0  # far beyond the half-second tick; only a broken upkeep waits it out


class _Told:
    """What a Store's ``membership_changed`` would be told."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self._changed = threading.Condition()

    def membership_changed(self, generation: int) -> None:
        with self._changed:
            self.generations.append(generation)
            self._changed.notify_all()

    def wait_for(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.generations) >= count, _WAIT)


def _node(name: str) -> NodeInfo:
    return NodeInfo(name=name, regions=(RegionInfo(id=0, size=1 << 20, rkey=7),), endpoints=())


def test_the_first_tick_tells_the_store_and_a_later_change_tells_it_again() -> None:
    index = MemoryIndex(lease=30.0, grace=0.0, headroom=0.0)
    index.register_node(_node("a"))
    told = _Told()
    upkeep = IndexUpkeep(index, told)  # type: ignore[arg-type]
    try:
        assert told.wait_for(1)
        assert told.generations == [1]
        index.register_node(_node("b"))
        assert told.wait_for(2)
        assert told.generations == [1, 2]
    finally:
        upkeep.stop()
