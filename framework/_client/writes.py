"""Writes: puts and deletes, and the outcomes callers see.

A put checks its values (a value over ``max_value`` raises before anything moves), drops its
keys from the prefetch cache, and stores them one of two ways: through extents this client
holds, where the index leases them and this client reads its lookup image
(:mod:`~kvfabric._client.carved_writes`); else with one ``allocate`` call in which the index
places each key (*exists*: no bytes move; *in flight*: skipped; *grant*; *no space*), the
writes of every granted copy, and one ``publish`` call for the copies that landed. Grants of
keys with no copy published are given back. A writer held up for much of its lease writes
nothing: a slot whose lease ran out may already hold another key's record. Failures of the
index or of a data node are ``FAILED`` outcomes, counted, never raised.

Outcomes are true whatever the size of the put or a timeout: ``STORED`` is readable,
``FAILED`` is not published. A put of more than :data:`PUT_ROUND_KEYS` keys runs as rounds
of at most that many (each its own allocate, writes and publish), so what one put holds
reserved at once, and for how long, stays bounded. Where the index cannot say what became
of a publish (:meth:`~kvfabric._client.index_calls.IndexCalls.publish`: no answer, and
none to the question either), those keys are ``FAILED`` and, while their slots are still
this writer's (within the lease), their records' headers are wiped, so no node's scan brings
them back as stored after a controller restart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeAlias

from kvfabric._client.carved_writes import CarvedWrites
from kvfabric._client.engine_blocks import Blocks, blocks_for, described
from kvfabric._client.index_calls import IndexCalls
from kvfabric._client.key_checks import check_keys
from kvfabric._client.no_space_hint import NoSpaceHint
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._client.put_outcome import PutOutcome
from kvfabric._client.record_io import RecordIO, value_pieces
from kvfabric._client.topology import Topology
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ValueTooLargeError
from kvfabric.spi.counters import Counters
from kvfabric.spi.events import EngineBlock
from kvfabric.spi.index import AllocationKind, AllocationRequest, GrantRef

__all__ = ["PUT_ROUND_KEYS", "Writes"]

Copy: TypeAlias = tuple[int, Descriptor]
"""A copy to write: the position of its key in the put, and its grant."""
_Written: TypeAlias = tuple[list[Copy], list[Copy], list[Copy], set[int]]

# A writer that used more than this share of its lease before writing gives the grants up.
_LEASE_SHARE = 0.5
# A record whose publish is unknown is wiped only this early in its lease: the slot is surely
# still this writer's (the lease is counted from before the index granted it).
_WIPE_SHARE = 0.9

PUT_ROUND_KEYS = 16384
"""Keys a put stores in one round (allocate, writes, publish); a larger put runs several, so
its reservations stay well within what the controller lets one client hold."""

_OUTCOME_OF = {
    AllocationKind.EXISTS: PutOutcome.DEDUPLICATED,
    AllocationKind.IN_FLIGHT: PutOutcome.IN_FLIGHT,
    AllocationKind.NO_SPACE: PutOutcome.NO_SPACE,
}


class Writes:
    """One store's puts and deletes; thread-safe."""

    def __init__(
        self,
        *,
        calls: IndexCalls,
        topology: Topology,
        records: RecordIO,
        prefetch: PrefetchCache,
        counters: Counters,
        max_value: int,
        carved: CarvedWrites | None,
    ) -> None:
        """``carved``: the put through extents, None where this client leases none."""
        self._calls = calls
        self._index = calls.index
        self._topology = topology
        self._records = records
        self._prefetch = prefetch
        self._counters = counters
        self._max_value = max_value
        self._carved = carved
        self._no_space_hint = NoSpaceHint(calls)

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        blocks: Sequence[EngineBlock | None] | None = None,
    ) -> list[PutOutcome]:
        """``Store.batched_put``."""
        check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"{len(values)} values for {len(keys)} keys")
        by_key = described(keys, blocks)
        if not keys:
            return []
        pieces = [value_pieces(v) for v in values]
        lengths = [sum(p.nbytes for p in value) for value in pieces]
        for i, length in enumerate(lengths):
            if length > self._max_value:
                raise ValueTooLargeError(
                    f"value {i} has {length} bytes; this store takes at most "
                    f"{self._max_value} (option max_value)"
                )
        self._prefetch.drop(keys)
        self._counters.add("puts")
        outcomes = self._rounds(keys, pieces, lengths, by_key)
        # The controller lets one client hold only so much reserved at once: a put larger
        # than that gets NO_SPACE for what did not fit while the rest was stored. What was
        # stored is published now, its reservation released: store the rest in further
        # passes, for as long as each pass stores something (a store that is really full
        # stores nothing, and the keys stay NO_SPACE).
        progress = PutOutcome.STORED in outcomes
        while progress:
            left = [i for i, o in enumerate(outcomes) if o is PutOutcome.NO_SPACE]
            if not left:
                break
            again = self._rounds(
                [keys[i] for i in left],
                [pieces[i] for i in left],
                [lengths[i] for i in left],
                by_key,
            )
            progress = PutOutcome.STORED in again
            # Counted once, as what they finally are: the pass counted the ones still left.
            self._counters.add("no_space", -len(left))
            for i, outcome in zip(left, again, strict=True):
                outcomes[i] = outcome
        if not progress and PutOutcome.NO_SPACE in outcomes:
            self._no_space_hint.after_no_space()
        return outcomes

    def _rounds(
        self,
        keys: Sequence[bytes],
        pieces: Sequence[list[memoryview]],
        lengths: Sequence[int],
        blocks: Blocks,
    ) -> list[PutOutcome]:
        if len(keys) <= PUT_ROUND_KEYS:
            return self._put_round(keys, pieces, lengths, blocks)
        outcomes: list[PutOutcome] = []
        for start in range(0, len(keys), PUT_ROUND_KEYS):
            end = start + PUT_ROUND_KEYS
            outcomes += self._put_round(
                keys[start:end], pieces[start:end], lengths[start:end], blocks
            )
        return outcomes

    def _put_round(
        self,
        keys: Sequence[bytes],
        pieces: Sequence[list[memoryview]],
        lengths: Sequence[int],
        blocks: Blocks,
    ) -> list[PutOutcome]:
        if self._carved is not None:
            carved = self._carved.put(keys, pieces, lengths, blocks)
            if carved is not None:
                return carved
        return self._put_allocated(keys, pieces, lengths, blocks)

    def delete(self, keys: Sequence[bytes]) -> int:
        """``Store.delete``."""
        check_keys(keys)
        self._prefetch.drop(keys)
        if not keys:
            return 0
        self._counters.add("deletes")
        removed = self._calls.ask(self._index.unpublish, keys)
        if removed is None:
            self._counters.add("delete_failures")
            return 0
        return removed

    def _put_allocated(
        self,
        keys: Sequence[bytes],
        pieces: Sequence[list[memoryview]],
        lengths: Sequence[int],
        blocks: Blocks,
    ) -> list[PutOutcome]:
        """The put where the index places each key: allocate, write, publish."""
        requests = [AllocationRequest(key=k, length=n) for k, n in zip(keys, lengths, strict=True)]
        asked_at = time.monotonic()
        result = self._calls.ask(self._index.allocate, requests)
        if result is None:
            self._counters.add("put_failures", len(keys))
            return [PutOutcome.FAILED] * len(keys)
        # Each entry evicted to make room is a bucket of the image rewritten (emptied).
        self._topology.expect_image_rewrites(result.evictions)
        outcomes: list[PutOutcome] = []
        # Every copy to write, as (key position, grant): a key's first copy first, then
        # its replicas; for a stored key, the copies granted to repair it.
        granted: list[tuple[int, Descriptor]] = []
        for i, alloc in enumerate(result.allocations):
            if alloc.kind is AllocationKind.GRANTED and alloc.descriptor is not None:
                granted.append((i, alloc.descriptor))
                outcomes.append(PutOutcome.STORED)
            else:
                outcomes.append(_OUTCOME_OF[alloc.kind])
            granted += [(i, d) for d in alloc.replicas]
        written: list[tuple[int, Descriptor]] = []
        unknown: list[tuple[int, Descriptor]] = []
        published: set[int] = set()
        if granted and result.lease and time.monotonic() - asked_at > result.lease * _LEASE_SHARE:
            # This writer was held up (paused, swapped out) for much of its lease: a slot
            # whose lease ran out may already hold another key's record, so do not write.
            self._counters.add("late_writes_avoided", len(granted))
            failed = list(granted)
        else:
            written, failed, unknown, published = self._write(granted, pieces, blocks)
        failed_keys = {
            i for i, _ in granted if outcomes[i] is PutOutcome.STORED and i not in published
        }
        for i in failed_keys:
            outcomes[i] = PutOutcome.FAILED
        # A copy that did not land is dropped by the publish of its key's other copies;
        # grants of keys with no copy published are given back.
        giving_back = [d for i, d in failed if i not in published]
        if giving_back:
            self._calls.ask(self._index.abort, [GrantRef.of(d) for d in giving_back])
        if unknown and time.monotonic() - asked_at < result.lease * _WIPE_SHARE:
            # Not known to be published, and the slots are still this writer's: no scan of
            # the node may find these records and bring them back as stored.
            wiped = self._records.wipe([d for i, d in unknown if i not in published])
            self._counters.add("records_wiped", wiped)
        new_keys = {i for i, _ in written if result.allocations[i].kind is AllocationKind.GRANTED}
        self._counters.update(
            evictions=result.evictions,
            stored=sum(o is PutOutcome.STORED for o in outcomes),
            payload_bytes_written=sum(d.length for _, d in written),
            dedup_hits=sum(o is PutOutcome.DEDUPLICATED for o in outcomes),
            in_flight_skips=sum(o is PutOutcome.IN_FLIGHT for o in outcomes),
            no_space=sum(o is PutOutcome.NO_SPACE for o in outcomes),
            put_failures=len(failed_keys),
            replica_writes=len(written) - len(new_keys),
            replica_repairs=sum(1 for i, _ in written if i not in new_keys),
        )
        return outcomes

    def _write(
        self, granted: list[Copy], pieces: Sequence[list[memoryview]], blocks: Blocks
    ) -> _Written:
        """Write the granted copies and publish those that landed: returns the copies
        written, the copies not published (write or publish failed), those whose publish
        the index could not tell of (held still: their records may be wiped) and the
        positions of the keys with a copy published."""
        if not granted:
            return [], [], [], set()
        self._topology.learn({d.node for _, d in granted})
        report = self._records.write([d for _, d in granted], [pieces[i] for i, _ in granted])
        self._counters.update(
            transport_failures=report.failed_nodes,
            backoff_skips=report.skipped,
            nodes_backed_off=report.backed_off,
        )
        if report.failed_nodes or any(crc is None for crc in report.crcs):
            self._topology.relearn_after_failure()
        written = [(g, crc) for g, crc in zip(granted, report.crcs, strict=True) if crc is not None]
        failed = [g for g, crc in zip(granted, report.crcs, strict=True) if crc is None]
        published: set[int] = set()
        unknown: list[Copy] = []
        if written:
            grants = [GrantRef.of(d, crc) for (_, d), crc in written]
            mine = blocks_for([g.key for g in grants], blocks) if blocks else None
            told = (
                self._calls.publish(self._index.publish_described, grants, mine)
                if mine
                else self._calls.publish(self._index.publish, grants)
            )
            flags = told.values if told is not None else [False] * len(written)
            # Each copy published is one bucket of the image rewritten (its key's or an
            # alternate key's).
            self._topology.expect_image_rewrites(flags.count(True))
            for (g, _), flag in zip(written, flags, strict=True):
                if flag:
                    published.add(g[0])
                elif flag is None and told is not None and told.held:
                    unknown.append(g)
                elif flag is not None:
                    failed.append(g)
        return [g for g, _ in written], failed, unknown, published
