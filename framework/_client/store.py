"""The client: ``Store``, the synchronous, thread-safe face of kvfabric.

``Store`` owns keys, the prefetch cache, the index round trips (each one counted) and the
outcomes callers see; moving and validating record bytes is the record I/O layer's job
(:mod:`~kvfabric._client.record_io`), which the store calls and which never calls back.

Lookups cost one index call and fill the prefetch cache; reads take descriptors from it,
resolve only what is missing (one call for all of them), and hand them to the record I/O
layer. Writes cost one ``allocate`` call and one ``publish`` call per batch, and a key that
is already stored moves no bytes.

Where the index publishes a lookup image (:mod:`kvfabric._runtime.image`), lookups read it
instead of asking: probed in place on the controller's host, one data-plane round trip
elsewhere (:mod:`~kvfabric._client.image_reader`). Only keys the image cannot answer for —
a torn bucket, a key that found no room in it, an image that cannot be read — go to the
index, in one call. Those lookups are counted apart from control RPCs (``onesided_lookups``,
``image_fallbacks``, ``image_round_trips``), and their hits are reported to the index in
the background (:mod:`~kvfabric._client.touches`) so its eviction still sees them. Stale
hits are harmless: the read validates every record, and re-resolves by RPC.

Where the index keeps values on several nodes (``replicas``), lookups return every copy and
the prefetch cache keeps them; a read whose node failed or whose record did not validate is
read again from the key's next copy in the same call (a second round of record I/O for
those records only, no control call; a descriptor from the lookup image finds its other
copies in the image). A put writes every copy it was granted and publishes those that
landed.

The read contract: ``batched_contains``, ``batched_exists``, ``batched_get``,
``batched_get_scattered`` and ``locate`` never raise because a controller, a data node or a
transport failed (unreachable, an error reply, a malformed reply, a timeout): they count the
failure in :meth:`Store.stats` and answer 0, False, None — a miss, never a wrong value.
``batched_put`` reports such failures as ``PutOutcome.FAILED`` and ``delete`` as 0. Only
programming errors raise: a bad key, ``into`` of the wrong length or a read-only buffer, a
value larger than ``max_value``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import attrs

from kvfabric._client.counter_names import CLIENT_COUNTERS
from kvfabric._client.extents import EXTENT_BYTES, Carving, ExtentPool, stripes
from kvfabric._client.image_reader import ImageReader, ImageSlot
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._client.record_io import RecordIO, value_pieces
from kvfabric._client.touches import TouchReporter
from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginManager
from kvfabric._runtime.image import ImageStop, alternate_key, first_bad_key
from kvfabric._runtime.record import record_size
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.errors import (
    ControllerUnavailableError,
    InvalidKeyError,
    ProtocolError,
    RemoteError,
    ValueTooLargeError,
)
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import (
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    GrantRef,
    Index,
    IndexPlugin,
)
from kvfabric.urls import ClientOptions

__all__ = ["PutOutcome", "Store"]

log = logging.getLogger("kvfabric")
T = TypeVar("T")


class PutOutcome(enum.Enum):
    STORED = "stored"
    DEDUPLICATED = "deduplicated"
    """Already stored (by anyone): no bytes moved."""
    IN_FLIGHT = "in_flight"
    """Another writer is storing it right now: skipped."""
    NO_SPACE = "no_space"
    FAILED = "failed"
    """The write or the controller failed; nothing was published."""


# A writer that used more than this share of its lease before writing gives the grants up.
_LEASE_SHARE = 0.5
# After a transport failure, nodes are relearned at most this often.
_RELEARN_INTERVAL = 1.0

# Lookups answered from the lookup image, counted apart from control RPCs.
# An image that cannot be read may have moved (its server, in a process of its own,
# restarted at another address): where it is is asked again, at most once a second, then
# less often while it stays out of reach.
_IMAGE_RECHECK_MIN = 1.0
_IMAGE_RECHECK_MAX = 30.0
_IMAGE_COUNTERS = (
    "onesided_lookups",
    "image_fallbacks",
    "image_round_trips",
    "image_unavailable",
    "touch_rpcs",
    "touch_failures",
    "touches_dropped",
)

# Values kept on several nodes: copies written beyond each key's first (repairs of a stored
# key's lost copies among them), and reads that fell over to another copy.
_REPLICA_COUNTERS = (
    "replica_writes",
    "replica_repairs",
    "replica_reads",
    "replica_hits",
)
# Rounds a read may take through a key's copies (the first copy, then the others).
_MAX_COPY_ROUNDS = 16

_OUTCOME_OF = {
    AllocationKind.EXISTS: PutOutcome.DEDUPLICATED,
    AllocationKind.IN_FLIGHT: PutOutcome.IN_FLIGHT,
    AllocationKind.NO_SPACE: PutOutcome.NO_SPACE,
}
_CARVED_OUTCOME = {
    CarveOutcome.STORED: PutOutcome.STORED,
    CarveOutcome.EXISTS: PutOutcome.DEDUPLICATED,
    CarveOutcome.IN_FLIGHT: PutOutcome.IN_FLIGHT,
    CarveOutcome.REFUSED: PutOutcome.FAILED,
}
# Puts into extents leased from the index: leases, and records written into them.
_EXTENT_COUNTERS = ("extent_leases", "carved_writes")


class Store:
    """A connection to a kvfabric store; create it with :func:`kvfabric.connect`."""

    def __init__(
        self,
        *,
        index: Index,
        records: RecordIO,
        options: ClientOptions,
        plugins: PluginManager,
        on_close: Sequence[Callable[[], None]] = (),
        local_node: DataNode | None = None,
        local_index: IndexPlugin | None = None,
        image: ImageReader | None = None,
        locate_image: Callable[[], tuple[ImageReader | None, bool]] | None = None,
    ) -> None:
        """``local_node``, ``local_index``: the data node and the index running in this
        process (embedded mode), if any.
        ``image``: a reader of the index's lookup image; ``locate_image``: asks the
        controller where its image is (one control RPC; a reader or None, and whether one
        this client could read failed to open, so is worth asking again later), whenever
        this client learns the nodes and has no image from this controller yet.
        """
        self.local_node = local_node
        self.local_index = local_index
        self._index = index
        self._records = records
        self._options = options
        self._plugins = plugins
        self._on_close = list(on_close)
        self._prefetch = PrefetchCache(
            max_entries=options.prefetch_entries, ttl=options.prefetch_ttl
        )
        self._counters = Counters(
            (*CLIENT_COUNTERS, *_IMAGE_COUNTERS, *_REPLICA_COUNTERS, *_EXTENT_COUNTERS)
        )
        self._extents = ExtentPool() if options.extents else None
        self._image = ImageSlot(image)
        self._locate_image = locate_image
        self._image_unlocated = locate_image is not None
        self._relocate_due = False
        self._image_rechecked_at = 0.0
        self._image_recheck_interval = _IMAGE_RECHECK_MIN
        self._image_unreachable = False
        """The controller serves an image this client could not open (yet)."""
        self._touches = TouchReporter(index.touch, self._counters)
        self._observer_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._membership_stale = True
        self._relearned_at = 0.0
        self._learned_nodes: frozenset[tuple[int, int]] | None = None
        # A controller that is down now is not an error: reads miss until it is back.
        self._refresh_membership()

    @property
    def learned_nodes(self) -> frozenset[tuple[int, int]] | None:
        """(id, incarnation) of the nodes this store last learned from its index; None
        before it learned any (the index was unreachable)."""
        return self._learned_nodes

    @property
    def records(self) -> RecordIO:
        """The record I/O layer this store reads and writes through.

        For tools and tests: ``records.read_slot`` / ``records.write_slot`` move raw bytes
        of one record's slot (e.g. to corrupt it), ``records.transport_of(node)`` names the
        transport used for a node.
        """
        return self._records

    # -- lookups -----------------------------------------------------------------------

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored; their descriptors are kept for the read.

        Answered from the lookup image when this client reads one (``onesided_lookups``);
        from the index, in one call, for the keys the image cannot answer for. The list of
        keys is kept for the read, not copied: changing it afterwards can only cost that
        read its kept descriptors (each is checked against the key read).
        """
        image = self._image_reader()
        if image is not None and keys:
            return self._contains_from_image(image, keys)
        _check_keys(keys)
        if not keys:
            return 0
        copies = self._ask(self._index.lookup_copies, keys)
        if copies is None:
            return 0
        found = self._remember(keys, copies)
        self._counters.update(lookups=1, prefix_hits=found)
        self._observe(keys, found)
        return found

    def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (for engines that probe non-contiguous keys).

        From the lookup image where this client reads one; the keys it cannot answer for
        go to the index in one call.
        """
        image = self._image_reader()
        if image is not None and keys:
            return self._exists_from_image(image, keys)
        _check_keys(keys)
        if not keys:
            return []
        self._counters.add("exists_calls")
        flags = self._ask(self._index.exists, keys)
        return [False] * len(keys) if flags is None else flags

    def _contains_from_image(self, image: ImageReader, keys: Sequence[bytes]) -> int:
        try:
            hits, stop, wires, trips = image.prefix(keys)
        except TypeError:
            _check_keys(keys)  # raises the error that says what a key must be
            raise
        if hits:
            # The caller's own sequence when every key hit: copying 1,024 keys would cost a
            # fifth of the lookup. The cache checks each descriptor's key when a read takes
            # it and the use report skips what is not a key, so a caller that changes its
            # list afterwards costs itself a cache miss, never a wrong read.
            used = keys if hits == len(keys) else keys[:hits]
            self._prefetch.remember_wires(used, wires)
            self._touches.add(used)
        if stop == ImageStop.HIT or stop == ImageStop.MISS:
            self._counters.update(
                lookups=1,
                prefix_hits=hits,
                onesided_lookups=1,
                image_round_trips=trips,
            )
            self._observe(keys, hits)
            return hits
        # From keys[hits] on the image cannot tell (a torn bucket, a key that found no room
        # in it, an image it cannot read now): the index answers for the rest.
        if stop == ImageStop.UNUSABLE:
            self._recheck_image()
        copies = self._ask(self._index.lookup_copies, keys[hits:])
        total = hits + (self._remember(keys[hits:], copies) if copies is not None else 0)
        self._counters.update(
            lookups=1,
            prefix_hits=total,
            image_fallbacks=1,
            image_unavailable=int(stop == ImageStop.UNUSABLE),
            image_round_trips=trips,
        )
        self._observe(keys, total)
        return total

    def _remember(self, keys: Sequence[bytes], copies: Copies) -> int:
        """Keep a lookup's leading run of hits on ``keys`` (and their other copies); how
        many."""
        descriptors = copies.descriptors
        if isinstance(descriptors, PackedDescriptors):
            # Kept in wire form, as a lookup from the image keeps them: a read decodes
            # what it takes, and the cache checks each one's key against the key asked.
            found = min(len(descriptors), len(keys))
            self._prefetch.remember_wires(keys[:found], descriptors.wires, copies.alternates)
            return found
        hits = [d for d in descriptors if d is not None]
        self._prefetch.remember(hits, copies.alternates)
        return len(hits)

    def _exists_from_image(self, image: ImageReader, keys: Sequence[bytes]) -> list[bool]:
        try:
            states, trips = image.exists(keys)
        except TypeError:
            _check_keys(keys)
            raise
        self._counters.update(exists_calls=1, image_round_trips=trips)
        found = [state == ImageStop.HIT for state in states]
        if ImageStop.UNKNOWN not in states:
            self._counters.add("onesided_lookups")
            return found
        unknown = [i for i, state in enumerate(states) if state == ImageStop.UNKNOWN]
        self._counters.add("image_fallbacks")
        flags = self._ask(self._index.exists, [keys[i] for i in unknown])
        if flags is not None:
            for i, flag in zip(unknown, flags, strict=True):
                found[i] = flag
        return found

    def _recheck_image(self) -> None:
        """Ask where the image is before the next lookup: one that cannot be read may have
        moved. Until the controller answers, the reader stays."""
        now = time.monotonic()
        if self._locate_image is None or now - self._image_rechecked_at < (
            self._image_recheck_interval
        ):
            return
        self._image_rechecked_at = now
        self._image_unlocated = True
        self._relocate_due = True

    def _image_reader(self) -> ImageReader | None:
        if self._relocate_due:
            # A restarted controller serves another image (if any), or the image's server
            # moved: learn where, once.
            self._relocate_due = False
            self._refresh_membership()
        reader = self._image.reader
        if reader is None and self._image_unreachable:
            self._recheck_image()
        return reader

    def locate(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Where each key's record lives, asked of the index now (one control round trip).

        ``None`` for a key that is not stored, and for every key when the controller cannot
        answer (counted, never raised). Neither uses nor fills the prefetch cache.
        """
        _check_keys(keys)
        if not keys:
            return []
        return self._resolve(keys)

    def prefetched(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """The descriptors the last lookups left for ``keys`` (no round trip).

        For engines whose lookup and load run in different processes (vLLM's scheduler and
        workers): ship these with the load request and hand them to :meth:`remember` there,
        and the load needs no round trip either.
        """
        _check_keys(keys)
        return self._prefetch.take(keys)

    def remember(self, descriptors: Sequence[Descriptor]) -> None:
        """Keep descriptors another client resolved, for the reads that follow.

        Only a shortcut, like every prefetched descriptor: reads still validate each
        record, and one that no longer matches is resolved again.
        """
        self._prefetch.remember(descriptors)

    # -- reads -------------------------------------------------------------------------

    def batched_get(
        self, keys: Sequence[bytes], into: Sequence[Any] | None = None
    ) -> list[memoryview | None]:
        """Read each key's value; ``None`` for a miss (absent, unreachable or invalid).

        ``into``: one writable buffer per key, filled in place (zero copies); the result is
        then a view of the buffer's first ``length`` bytes. A buffer too small is a miss.
        Without ``into`` the values are views into one new buffer per call. (An ``into``
        entry may also be a list of buffers filled in order; see
        :meth:`batched_get_scattered`.)
        """
        _check_keys(keys)
        if into is not None and len(into) != len(keys):
            raise ValueError(f"into has {len(into)} buffers for {len(keys)} keys")
        if not keys:
            return []
        descriptors, alternates = self._prefetch.take_copies(keys)
        prefetched = [d is not None for d in descriptors]
        self._counters.update(gets=1, prefetch_hits=sum(prefetched))
        missing = [i for i, d in enumerate(descriptors) if d is None]
        if missing:
            found = self._resolve_copies([keys[i] for i in missing])
            for j, i in enumerate(missing):
                descriptors[i] = found.descriptors[j]
                if j in found.alternates:
                    alternates[i] = found.alternates[j]
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
            found = self._resolve_copies([keys[i] for i in retry])
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
        hits = sum(r is not None for r in results)
        self._counters.update(get_hits=hits, get_misses=len(keys) - hits)
        return results

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
            image = self._image.reader
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

    def batched_get_scattered(
        self, keys: Sequence[bytes], into: Sequence[Sequence[Any]]
    ) -> list[bool]:
        """Read each key's value straight into several buffers, filled in order.

        For a value whose natural home is not contiguous (an engine's per-layer pages of one
        block): no staging copy, the transport lands each piece where it belongs and the
        checksum runs over the pieces. True where the value landed and validated; on False
        the buffers may hold garbage (treat as a miss).
        """
        if len(into) != len(keys):
            raise ValueError(f"into has {len(into)} buffer lists for {len(keys)} keys")
        return [r is not None for r in self.batched_get(keys, into=[list(b) for b in into])]

    # -- writes ------------------------------------------------------------------------

    def batched_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[PutOutcome]:
        """Store values under keys: the writes and one publish call, after one allocate
        call where the index places each key (where it leases extents and this client reads
        its lookup image, the records go into an extent this client holds instead).

        A value is a buffer, or a list of buffers whose concatenation is the value (gathered
        from where they lie, no copy; the buffers must not change until this returns). A key
        already stored moves no bytes (``DEDUPLICATED``), unless another writer stored it
        while this one wrote; a controller or data-node failure makes ``FAILED`` outcomes,
        counted. Raises :class:`ValueTooLargeError` before doing anything if a value exceeds
        ``max_value``.
        """
        _check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"{len(values)} values for {len(keys)} keys")
        if not keys:
            return []
        pieces = [value_pieces(v) for v in values]
        lengths = [sum(p.nbytes for p in value) for value in pieces]
        for i, length in enumerate(lengths):
            if length > self._options.max_value:
                raise ValueTooLargeError(
                    f"value {i} has {length} bytes; this store takes at most "
                    f"{self._options.max_value} (option max_value)"
                )
        self._prefetch.drop(keys)
        self._counters.add("puts")
        if self._extents is not None:
            carved = self._put_carved(self._extents, keys, pieces, lengths)
            if carved is not None:
                return carved
        requests = [AllocationRequest(key=k, length=n) for k, n in zip(keys, lengths, strict=True)]
        asked_at = time.monotonic()
        result = self._ask(self._index.allocate, requests)
        if result is None:
            self._counters.add("put_failures", len(keys))
            return [PutOutcome.FAILED] * len(keys)
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
        published: set[int] = set()
        if granted and result.lease and time.monotonic() - asked_at > result.lease * _LEASE_SHARE:
            # This writer was held up (paused, swapped out) for much of its lease: a slot
            # whose lease ran out may already hold another key's record, so do not write.
            self._counters.add("late_writes_avoided", len(granted))
            failed = list(granted)
        else:
            written, failed, published = self._write(granted, pieces)
        failed_keys = {
            i for i, _ in granted if outcomes[i] is PutOutcome.STORED and i not in published
        }
        for i in failed_keys:
            outcomes[i] = PutOutcome.FAILED
        # A copy that did not land is dropped by the publish of its key's other copies;
        # grants of keys with no copy published are given back.
        giving_back = [d for i, d in failed if i not in published]
        if giving_back:
            self._ask(self._index.abort, [GrantRef.of(d) for d in giving_back])
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

    def _put_carved(
        self,
        pool: ExtentPool,
        keys: Sequence[bytes],
        pieces: Sequence[list[memoryview]],
        lengths: Sequence[int],
    ) -> list[PutOutcome] | None:
        """The put through extents: the lookup image says which keys are stored (those
        move no bytes), the others are laid into extents this client holds (one per node,
        spread as allocate would spread them), written, and published in one call. None
        when it cannot be done that way (no image, a key it cannot tell of, no extent to be
        had): the caller allocates per key."""
        image = self._image_reader()
        if image is None or not self._index.leases_extents():
            return None
        states, trips = image.exists(keys)
        self._counters.add("image_round_trips", trips)
        if ImageStop.UNKNOWN in states:
            return None
        fresh = [i for i, state in enumerate(states) if state != ImageStop.HIT]
        # Stored already: no bytes move, and the index hears of it with the publish (each
        # counts as stored once more, as an allocate finding it would count it).
        again = [key for key, state in zip(keys, states, strict=True) if state == ImageStop.HIT]
        outcomes = [PutOutcome.DEDUPLICATED] * len(keys)
        if not fresh:
            # Stored whether or not the index hears it now: the outcomes stand either way.
            self._ask(self._index.publish_carved, [], again)
        else:
            carvings = self._carve(
                pool,
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
                written = self._write_carved(pool, carvings, [pieces[i] for i in fresh], again)
            for i, outcome in zip(fresh, written, strict=True):
                outcomes[i] = outcome
        self._counters.update(
            stored=outcomes.count(PutOutcome.STORED),
            dedup_hits=outcomes.count(PutOutcome.DEDUPLICATED),
            in_flight_skips=outcomes.count(PutOutcome.IN_FLIGHT),
            put_failures=outcomes.count(PutOutcome.FAILED),
        )
        return outcomes

    def _carve(
        self, pool: ExtentPool, keys: list[bytes], lengths: list[int], generation: int
    ) -> list[Carving] | None:
        """Records for ``keys``, dealt over extents held on distinct nodes (leased now
        where the pool has none with the room), one extent per node known; ``generation``:
        the index's nodes generation, as its lookup image says now."""
        if self._membership_stale or pool.stale(generation):
            # A node joined, left or restarted: spread over the nodes there are now.
            self._refresh_membership()
        sizes = list(map(record_size, lengths))
        nodes = len(self._learned_nodes) if self._learned_nodes else 1
        dealt = stripes(len(keys), nodes)
        need = max(sum(sizes[i] for i in stripe) for stripe in dealt)
        held = pool.take(need, len(dealt), generation)
        if len(held) < len(dealt) and pool.may_lease():
            asked_at = time.monotonic()
            wanted = len(dealt) - len(held)
            extents = self._ask(
                self._index.lease_extents,
                need,
                max(4 * need, EXTENT_BYTES),
                wanted,
                [h.extent.node for h in held],
                pool.returning(),
            )
            leased = pool.leased(extents or [], asked_at, wanted)
            self._counters.update(
                extent_leases=len(leased), evictions=sum(h.extent.evictions for h in leased)
            )
            held += leased
        self._learn_nodes({h.extent.node for h in held})
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

    def _write_carved(
        self,
        pool: ExtentPool,
        carvings: list[Carving],
        pieces: Sequence[list[memoryview]],
        again: list[bytes],
    ) -> list[PutOutcome]:
        """Write the carved records (each node's in parallel) and publish those that landed,
        with ``again`` (the keys found stored), in one call; one outcome per record, in the
        order of ``pieces``."""
        descriptors = [d for carving in carvings for d in carving.descriptors]
        order = [i for carving in carvings for i in carving.positions]
        self._learn_nodes({carving.held.extent.node for carving in carvings})
        report = self._records.write(descriptors, [pieces[i] for i in order])
        self._counters.add("transport_failures", report.failed_nodes)
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
        results = self._ask(self._index.publish_carved, landed, again) if landed or again else []
        if report.failed_nodes or len(landed) < len(descriptors):
            self._relearn_after_failure()
        outcome_of = dict(
            zip(
                ((r.extent, r.offset) for r in landed),
                results if results is not None else [CarveOutcome.REFUSED] * len(landed),
                strict=True,
            )
        )
        outcomes = [PutOutcome.FAILED] * len(pieces)
        for carving in carvings:
            extent = carving.held.extent.id
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

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys at once (new lookups miss); returns how many were stored.

        0 when the controller could not be asked (counted as ``delete_failures``; the keys
        may then still be stored).
        """
        _check_keys(keys)
        self._prefetch.drop(keys)
        if not keys:
            return 0
        self._counters.add("deletes")
        removed = self._ask(self._index.unpublish, keys)
        if removed is None:
            self._counters.add("delete_failures")
            return 0
        return removed

    # -- the rest ----------------------------------------------------------------------

    def ping(self) -> bool:
        """Whether the controller answers (one control round trip; never raises).

        The answer also refreshes the data nodes this client knows, so a node that joined
        since is reachable through :attr:`records` afterwards.
        """
        return self._refresh_membership()

    def stats(self) -> dict[str, int]:
        """This client's counters (no round trip).

        Lookups answered from the lookup image are ``onesided_lookups`` (no control RPC;
        ``image_round_trips`` data-plane reads of it), those it could not fully answer
        ``image_fallbacks`` (one control RPC each, in ``control_rpcs``); ``touch_rpcs``
        counts the background use reports, which are not in ``control_rpcs``.
        """
        return self._counters.snapshot()

    def controller_restarted(self, epoch: int) -> None:
        """The controller came back with a new epoch: node ids and descriptors are stale."""
        log.warning("kvfabric controller restarted (epoch %x): relearning nodes", epoch)
        self._prefetch.clear()
        if self._extents is not None:
            self._extents.forget()
        self._membership_stale = True
        if self._locate_image is not None:
            # Its image, if any, is another one: stop reading the old one now.
            self._image.replace(None)
            self._image_unlocated = True
            self._relocate_due = True

    def membership_changed(self, generation: int) -> None:
        """A data node joined, left, restarted or was replaced: relearn before the next I/O."""
        log.info("kvfabric data nodes changed (generation %d): relearning them", generation)
        self._membership_stale = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._observer_pool = self._observer_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        held = self._extents.release_all() if self._extents is not None else []
        if held:
            # Their unused part goes back now rather than when their leases run out.
            self._ask(self._index.lease_extents, 0, 0, 0, (), held)
        self._touches.close()
        self._image.replace(None)
        self._records.close()
        for close in reversed(self._on_close):
            close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _ask(self, method: Callable[..., T], *args: Any) -> T | None:
        """One index call, counted; a failure of the index (a controller, or a shared index
        such as Redis) is counted, logged and gives None."""
        self._counters.add("control_rpcs")
        try:
            return method(*args)
        except ControllerUnavailableError as exc:
            self._counters.add("controller_unavailable")
            log.warning("kvfabric: index unavailable (%s): treating as a miss", exc)
        except (RemoteError, ProtocolError) as exc:
            self._counters.add("controller_errors")
            log.warning("kvfabric: index error (%s): treating as a miss", exc)
        return None

    def _resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        found = self._ask(self._index.resolve, keys)
        return [None] * len(keys) if found is None else found

    def _resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        found = self._ask(self._index.resolve_copies, keys)
        return Copies(descriptors=[None] * len(keys)) if found is None else found

    def _refresh_membership(self) -> bool:
        self._membership_stale = False
        nodes = self._ask(self._index.nodes)
        if nodes is None:
            self._membership_stale = True
            return False
        self._records.set_nodes(nodes)
        self._learned_nodes = frozenset((n.id, n.incarnation) for n in nodes)
        if self._image_unlocated:
            self._relocate_image()
        return True

    def _relocate_image(self) -> None:
        """Ask the controller where its lookup image is and open it (or learn it has none)."""
        assert self._locate_image is not None
        # The old reader goes first: both may use the same transport client's pseudo-node.
        self._image.replace(None)
        located = self._ask(self._locate_image)
        if located is None:
            return  # no answer: asked again the next time the nodes are learned
        reader, retry = located
        self._image_unlocated = False
        self._image.replace(reader)
        self._image_unreachable = retry
        if self._image_unreachable:
            # Asked again later, less often each time it stays out of reach.
            self._image_recheck_interval = min(2 * self._image_recheck_interval, _IMAGE_RECHECK_MAX)
        else:
            self._image_recheck_interval = _IMAGE_RECHECK_MIN

    def _report_invalid(self, descriptors: Sequence[Descriptor]) -> None:
        """Tell the index which published records failed validation (one call, rare)."""
        if not descriptors:
            return
        self._counters.add("invalid_reported", len(descriptors))
        self._ask(self._index.drop_invalid, [GrantRef.of(d) for d in descriptors])

    def _relearn_after_failure(self) -> None:
        """A node failed or refused us: its route may be stale (it restarted elsewhere).

        Relearn the nodes before the next I/O, at most once per ``retry_interval``-ish
        second, so a node that is simply down does not cost a round trip per call.
        """
        now = time.monotonic()
        if now - self._relearned_at >= _RELEARN_INTERVAL:
            self._relearned_at = now
            self._membership_stale = True

    def _learn_nodes(self, nodes: set[int]) -> None:
        """Make sure the record I/O layer knows ``nodes`` before they are read or written."""
        if not nodes or (not self._membership_stale and self._records.reaches(nodes)):
            return
        # A node joined after we connected, or the controller restarted: relearn.
        self._refresh_membership()

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
            self._learn_nodes(nodes)
        elif not self._records.reaches(nodes):
            self._refresh_membership()
        report = self._records.read(keys, descriptors, into)
        self._counters.update(
            payload_bytes_read=report.payload_bytes,
            validation_failures=len(report.invalid),
            transport_failures=report.failed_nodes,
            refused_reads=report.refused,
        )
        if report.failed_nodes or report.refused:
            self._relearn_after_failure()
        return report.values, report.invalid, report.unreachable

    def _write(
        self, granted: list[tuple[int, Descriptor]], pieces: Sequence[list[memoryview]]
    ) -> tuple[list[tuple[int, Descriptor]], list[tuple[int, Descriptor]], set[int]]:
        """Write the granted copies and publish those that landed: returns the copies
        written, the copies not published (write or publish failed) and the positions of
        the keys with a copy published."""
        if not granted:
            return [], [], set()
        self._learn_nodes({d.node for _, d in granted})
        report = self._records.write([d for _, d in granted], [pieces[i] for i, _ in granted])
        self._counters.add("transport_failures", report.failed_nodes)
        if report.failed_nodes or any(crc is None for crc in report.crcs):
            self._relearn_after_failure()
        written = [(g, crc) for g, crc in zip(granted, report.crcs, strict=True) if crc is not None]
        failed = [g for g, crc in zip(granted, report.crcs, strict=True) if crc is None]
        published: set[int] = set()
        if written:
            flags = self._ask(self._index.publish, [GrantRef.of(d, crc) for (_, d), crc in written])
            ok = flags if flags is not None else [False] * len(written)
            for (g, _), flag in zip(written, ok, strict=True):
                if flag:
                    published.add(g[0])
                else:
                    failed.append(g)
        return [g for g, _ in written], failed, published

    def _observe(self, keys: Sequence[bytes], hits: int) -> None:
        hook = self._plugins.pm.hook.kvfabric_lookup_done
        if not hook.get_hookimpls():
            return
        with self._lock:
            if self._closed:
                return
            if self._observer_pool is None:
                self._observer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-observe")
            self._observer_pool.submit(hook, keys=list(keys), hits=hits)


def _check_keys(keys: Sequence[bytes]) -> None:
    bad = first_bad_key(keys)
    if bad >= 0:
        key = keys[bad]
        raise InvalidKeyError(
            f"keys must be {KEY_SIZE}-byte bytes (see kvfabric.chain_key / fold_key), "
            f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
        )
