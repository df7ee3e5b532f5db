"""Reads: descriptors in, validated values out, every failure a miss.

A read takes its descriptors from the prefetch cache and resolves only the keys missing
there (one index call for all of them), then hands them to the record I/O layer, which lands
and validates each record. A prefetched descriptor is only a shortcut: when every copy it led
to failed validation the key may have moved, so those keys are resolved once more and read
again if their version changed. Where the index keeps values on several nodes, a record
whose node failed or which did not validate is read again from the key's next copy in the
same call (a round of record I/O for those records only, no control call; a descriptor from
the lookup image finds its other copies in the image). Records the index still publishes
that failed validation are reported to it (one call, only then), so no key stays present
but unreadable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvfabric._client.image_reader import ImageReader
from kvfabric._client.index_calls import IndexCalls
from kvfabric._client.key_checks import check_keys
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._client.record_io import RecordIO
from kvfabric._client.topology import Topology
from kvfabric._runtime.image import ImageStop, alternate_key
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import GrantRef

__all__ = ["Reads"]

# Rounds a read may take through a key's copies (the first copy, then the others).
_MAX_COPY_ROUNDS = 16


class Reads:
    """One store's reads; thread-safe."""

    def __init__(
        self,
        *,
        calls: IndexCalls,
        topology: Topology,
        records: RecordIO,
        prefetch: PrefetchCache,
        counters: Counters,
    ) -> None:
        self._calls = calls
        self._index = calls.index
        self._topology = topology
        self._records = records
        self._prefetch = prefetch
        self._counters = counters

    def get(self, keys: Sequence[bytes], into: Sequence[Any] | None) -> list[memoryview | None]:
        """``Store.batched_get``."""
        check_keys(keys)
        if into is not None and len(into) != len(keys):
            raise ValueError(f"into has {len(into)} buffers for {len(keys)} keys")
        if not keys:
            return []
        descriptors, alternates = self._prefetch.take_copies(keys)
        prefetched = [d is not None for d in descriptors]
        self._counters.update(gets=1, prefetch_hits=sum(prefetched))
        missing = [i for i, d in enumerate(descriptors) if d is None]
        unresolved = 0
        if missing:
            found = self._calls.ask(self._index.resolve_copies, [keys[i] for i in missing])
            if found is None:
                unresolved = len(missing)  # the index could not say: failures, not misses
            else:
                for j, i in enumerate(missing):
                    descriptors[i] = found.descriptors[j]
                    if j in found.alternates:
                        alternates[i] = found.alternates[j]
        located = len(descriptors) - descriptors.count(None)
        results, invalid = self._read_copies(keys, descriptors, alternates, into)
        # Records the index still publishes that failed validation: torn, or overwritten by
        # a writer that outlived its lease. Reported, so the index unpublishes them (that
        # copy only) and the next put of the key stores it again (no key stays present but
        # unreadable). Reporting a stale copy is harmless: the index drops only the version
        # it still publishes.
        retry = [i for i in invalid if results[i] is None and prefetched[i]]
        broken = [d for i, copies in invalid.items() if i not in retry for d in copies]
        # A prefetched descriptor is only a shortcut: if every copy it led to was invalid,
        # the key may have moved, so ask the index once more for those keys.
        if retry:
            self._prefetch.drop(keys[i] for i in retry)
            again: list[Descriptor | None] = [None] * len(keys)
            again_alternates: dict[int, tuple[Descriptor, ...]] = {}
            found = self._calls.resolve_copies([keys[i] for i in retry])
            for j, i in enumerate(retry):
                first = found.descriptors[j]
                if first is None:
                    continue
                tried = {d.version for d in invalid[i]}
                copies = (first, *found.alternates.get(j, ()))
                broken += [d for d in copies if d.version in tried]
                fresh = [d for d in copies if d.version not in tried]
                if fresh:
                    again[i], again_alternates[i] = fresh[0], tuple(fresh[1:])
            if any(d is not None for d in again):
                second, still_invalid = self._read_copies(keys, again, again_alternates, into)
                for i, value in enumerate(second):
                    if value is not None:
                        results[i] = value
                broken += [d for copies in still_invalid.values() for d in copies]
        self._report_invalid(broken)
        hits = len(results) - results.count(None)
        # A miss is a key the index does not hold; a failure one it holds (or could not
        # say about) whose read did not land a valid record.
        self._counters.update(
            get_hits=hits, get_misses=len(keys) - hits, get_failures=located - hits + unresolved
        )
        return results

    def get_scattered(self, keys: Sequence[bytes], into: Sequence[Sequence[Any]]) -> list[bool]:
        """``Store.batched_get_scattered``."""
        if len(into) != len(keys):
            raise ValueError(f"into has {len(into)} buffer lists for {len(keys)} keys")
        return [r is not None for r in self.get(keys, [list(b) for b in into])]

    def _read_copies(
        self,
        keys: Sequence[bytes],
        descriptors: Sequence[Descriptor | None],
        alternates: Mapping[int, tuple[Descriptor, ...]],
        into: Sequence[Any] | None,
    ) -> tuple[list[memoryview | None], dict[int, list[Descriptor]]]:
        """Read each key's copy in ``descriptors``; records that did not land (their node
        failed or refused them) or did not validate are read again from the key's next
        copy, a round for all of them, until each has landed or has no copy left.

        The next copies come from ``alternates`` (what the lookup returned) or, for a key
        it has none for, from the lookup image (its n-th copy filed under
        :func:`alternate_key`, probed in round n). Returns the values, and by key position
        the copies that failed validation.
        """
        results, invalid, unreachable = self._read(keys, descriptors, into)
        bad: dict[int, list[Descriptor]] = {}
        for i in invalid:
            bad.setdefault(i, []).append(descriptors[i])  # type: ignore[arg-type]
        failed = invalid + unreachable
        if not failed:
            return results, bad
        queues = {i: list(alternates.get(i, ())) for i in failed}
        from_image = {i for i in failed if i not in alternates}
        for n in range(1, _MAX_COPY_ROUNDS):
            asking = [i for i in failed if i in from_image]
            image = self._topology.image_in_use
            if asking and image is not None:
                for i, d in self._image_copies(image, keys, asking, n).items():
                    queues[i].append(d)
            following: list[Descriptor | None] = [None] * len(keys)
            for i in failed:
                if queues[i]:
                    following[i] = queues[i].pop(0)
            tried = [i for i in failed if following[i] is not None]
            if not tried:
                break
            values, invalid, unreachable = self._read(keys, following, into, relearn=False)
            landed = 0
            for i in tried:
                if values[i] is not None:
                    results[i] = values[i]
                    landed += 1
            for i in invalid:
                bad.setdefault(i, []).append(following[i])  # type: ignore[arg-type]
            self._counters.update(replica_reads=len(tried), replica_hits=landed)
            failed = invalid + unreachable
        return results, bad

    def _image_copies(
        self, image: ImageReader, keys: Sequence[bytes], positions: Sequence[int], n: int
    ) -> dict[int, Descriptor]:
        """The n-th other copy of each key at ``positions``, where the lookup image has one
        (filed under :func:`alternate_key`), as descriptors of the key itself."""
        probe = [alternate_key(keys[i], n) for i in positions]
        trips = 0
        if len(probe) > 1:
            # Which have one, then their descriptors in one run (a prefix probe stops at
            # the first key without one).
            states, trips = image.exists(probe)
            positions = [
                i for i, state in zip(positions, states, strict=True) if state == ImageStop.HIT
            ]
            probe = [alternate_key(keys[i], n) for i in positions]
        hits, _, wires, more = image.prefix(probe) if probe else (0, 0, b"", 0)
        self._counters.add("image_round_trips", trips + more)
        return {
            positions[j]: attrs.evolve(
                Descriptor.from_bytes(wires, j * DESCRIPTOR_SIZE), key=keys[positions[j]]
            )
            for j in range(hits)
        }

    def _read(
        self,
        keys: Sequence[bytes],
        descriptors: Sequence[Descriptor | None],
        into: Sequence[Any] | None,
        *,
        relearn: bool = True,
    ) -> tuple[list[memoryview | None], list[int], list[int]]:
        """Read and validate; returns the values, the indices that failed validation and
        those whose node failed or refused them. ``relearn=False``: ask the index for the
        nodes only if one is not known at all (a read falling over to another copy right
        after a node failed must not cost a control call)."""
        nodes = {d.node for d in descriptors if d is not None}
        if relearn:
            self._topology.learn(nodes)
        else:
            self._topology.learn_unknown(nodes)
        report = self._records.read(keys, descriptors, into)
        self._counters.update(
            payload_bytes_read=report.payload_bytes,
            validation_failures=len(report.invalid),
            transport_failures=report.failed_nodes,
            refused_reads=report.refused,
            backoff_skips=report.skipped,
            nodes_backed_off=report.backed_off,
        )
        if report.failed_nodes or report.refused:
            self._topology.relearn_after_failure()
        return report.values, report.invalid, report.unreachable

    def _report_invalid(self, descriptors: Sequence[Descriptor]) -> None:
        """Tell the index which published records failed validation (one call, rare)."""
        if not descriptors:
            return
        self._counters.add("invalid_reported", len(descriptors))
        self._calls.ask(self._index.drop_invalid, [GrantRef.of(d) for d in descriptors])
