"""Lookups: which keys are stored, answered from the lookup image or by the index.

``batched_contains`` and ``batched_exists`` read the lookup image where this client has one
(probed in place on the controller's host, one data-plane round trip elsewhere); only keys
the image cannot answer for — a torn bucket, a key that found no room in it, an image that
cannot be read — go to the index, in one call. A lookup's leading run of hits goes into the
prefetch cache for the read that follows, as one batch (no work per key); hits from the
image are reported to the index in the background (:mod:`~kvfabric._client.touches`) so its
eviction still sees them. Stale hits are harmless: the read validates every record, and
re-resolves by RPC. Observers of ``kvfabric_lookup_done`` are called on a thread of their
own, off the lookup path.

While a data node is held off after failing (:mod:`~kvfabric._client.node_breaker`),
``batched_contains`` stops its prefix at the first key with no copy on a node in use (a key
whose first copy is on the node held off but whose next copy is elsewhere still counts), so
the engine recomputes those blocks rather than wait on the node; ``batched_exists`` says what
is stored, wherever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvfabric._client.image_reader import ImageReader
from kvfabric._client.index_calls import IndexCalls
from kvfabric._client.key_checks import check_keys
from kvfabric._client.node_breaker import NodeBreaker
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._client.topology import Topology
from kvfabric._client.touches import TouchReporter
from kvfabric._plugins import PluginManager
from kvfabric._runtime.image import ImageStop, alternate_key
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.descriptor import DESCRIPTOR_DTYPE, DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import Copies

__all__ = ["LookupObserver", "Lookups"]

log = logging.getLogger("kvfabric")


class LookupObserver:
    """Calls the ``kvfabric_lookup_done`` hook, where one is installed, on its own thread."""

    def __init__(self, plugins: PluginManager) -> None:
        self._plugins = plugins
        self._lock = threading.Lock()
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None

    def observe(self, keys: Sequence[bytes], hits: int) -> None:
        hook = self._plugins.pm.hook.kvfabric_lookup_done
        if not hook.get_hookimpls():
            return
        with self._lock:
            if self._closed:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-observe")
            self._pool.submit(hook, keys=list(keys), hits=hits)

    def close(self) -> None:
        """Wait for the calls queued; later lookups call no one."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class Lookups:
    """One store's lookups and its prefetch cache's inputs; thread-safe."""

    def __init__(
        self,
        *,
        calls: IndexCalls,
        topology: Topology,
        prefetch: PrefetchCache,
        counters: Counters,
        touches: TouchReporter,
        observer: LookupObserver,
        max_value: int,
        breaker: NodeBreaker,
    ) -> None:
        """``breaker``: the data nodes held off (the record I/O layer's)."""
        self._calls = calls
        self._index = calls.index
        self._topology = topology
        self._prefetch = prefetch
        self._counters = counters
        self._touches = touches
        self._observer = observer
        self._max_value = max_value
        self._breaker = breaker
        self._limited = LimitedLog(log)

    def contains(self, keys: Sequence[bytes]) -> int:
        """``Store.batched_contains``."""
        image = self._topology.image_reader()
        if image is not None and keys:
            return self._contains_from_image(image, keys)
        check_keys(keys)
        if not keys:
            return 0
        copies = self._calls.ask(self._index.lookup_copies, keys)
        if copies is None:
            self._counters.add("lookup_keys", len(keys))
            return 0
        found = self._remember(keys, copies)
        self._counters.update(lookups=1, lookup_keys=len(keys), prefix_hits=found)
        self._observer.observe(keys, found)
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """``Store.batched_exists``."""
        image = self._topology.image_reader()
        if image is not None and keys:
            return self._exists_from_image(image, keys)
        check_keys(keys)
        if not keys:
            return []
        flags = self._calls.ask(self._index.exists, keys)
        if flags is None:
            self._counters.update(exists_calls=1, exists_keys=len(keys))
            return [False] * len(keys)
        self._counters.update(exists_calls=1, exists_keys=len(keys), exists_hits=flags.count(True))
        return flags

    def locate(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """``Store.locate``: asked of the index now; the prefetch cache is left alone."""
        check_keys(keys)
        if not keys:
            return []
        return self._calls.resolve(keys)

    def prefetched(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """``Store.prefetched``."""
        check_keys(keys)
        return self._prefetch.take(keys)

    def remember(self, descriptors: Sequence[Descriptor]) -> None:
        """``Store.remember``: descriptors from another process are checked first.

        One longer than ``max_value`` cannot be a value this store reads (and a read would
        allocate that much): it is not kept, so its key is resolved by the index when
        read. Any other field a peer got wrong (an unknown node or region, an offset past
        the region) is refused by the read, a miss.
        """
        for d in descriptors:
            if not isinstance(d, Descriptor):
                raise TypeError(
                    "remember() takes Descriptor objects (from Store.prefetched(), or "
                    f"Descriptor.from_bytes), got {type(d).__name__}"
                )
        kept = [d for d in descriptors if d.length <= self._max_value]
        if len(kept) < len(descriptors):
            longest = max(d.length for d in descriptors)
            self._limited.warning(
                "too long",
                "kvfabric: remember() left out %d of %d descriptors longer than max_value "
                "(%d bytes; the longest says %d): their keys are resolved when read",
                len(descriptors) - len(kept),
                len(descriptors),
                self._max_value,
                longest,
            )
        self._prefetch.remember(kept)

    def _contains_from_image(self, image: ImageReader, keys: Sequence[bytes]) -> int:
        try:
            hits, stop, wires, trips = image.prefix(keys)
        except TypeError:
            check_keys(keys)  # raises the error that says what a key must be
            raise
        if hits and self._breaker.engaged:
            usable = self._usable_from_image(image, keys, hits, wires)
            if usable < hits:
                self._counters.add("backoff_misses", hits - usable)
                hits, stop, wires = usable, ImageStop.MISS, wires[: usable * DESCRIPTOR_SIZE]
        if hits:
            # The caller's own sequence when every key hit: a copy of the keys would be a
            # sizeable share of the lookup. The cache checks each descriptor's key when a
            # read takes it and the use report skips what is not a key, so a caller that
            # changes its list afterwards costs itself a cache miss, never a wrong read.
            used = keys if hits == len(keys) else keys[:hits]
            self._prefetch.remember_wires(used, wires)
            self._touches.add(used)
        if stop == ImageStop.HIT or stop == ImageStop.MISS:
            self._counters.update(
                lookups=1,
                lookup_keys=len(keys),
                prefix_hits=hits,
                onesided_lookups=1,
                image_round_trips=trips,
            )
            self._observer.observe(keys, hits)
            return hits
        # From keys[hits] on the image cannot tell (a torn bucket, a key that found no room
        # in it, an image it cannot read now): the index answers for the rest.
        if stop == ImageStop.UNUSABLE:
            self._topology.recheck_image()
        copies = self._calls.ask(self._index.lookup_copies, keys[hits:])
        total = hits + (self._remember(keys[hits:], copies) if copies is not None else 0)
        self._counters.update(
            lookups=1,
            lookup_keys=len(keys),
            prefix_hits=total,
            image_fallbacks=1,
            image_unavailable=int(stop == ImageStop.UNUSABLE),
            image_round_trips=trips,
        )
        self._observer.observe(keys, total)
        return total

    def _remember(self, keys: Sequence[bytes], copies: Copies) -> int:
        """Keep a lookup's leading run of hits on ``keys`` (and their other copies); how
        many."""
        descriptors = copies.descriptors
        if self._breaker.engaged:
            copies = self._usable_copies(copies)
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

    def _usable_from_image(
        self, image: ImageReader, keys: Sequence[bytes], hits: int, wires: bytes
    ) -> int:
        """How many of the ``hits`` leading keys found in the image have a copy on a node in
        use: the first copy's node (in ``wires``), else the second copy's (filed in the image
        under its alternate key)."""
        held_off = self._breaker.unavailable()
        if not held_off:
            return hits
        nodes = np.frombuffer(wires, DESCRIPTOR_DTYPE, count=hits)["node"]
        blocked = np.flatnonzero(np.isin(nodes, list(held_off)))
        if not len(blocked):
            return hits
        found, _, second, trips = image.prefix([alternate_key(keys[int(i)], 1) for i in blocked])
        self._counters.add("image_round_trips", trips)
        elsewhere = np.frombuffer(second, DESCRIPTOR_DTYPE, count=found)["node"]
        for j, i in enumerate(blocked):
            if j >= found or int(elsewhere[j]) in held_off:
                return int(i)
        return hits

    def _usable_copies(self, copies: Copies) -> Copies:
        """``copies`` (a lookup's leading run) cut at the first key with no copy on a node
        in use."""
        held_off = self._breaker.unavailable()
        descriptors = copies.descriptors
        if not held_off or not descriptors:
            return copies
        if isinstance(descriptors, PackedDescriptors):
            nodes = np.frombuffer(descriptors.wires, DESCRIPTOR_DTYPE)["node"]
        else:
            run = next((i for i, d in enumerate(descriptors) if d is None), len(descriptors))
            nodes = np.array([d.node for d in descriptors[:run] if d is not None], np.uint32)
        for i in np.flatnonzero(np.isin(nodes, list(held_off))):
            others = copies.alternates.get(int(i), ())
            if all(other.node in held_off for other in others):
                cut = int(i)
                self._counters.add("backoff_misses", len(nodes) - cut)
                kept: Sequence[Descriptor | None] = (
                    PackedDescriptors(descriptors.wires[: cut * DESCRIPTOR_SIZE])
                    if isinstance(descriptors, PackedDescriptors)
                    else descriptors[:cut]
                )
                alternates = {j: a for j, a in copies.alternates.items() if j < cut}
                return Copies(descriptors=kept, alternates=alternates)
        return copies

    def _exists_from_image(self, image: ImageReader, keys: Sequence[bytes]) -> list[bool]:
        try:
            states, trips = image.exists(keys)
        except TypeError:
            check_keys(keys)
            raise
        found = [state == ImageStop.HIT for state in states]
        unusable = ImageStop.UNUSABLE in states  # the image could not be read: every key
        if not unusable and ImageStop.UNKNOWN not in states:
            self._counters.update(
                exists_calls=1,
                exists_keys=len(keys),
                exists_hits=found.count(True),
                image_round_trips=trips,
                onesided_lookups=1,
            )
            return found
        unknown = [
            i for i, state in enumerate(states) if state in (ImageStop.UNKNOWN, ImageStop.UNUSABLE)
        ]
        self._counters.update(image_fallbacks=1, image_unavailable=int(unusable))
        flags = self._calls.ask(self._index.exists, [keys[i] for i in unknown])
        if flags is not None:
            for i, flag in zip(unknown, flags, strict=True):
                found[i] = flag
        self._counters.update(
            exists_calls=1,
            exists_keys=len(keys),
            exists_hits=found.count(True),
            image_round_trips=trips,
        )
        return found
