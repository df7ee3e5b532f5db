"""The put through extents: records laid into runs of region this client holds, one publish.

Where the index leases extents and this client reads its lookup image, a put skips the
``allocate`` round trip: the image says which keys are stored (those move no bytes), the
others are dealt over extents this client holds (one per node, spread as ``allocate`` would
spread them, leased when none has the room: :mod:`~kvfabric._client.extents`), written, and
published with the keys found stored in one ``publish_carved`` call. An extent whose node
failed or whose records were refused goes back to the index; one held past its lease share
is written nothing. When it cannot be done this way (no image, a key the image cannot tell
of, no extent to be had) the put allocates per key instead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvfabric._client.engine_blocks import Blocks, blocks_for
from kvfabric._client.extents import EXTENT_BYTES, Carving, ExtentPool, stripes
from kvfabric._client.index_calls import IndexCalls, Outcomes
from kvfabric._client.put_outcome import PutOutcome
from kvfabric._client.record_io import RecordIO
from kvfabric._client.topology import Topology
from kvfabric._runtime.image import ImageStop
from kvfabric._runtime.record import record_size
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import CarvedRecord, CarveOutcome

__all__ = ["CarvedWrites"]

_CARVED_OUTCOME = {
    CarveOutcome.STORED: PutOutcome.STORED,
    CarveOutcome.EXISTS: PutOutcome.DEDUPLICATED,
    CarveOutcome.IN_FLIGHT: PutOutcome.IN_FLIGHT,
    CarveOutcome.REFUSED: PutOutcome.FAILED,
}


class CarvedWrites:
    """One store's puts into the extents it holds; thread-safe."""

    def __init__(
        self,
        *,
        calls: IndexCalls,
        topology: Topology,
        records: RecordIO,
        counters: Counters,
        pool: ExtentPool,
    ) -> None:
        self._calls = calls
        self._index = calls.index
        self._topology = topology
        self._records = records
        self._counters = counters
        self._pool = pool

    def put(
        self,
        keys: Sequence[bytes],
        pieces: Sequence[list[memoryview]],
        lengths: Sequence[int],
        blocks: Blocks = None,
    ) -> list[PutOutcome] | None:
        """The put through extents: the lookup image says which keys are stored (those
        move no bytes), the others are laid into extents this client holds (one per node,
        spread as allocate would spread them), written, and published in one call. None
        when it cannot be done that way (no image, a key it cannot tell of, no extent to be
        had): the caller allocates per key."""
        image = self._topology.image_reader()
        if image is None or not self._index.leases_extents():
            return None
        states, trips = image.exists(keys)
        self._counters.add("image_round_trips", trips)
        if ImageStop.UNUSABLE in states:
            self._counters.add("image_unavailable")
            return None
        if ImageStop.UNKNOWN in states:
            return None
        fresh = [i for i, state in enumerate(states) if state != ImageStop.HIT]
        # Stored already: no bytes move, and the index hears of it with the publish (each
        # counts as stored once more, as an allocate finding it would count it).
        again = [key for key, state in zip(keys, states, strict=True) if state == ImageStop.HIT]
        outcomes = [PutOutcome.DEDUPLICATED] * len(keys)
        if not fresh:
            # Stored whether or not the index hears it now: the outcomes stand either way.
            self._calls.ask(self._index.publish_carved, [], again)
        else:
            pool = self._pool
            carvings = self._carve(
                [keys[i] for i in fresh],
                [lengths[i] for i in fresh],
                image.nodes_generation(),
            )
            if carvings is None:
                return None
            if time.monotonic() >= min(c.held.expires_at for c in carvings):
                # Held up (paused, swapped out) for much of a lease: the index may take the
                # extent back any moment, so write nothing.
                for carving in carvings:
                    pool.give_up(carving.held)
                self._counters.add("late_writes_avoided", len(fresh))
                written = [PutOutcome.FAILED] * len(fresh)
            else:
                written = self._write(carvings, [pieces[i] for i in fresh], again, blocks)
            for i, outcome in zip(fresh, written, strict=True):
                outcomes[i] = outcome
        self._counters.update(
            stored=outcomes.count(PutOutcome.STORED),
            dedup_hits=outcomes.count(PutOutcome.DEDUPLICATED),
            in_flight_skips=outcomes.count(PutOutcome.IN_FLIGHT),
            put_failures=outcomes.count(PutOutcome.FAILED),
        )
        return outcomes

    def forget(self) -> None:
        """The index restarted: the extents it leased are gone with it."""
        self._pool.forget()

    def release(self) -> None:
        """Give every extent held back now (the store is closing), rather than when their
        leases run out."""
        held = self._pool.release_all()
        if held:
            self._calls.ask(self._index.lease_extents, 0, 0, 0, (), held)

    def _carve(
        self, keys: list[bytes], lengths: list[int], generation: int
    ) -> list[Carving] | None:
        """Records for ``keys``, dealt over extents held on distinct nodes (leased now
        where the pool has none with the room), one extent per node known; ``generation``:
        the index's nodes generation, as its lookup image says now."""
        pool = self._pool
        topology = self._topology
        if topology.nodes_stale or pool.stale(generation):
            # A node joined, left or restarted: spread over the nodes there are now.
            topology.refresh()
        sizes = list(map(record_size, lengths))
        learned = topology.learned_nodes
        nodes = len(learned) if learned else 1
        dealt = stripes(len(keys), nodes)
        need = max(sum(sizes[i] for i in stripe) for stripe in dealt)
        held = pool.take(need, len(dealt), generation)
        if len(held) < len(dealt) and pool.may_lease():
            asked_at = time.monotonic()
            wanted = len(dealt) - len(held)
            extents = self._calls.ask(
                self._index.lease_extents,
                need,
                max(4 * need, EXTENT_BYTES),
                wanted,
                [h.extent.node for h in held],
                pool.returning(),
            )
            leased = pool.leased(extents or [], asked_at, wanted)
            evictions = sum(h.extent.evictions for h in leased)
            self._counters.update(extent_leases=len(leased), evictions=evictions)
            # Each entry evicted to make room is a bucket of the image rewritten (emptied).
            topology.expect_image_rewrites(evictions)
            held += leased
        topology.learn({h.extent.node for h in held})
        for h in [h for h in held if not self._records.reaches([h.extent.node])]:
            # On a node this client cannot reach (gone since it was leased): given back.
            pool.give_up(h)
            held.remove(h)
        if len(held) < len(dealt):
            # Fewer nodes to spread over than known: dealt over the extents held.
            dealt = stripes(len(keys), len(held)) if held else []
            if not held or any(
                h.room() < sum(sizes[i] for i in stripe)
                for h, stripe in zip(held, dealt, strict=True)
            ):
                for h in held:
                    pool.give_back(h)
                return None
        return [
            h.carve([keys[i] for i in stripe], [lengths[i] for i in stripe], stripe)
            for h, stripe in zip(held, dealt, strict=True)
        ]

    def _write(
        self,
        carvings: list[Carving],
        pieces: Sequence[list[memoryview]],
        again: list[bytes],
        blocks: Blocks,
    ) -> list[PutOutcome]:
        """Write the carved records (each node's in parallel) and publish those that landed,
        with ``again`` (the keys found stored), in one call; one outcome per record, in the
        order of ``pieces``."""
        pool = self._pool
        descriptors = [d for carving in carvings for d in carving.descriptors]
        order = [i for carving in carvings for i in carving.positions]
        self._topology.learn({carving.held.extent.node for carving in carvings})
        report = self._records.write(descriptors, [pieces[i] for i in order])
        self._counters.update(
            transport_failures=report.failed_nodes,
            backoff_skips=report.skipped,
            nodes_backed_off=report.backed_off,
        )
        crcs = iter(report.crcs)
        landed: list[CarvedRecord] = []
        for carving in carvings:
            extent = carving.held.extent.id
            for d in carving.descriptors:
                crc = next(crcs)
                if crc is not None:
                    landed.append(
                        CarvedRecord(
                            extent=extent,
                            key=d.key,
                            offset=d.offset,
                            length=d.length,
                            version=d.version,
                            crc=crc,
                        )
                    )
        said = blocks_for([r.key for r in landed], blocks) if blocks else None
        if said:
            told = self._calls.publish(self._index.publish_carved_described, landed, again, said)
        elif landed or again:
            told = self._calls.publish(self._index.publish_carved, landed, again)
        else:
            told = Outcomes([], held=False)
        if report.failed_nodes or len(landed) < len(descriptors):
            self._topology.relearn_after_failure()
        if told is not None:
            # A record stored is one bucket of the image rewritten.
            self._topology.expect_image_rewrites(told.values.count(CarveOutcome.STORED))
        outcome_of: dict[tuple[int, int], CarveOutcome | None] = dict(
            zip(
                ((r.extent, r.offset) for r in landed),
                told.values if told is not None else [CarveOutcome.REFUSED] * len(landed),
                strict=True,
            )
        )
        if told is not None and told.held:
            self._wipe_unknown(carvings, outcome_of)
        outcomes = [PutOutcome.FAILED] * len(pieces)
        for carving in carvings:
            extent = carving.held.extent.id
            # None: not landed, or its publish is not known (reported not stored).
            mine = [outcome_of.get((extent, d.offset)) for d in carving.descriptors]
            for i, outcome in zip(carving.positions, mine, strict=True):
                if outcome is not None:
                    outcomes[i] = _CARVED_OUTCOME[outcome]
            if None in mine or CarveOutcome.REFUSED in mine:
                # A node or the index failed, or the extent is no longer this client's: it
                # goes back (what was published stays published).
                pool.give_up(carving.held)
            else:
                carving.done()
                pool.give_back(carving.held)
        written = sum(
            d.length for d, crc in zip(descriptors, report.crcs, strict=True) if crc is not None
        )
        self._counters.update(carved_writes=len(landed), payload_bytes_written=written)
        return outcomes

    def _wipe_unknown(
        self, carvings: list[Carving], outcome_of: dict[tuple[int, int], CarveOutcome | None]
    ) -> None:
        """Wipe the records whose publish the index could not tell of, in extents still
        this writer's (early in their lease, none given back): no scan of a node may find
        them and bring them back as stored after a controller restart."""
        now = time.monotonic()
        unknown = [
            d
            for carving in carvings
            if now < carving.held.expires_at
            for d in carving.descriptors
            if (carving.held.extent.id, d.offset) in outcome_of
            and outcome_of[carving.held.extent.id, d.offset] is None
        ]
        if unknown:
            self._counters.add("records_wiped", self._records.wipe(unknown))
