"""The client: ``Store``, the synchronous, thread-safe face of kvfabric.

``Store`` is the public class and the place its parts are put together; each part does one
job and the store's methods hand each batch call to it:

- :mod:`~kvfabric._client.lookups` — ``batched_contains`` / ``batched_exists`` / ``locate``,
  from the lookup image or the index, filling the prefetch cache;
- :mod:`~kvfabric._client.reads` — ``batched_get``: resolve what the cache lacks, land and
  validate through the record I/O layer (:mod:`~kvfabric._client.record_io`), re-resolve
  prefetched misses, fall over to other copies;
- :mod:`~kvfabric._client.writes` — ``batched_put`` and ``delete``: allocate, write,
  publish, or the put through extents (:mod:`~kvfabric._client.carved_writes`);
- :mod:`~kvfabric._client.topology` — the data nodes and the lookup image, as learned from
  the index;
- :mod:`~kvfabric._client.index_calls` — every index call, counted, under the read contract;
- :mod:`~kvfabric._client.counter_names` — the counters ``stats()`` returns;
- :mod:`~kvfabric._client.usage` — each call's duration, and the usage reports that carry
  them and the key counts to the controller.

The read contract: ``batched_contains``, ``batched_exists``, ``batched_get``,
``batched_get_scattered`` and ``locate`` never raise because a controller, a data node or a
transport failed (unreachable, an error reply, a malformed reply, a timeout): they count the
failure in :meth:`Store.stats` and answer 0, False, None — a miss, never a wrong value.
``batched_put`` reports such failures as ``PutOutcome.FAILED`` and ``delete`` as 0. Only
programming errors raise: a bad key, ``into`` of the wrong length or a read-only buffer, a
value larger than ``max_value``.

After ``os.fork()`` a store the child inherited builds its parts again on its first call
there (its opener connects anew; see :class:`StoreParts`), and leaves the parent's alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvfabric._client.carved_writes import CarvedWrites
from kvfabric._client.counter_names import client_counters
from kvfabric._client.extents import ExtentPool
from kvfabric._client.image_reader import ImageReader
from kvfabric._client.index_calls import IndexCalls
from kvfabric._client.lookups import LookupObserver, Lookups
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._client.put_outcome import PutOutcome
from kvfabric._client.reads import Reads
from kvfabric._client.record_io import RecordIO
from kvfabric._client.topology import Topology
from kvfabric._client.touches import TouchReporter
from kvfabric._client.usage import GET, LOOKUP, PUT, CallTimes, UsageReporter
from kvfabric._client.writes import Writes
from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginManager
from kvfabric._runtime import forks
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ControllerUnavailableError
from kvfabric.spi.events import EngineBlock
from kvfabric.spi.index import Index, IndexPlugin
from kvfabric.urls import ClientOptions

__all__ = ["Opener", "PutOutcome", "Store", "StoreParts"]

log = logging.getLogger("kvfabric")


@attrs.frozen(kw_only=True)
class StoreParts:
    """What a store is made of in one process, as its opener makes them: once when the store
    connects, and again in a child the store was forked into (the parent's stay the
    parent's)."""

    index: Index
    records: RecordIO
    on_close: Sequence[Callable[[], None]] = ()
    """Run in reverse order when the store closes."""
    local_node: DataNode | None = None
    """The data node running in this process (embedded mode), if any."""
    local_index: IndexPlugin | None = None
    """The index running in this process (embedded mode), if any."""
    image: ImageReader | None = None
    """A reader of the index's lookup image."""
    locate_image: Callable[[], tuple[ImageReader | None, bool]] | None = None
    """Asks the controller where its image is (one control RPC; a reader or None, and
    whether one this client could read failed to open, so is worth asking again later),
    whenever the store learns the nodes and has no image from this controller yet."""
    start: Callable[[], None] | None = None
    """Run once the store is assembled and has asked for its nodes (a shared index's
    upkeep, which compares the nodes with those the store learned)."""
    report_usage: Callable[[dict[str, int]], bool] | None = None
    """Sends one usage report to the controller (see :mod:`~kvfabric._client.usage`);
    None where no one collects them."""
    report_interval: float = 0.0
    """Seconds between usage reports (0: only when the store closes)."""

    def discard(self) -> None:
        """Close what the opener made (the store could not be assembled)."""
        self.records.close()
        for close in reversed(self.on_close):
            close()


Opener = Callable[["Store"], StoreParts]
"""Makes a store's parts in the calling process; may raise where a child cannot have them
(a clear error naming what to do instead)."""


class Store:
    """A connection to a kvfabric store; create it with :func:`kvfabric.connect`."""

    def __init__(self, *, options: ClientOptions, plugins: PluginManager, opener: Opener) -> None:
        """``opener`` makes the parts this store is made of, here and in a forked child."""
        self._options = options
        self._plugins = plugins
        self._opener = opener
        self._closed = False
        self._set_aside = forks.generation()
        """The last generation whose inherited parts were put aside (see ``_after_fork``)."""
        self._open_here()

    def _open_here(self) -> None:
        """Make this process's parts and learn the nodes."""
        parts = self._opener(self)
        try:
            self._assemble(parts)
        except BaseException:
            parts.discard()
            raise
        # Once the parts are in place: an index callback during this (a controller that
        # restarted) finds them. A controller that is down now is not an error: reads miss
        # until it is back.
        self._topology.refresh()
        if parts.start is not None:
            parts.start()

    def _assemble(self, parts: StoreParts) -> None:
        options = self._options
        # The data node and the index running in this process (embedded mode), if any; in
        # a forked child, once a call there made the child's own.
        self.local_node = parts.local_node
        self.local_index = parts.local_index
        self._records = records = parts.records
        self._on_close = list(parts.on_close)
        self._counters = counters = client_counters()
        self._times = times = CallTimes()
        self._usage = (
            UsageReporter(parts.report_usage, counters, times, interval=parts.report_interval)
            if parts.report_usage is not None
            else None
        )
        self._prefetch = prefetch = PrefetchCache(
            max_entries=options.prefetch_entries, ttl=options.prefetch_ttl
        )
        index = parts.index
        calls = IndexCalls(index, counters)
        self._topology = topology = Topology(calls, records, parts.image, parts.locate_image)
        self._touches = TouchReporter(index.touch, counters)
        self._observer = LookupObserver(self._plugins)
        self._lookups = Lookups(
            calls=calls,
            topology=topology,
            prefetch=prefetch,
            counters=counters,
            touches=self._touches,
            observer=self._observer,
            max_value=options.max_value,
            breaker=records.breaker,
        )
        self._reads = Reads(
            calls=calls, topology=topology, records=records, prefetch=prefetch, counters=counters
        )
        self._carved = (
            CarvedWrites(
                calls=calls,
                topology=topology,
                records=records,
                counters=counters,
                pool=ExtentPool(),
            )
            if options.extents
            else None
        )
        self._writes = Writes(
            calls=calls,
            topology=topology,
            records=records,
            prefetch=prefetch,
            counters=counters,
            max_value=options.max_value,
            carved=self._carved,
        )
        self._lock = threading.Lock()
        # Last: a thread that sees this generation finds every part above in place.
        self._generation = forks.generation()

    def _after_fork(self) -> None:
        """This store was made before a fork and is used in the child for the first time:
        put the parent's parts aside, untouched, and make this process's own.

        Nothing inherited is closed, returned or reused: the control sockets and data
        connections are the parent's (a call on them would hang or interleave with its
        calls), its thread pools' threads did not survive, a lock may be held by a parent
        thread that is not here, and its leased extents are the parent's to write.
        """
        with forks.rebuild_lock():
            if self._generation == forks.generation():
                return  # another thread of this process did it meanwhile
            if self._set_aside != forks.generation():
                forks.abandon(dict(vars(self)))
                self._set_aside = forks.generation()
            if self._closed:
                raise ControllerUnavailableError("this store is closed")
            self._open_here()

    @property
    def learned_nodes(self) -> frozenset[tuple[int, int]] | None:
        """(id, incarnation) of the nodes this store last learned from its index; None
        before it learned any (the index was unreachable)."""
        if self._generation != forks.generation():
            self._after_fork()
        return self._topology.learned_nodes

    @property
    def records(self) -> RecordIO:
        """The record I/O layer this store reads and writes through.

        For tools and tests: ``records.read_slot`` / ``records.write_slot`` move raw bytes
        of one record's slot (e.g. to corrupt it), ``records.transport_of(node)`` names the
        transport used for a node.
        """
        if self._generation != forks.generation():
            self._after_fork()
        return self._records

    # -- lookups -----------------------------------------------------------------------

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored; their descriptors are kept for the read.

        Answered from the lookup image when this client reads one (``onesided_lookups``);
        from the index, in one call, for the keys the image cannot answer for. The list of
        keys is kept for the read, not copied: changing it afterwards can only cost that
        read its kept descriptors (each is checked against the key read).
        """
        if self._generation != forks.generation():
            self._after_fork()
        started = time.perf_counter_ns()
        found = self._lookups.contains(keys)
        self._times.observe(LOOKUP, time.perf_counter_ns() - started)
        return found

    def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (for engines that probe non-contiguous keys).

        From the lookup image where this client reads one; the keys it cannot answer for
        go to the index in one call.
        """
        if self._generation != forks.generation():
            self._after_fork()
        started = time.perf_counter_ns()
        flags = self._lookups.exists(keys)
        self._times.observe(LOOKUP, time.perf_counter_ns() - started)
        return flags

    def locate(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Where each key's record lives, asked of the index now (one control round trip).

        ``None`` for a key that is not stored, and for every key when the controller cannot
        answer (counted, never raised). Neither uses nor fills the prefetch cache.
        """
        if self._generation != forks.generation():
            self._after_fork()
        return self._lookups.locate(keys)

    def prefetched(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """The descriptors the last lookups left for ``keys`` (no round trip).

        For engines whose lookup and load run in different processes (vLLM's scheduler and
        workers): ship these with the load request and hand them to :meth:`remember` there,
        and the load needs no round trip either.
        """
        if self._generation != forks.generation():
            self._after_fork()
        return self._lookups.prefetched(keys)

    def remember(self, descriptors: Sequence[Descriptor]) -> None:
        """Keep descriptors another client resolved, for the reads that follow.

        Only a shortcut, like every prefetched descriptor: reads still validate each
        record, and one that no longer matches is resolved again. Descriptors are inputs
        from elsewhere and checked as such: one longer than ``max_value`` is not kept (its
        key is resolved when read; nothing of that size is allocated), and one naming a
        node, region or offset this store cannot read makes that key a miss. Anything but
        a ``Descriptor`` is a TypeError.
        """
        if self._generation != forks.generation():
            self._after_fork()
        self._lookups.remember(descriptors)

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
        if self._generation != forks.generation():
            self._after_fork()
        started = time.perf_counter_ns()
        values = self._reads.get(keys, into)
        self._times.observe(GET, time.perf_counter_ns() - started)
        return values

    def batched_get_scattered(
        self, keys: Sequence[bytes], into: Sequence[Sequence[Any]]
    ) -> list[bool]:
        """Read each key's value straight into several buffers, filled in order.

        For a value whose natural home is not contiguous (an engine's per-layer pages of one
        block): no staging copy, the transport lands each piece where it belongs and the
        checksum runs over the pieces. True where the value landed and validated; on False
        the buffers may hold garbage (treat as a miss).
        """
        if self._generation != forks.generation():
            self._after_fork()
        started = time.perf_counter_ns()
        landed = self._reads.get_scattered(keys, into)
        self._times.observe(GET, time.perf_counter_ns() - started)
        return landed

    # -- writes ------------------------------------------------------------------------

    def batched_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        blocks: Sequence[EngineBlock | None] | None = None,
    ) -> list[PutOutcome]:
        """Store values under keys: the writes and one publish call, after one allocate
        call where the index places each key (where it leases extents and this client reads
        its lookup image, the records go into an extent this client holds instead).

        A value is a buffer, or a list of buffers whose concatenation is the value (gathered
        from where they lie, no copy; the buffers must not change until this returns). A key
        already stored moves no bytes (``DEDUPLICATED``), unless another writer stored it
        while this one wrote; a controller or data-node failure makes ``FAILED`` outcomes,
        counted. Raises :class:`ValueTooLargeError` before doing anything if a value exceeds
        ``max_value``.

        ``blocks``: what the tier's KV events should say of each key, one
        :class:`~kvfabric.EngineBlock` (or None) per key: the block as the engine knows it
        (its hash, its parent's, its tokens), so a router that tracks the engine's block
        hashes matches the events; without one an event names the block by its key.
        """
        if self._generation != forks.generation():
            self._after_fork()
        started = time.perf_counter_ns()
        outcomes = self._writes.put(keys, values, blocks)
        self._times.observe(PUT, time.perf_counter_ns() - started)
        return outcomes

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys at once (new lookups miss); returns how many were stored.

        0 when the controller could not be asked (counted as ``delete_failures``; the keys
        may then still be stored).
        """
        if self._generation != forks.generation():
            self._after_fork()
        return self._writes.delete(keys)

    # -- the rest ----------------------------------------------------------------------

    def ping(self) -> bool:
        """Whether the controller answers (one control round trip; never raises).

        The answer also refreshes the data nodes this client knows, so a node that joined
        since is reachable through :attr:`records` afterwards.
        """
        if self._generation != forks.generation():
            self._after_fork()
        return self._topology.refresh()

    def stats(self) -> dict[str, int]:
        """This client's counters (no round trip): see
        :mod:`~kvfabric._client.counter_names` for what each one counts."""
        if self._generation != forks.generation():
            self._after_fork()
        return self._counters.snapshot()

    def controller_restarted(self, epoch: int) -> None:
        """The controller came back with a new epoch: node ids and descriptors are stale."""
        if self._generation != forks.generation():
            self._after_fork()
            return  # the parts made just now learned from the controller as it is
        log.warning("kvfabric controller restarted (epoch %x): relearning nodes", epoch)
        self._prefetch.clear()
        if self._carved is not None:
            self._carved.forget()
        self._topology.controller_restarted()

    def membership_changed(self, generation: int) -> None:
        """A data node joined, left, restarted or was replaced: relearn before the next I/O."""
        if self._generation != forks.generation():
            self._after_fork()
            return
        log.info("kvfabric data nodes changed (generation %d): relearning them", generation)
        self._topology.nodes_changed()

    def close(self) -> None:
        """Close what this store holds in this process (in a forked child that never used
        it: nothing, the parts are the parent's)."""
        if self._generation != forks.generation():
            with forks.rebuild_lock():
                if self._generation != forks.generation():
                    if self._set_aside != forks.generation():
                        forks.abandon(dict(vars(self)))
                        self._set_aside = forks.generation()
                    self._closed = True
                    return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._observer.close()
        if self._carved is not None:
            self._carved.release()
        if self._usage is not None:
            self._usage.close()
        self._touches.close()
        self._topology.close()
        self._records.close()
        for close in reversed(self._on_close):
            close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
