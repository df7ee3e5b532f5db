"""The client: ``Store``, the synchronous, thread-safe face of kvfabric.

Lookups cost one index call and fill the prefetch cache; reads take descriptors from it,
resolve only what is missing (one call for all of them), read per node, and validate every
landed record. Writes cost one ``allocate`` call and one ``publish`` call per batch, and a
key that is already stored moves no bytes. Any failure on the read path is a miss, never an
exception and never a wrong value.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kvfabric._client.dataplane import DataPlane
from kvfabric._client.prefetch import PrefetchCache
from kvfabric._node.node import DataNode
from kvfabric.descriptor import Descriptor
from kvfabric.errors import (
    ControllerUnavailableError,
    InvalidKeyError,
    KvfabricError,
    ValidationError,
    ValueTooLargeError,
)
from kvfabric.keys import KEY_SIZE
from kvfabric.options import ClientOptions
from kvfabric.spi.buffers import byte_view, writable_view
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import AllocationKind, AllocationRequest, GrantRef, Index
from kvfabric.spi.plugins import PluginManager
from kvfabric.spi.record import HEADER_SIZE, checksum_pieces, pack_header, validate_record
from kvfabric.spi.transport import Segment, TransportClient

__all__ = ["PutOutcome", "Store"]

log = logging.getLogger("kvfabric")
T = TypeVar("T")

# Reads of more than this per node are landed in groups of about this size, each group
# validated while the next one lands.
_PIPELINE_GROUP_BYTES = 32 << 20


class PutOutcome(enum.Enum):
    STORED = "stored"
    DEDUPLICATED = "deduplicated"
    """Already stored (by anyone): no bytes moved."""
    IN_FLIGHT = "in_flight"
    """Another writer is storing it right now: skipped."""
    NO_SPACE = "no_space"
    FAILED = "failed"
    """The write or the controller failed; nothing was published."""


_OUTCOME_OF = {
    AllocationKind.EXISTS: PutOutcome.DEDUPLICATED,
    AllocationKind.IN_FLIGHT: PutOutcome.IN_FLIGHT,
    AllocationKind.NO_SPACE: PutOutcome.NO_SPACE,
}


class _Read:
    """One record being read: where it lands and whether it made it."""

    __slots__ = ("descriptor", "header", "index", "key", "pieces", "refused", "result")

    def __init__(
        self,
        index: int,
        key: bytes,
        descriptor: Descriptor,
        header: memoryview,
        pieces: list[memoryview],
    ) -> None:
        self.index = index
        self.key = key
        self.descriptor = descriptor
        self.header = header
        self.pieces = pieces
        """Where the payload lands, in order (usually one buffer)."""
        self.refused = False
        """The node refused the read (bad rkey, out of bounds): a miss, not an invalid record."""
        self.result: memoryview | None = None


class Store:
    """A connection to a kvfabric store; create it with :func:`kvfabric.connect`."""

    def __init__(
        self,
        *,
        index: Index,
        data: DataPlane,
        options: ClientOptions,
        plugins: PluginManager,
        on_close: Sequence[Callable[[], None]] = (),
        local_node: DataNode | None = None,
    ) -> None:
        """``local_node``: the data node running in this process (embedded mode), if any."""
        self.local_node = local_node
        self._index = index
        self._data = data
        self._options = options
        self._plugins = plugins
        self._on_close = list(on_close)
        self._prefetch = PrefetchCache(
            max_entries=options.prefetch_entries, ttl=options.prefetch_ttl
        )
        self._counters = Counters()
        self._observer_pool: ThreadPoolExecutor | None = None
        self._validator_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._membership_stale = True
        # A controller that is down now is not an error: reads miss until it is back.
        with contextlib.suppress(ControllerUnavailableError):
            self._refresh_membership()

    # -- public API --------------------------------------------------------------------

    def batched_contains(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored; their descriptors are kept for the read."""
        _check_keys(keys)
        if not keys:
            return 0
        try:
            found = self._rpc(self._index.lookup_prefix, keys)
        except ControllerUnavailableError:
            return 0
        self._prefetch.remember(found)
        self._counters.update(lookups=1, prefix_hits=len(found))
        self._observe(keys, len(found))
        return len(found)

    def batched_exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (for engines that probe non-contiguous keys)."""
        _check_keys(keys)
        if not keys:
            return []
        self._counters.add("exists_calls")
        try:
            return self._rpc(self._index.exists, keys)
        except ControllerUnavailableError:
            return [False] * len(keys)

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
        descriptors = self._prefetch.take(keys)
        prefetched = [d is not None for d in descriptors]
        self._counters.update(gets=1, prefetch_hits=sum(prefetched))
        self._resolve_missing(keys, descriptors)
        results, invalid = self._read(keys, descriptors, into)
        # A prefetched descriptor is only a shortcut: if it led to an invalid record, the
        # key may have moved, so ask the index once more for those keys.
        retry = [i for i in invalid if prefetched[i]]
        if retry:
            self._prefetch.drop(keys[i] for i in retry)
            fresh = self._resolve([keys[i] for i in retry])
            again: list[Descriptor | None] = [None] * len(keys)
            for i, d in zip(retry, fresh, strict=True):
                old = descriptors[i]
                if d is not None and old is not None and d.version != old.version:
                    again[i] = d
            if any(d is not None for d in again):
                second, _ = self._read(keys, again, into)
                for i, value in enumerate(second):
                    if value is not None:
                        results[i] = value
        hits = sum(r is not None for r in results)
        self._counters.update(get_hits=hits, get_misses=len(keys) - hits)
        return results

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

    def batched_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[PutOutcome]:
        """Store values under keys: one allocate call, the writes, one publish call.

        A value is a buffer, or a list of buffers whose concatenation is the value (gathered
        from where they lie, no copy). A key already stored moves no bytes
        (``DEDUPLICATED``). Raises :class:`ValueTooLargeError` before doing anything if a
        value exceeds ``max_value``.
        """
        _check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"{len(values)} values for {len(keys)} keys")
        if not keys:
            return []
        pieces = [_value_pieces(v) for v in values]
        lengths = [sum(p.nbytes for p in value) for value in pieces]
        for i, length in enumerate(lengths):
            if length > self._options.max_value:
                raise ValueTooLargeError(
                    f"value {i} has {length} bytes; this store takes at most "
                    f"{self._options.max_value} (option max_value)"
                )
        self._prefetch.drop(keys)
        requests = [AllocationRequest(key=k, length=n) for k, n in zip(keys, lengths, strict=True)]
        self._counters.add("puts")
        try:
            result = self._rpc(self._index.allocate, requests)
        except ControllerUnavailableError:
            self._counters.add("put_failures", len(keys))
            return [PutOutcome.FAILED] * len(keys)
        outcomes: list[PutOutcome] = []
        grants: dict[int, list[tuple[int, Descriptor]]] = {}
        for i, alloc in enumerate(result.allocations):
            if alloc.kind is AllocationKind.GRANTED and alloc.descriptor is not None:
                grants.setdefault(alloc.descriptor.node, []).append((i, alloc.descriptor))
                outcomes.append(PutOutcome.STORED)
            else:
                outcomes.append(_OUTCOME_OF[alloc.kind])
        written, failed = self._write(grants, pieces)
        published = self._publish(written)
        for i, d, _ in written:
            if not published.get(i, False):
                failed.append((i, d))
        for i, _ in failed:
            outcomes[i] = PutOutcome.FAILED
        if failed:
            with contextlib.suppress(ControllerUnavailableError):
                self._rpc(self._index.abort, [GrantRef.of(d) for _, d in failed])
        self._counters.update(
            evictions=result.evictions,
            stored=sum(o is PutOutcome.STORED for o in outcomes),
            payload_bytes_written=sum(d.length for _, d, _ in written),
            dedup_hits=sum(o is PutOutcome.DEDUPLICATED for o in outcomes),
            in_flight_skips=sum(o is PutOutcome.IN_FLIGHT for o in outcomes),
            no_space=sum(o is PutOutcome.NO_SPACE for o in outcomes),
            put_failures=len(failed),
        )
        return outcomes

    def ping(self) -> bool:
        """Whether the controller answers (one control round trip; never raises)."""
        try:
            self._rpc(self._index.nodes)
        except KvfabricError:
            return False
        return True

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

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys at once (new lookups miss); returns how many were stored."""
        _check_keys(keys)
        self._prefetch.drop(keys)
        if not keys:
            return 0
        self._counters.add("deletes")
        return self._rpc(self._index.unpublish, keys)

    def stats(self) -> dict[str, int]:
        """This client's counters (no round trip)."""
        return self._counters.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in (self._observer_pool, self._validator_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._data.close()
        for close in reversed(self._on_close):
            close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _rpc(self, method: Callable[..., T], *args: Any) -> T:
        self._counters.add("control_rpcs")
        try:
            return method(*args)
        except ControllerUnavailableError as exc:
            self._counters.add("controller_unavailable")
            log.warning("kvfabric controller unavailable (%s): treating as a miss", exc)
            raise

    def _resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        try:
            return self._rpc(self._index.resolve, keys)
        except ControllerUnavailableError:
            return [None] * len(keys)

    def _resolve_missing(self, keys: Sequence[bytes], descriptors: list[Descriptor | None]) -> None:
        missing = [i for i, d in enumerate(descriptors) if d is None]
        if not missing:
            return
        for i, d in zip(missing, self._resolve([keys[i] for i in missing]), strict=True):
            descriptors[i] = d

    def controller_restarted(self, epoch: int) -> None:
        """The controller came back with a new epoch: node ids and descriptors are stale."""
        log.warning("kvfabric controller restarted (epoch %x): relearning nodes", epoch)
        self._prefetch.clear()
        self._membership_stale = True

    def _refresh_membership(self) -> None:
        self._membership_stale = False
        try:
            self._data.replace_nodes(self._rpc(self._index.nodes))
        except BaseException:
            self._membership_stale = True
            raise

    def _ensure_routes(self, nodes: set[int]) -> None:
        if not self._membership_stale and all(self._data.knows(n) for n in nodes):
            return
        # A node joined after we connected, or the controller restarted: relearn.
        with contextlib.suppress(ControllerUnavailableError):
            self._refresh_membership()

    def _read(
        self,
        keys: Sequence[bytes],
        descriptors: Sequence[Descriptor | None],
        into: Sequence[Any] | None,
    ) -> tuple[list[memoryview | None], list[int]]:
        """Read and validate; returns the values and the indices that failed validation."""
        results: list[memoryview | None] = [None] * len(keys)
        invalid: list[int] = []
        headers = memoryview(bytearray(HEADER_SIZE * len(keys)))
        per_node: dict[int, list[_Read]] = {}
        arena: memoryview | None = None
        arena_used = 0
        if into is None:
            # One uninitialised allocation for the batch: a bytearray per value would be
            # zero-filled page by page while holding the GIL, and a malloc per value costs
            # an mmap each; here the first touch of each page is the GIL-free copy.
            arena = np.empty(sum(d.length for d in descriptors if d), dtype=np.uint8).data
        for i, d in enumerate(descriptors):
            if d is None:
                continue
            if arena is not None:
                pieces = [arena[arena_used : arena_used + d.length]]
                arena_used += d.length
            else:
                assert into is not None
                landing = _landing_pieces(into[i], d.length)
                if landing is None:
                    log.warning(
                        "kvfabric: buffers for key %d hold less than %d bytes: miss", i, d.length
                    )
                    continue
                pieces = landing
            header = headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
            per_node.setdefault(d.node, []).append(_Read(i, keys[i], d, header, pieces))
        if not per_node:
            return results, invalid
        self._ensure_routes(set(per_node))
        outcomes = self._data.run_per_node(
            {node: functools.partial(self._read_node, items) for node, items in per_node.items()}
        )
        landed_bytes = 0
        failures = 0
        for node, items in per_node.items():
            outcome = outcomes[node]
            if isinstance(outcome, BaseException):
                log.warning("kvfabric: read from node %d failed (%s): misses", node, outcome)
                self._counters.add("transport_failures")
                continue
            landed_bytes += outcome
            for item in items:
                if item.result is not None:
                    results[item.index] = item.result
                elif not item.refused:
                    invalid.append(item.index)
                    failures += 1
        self._counters.update(payload_bytes_read=landed_bytes, validation_failures=failures)
        return results, invalid

    def _read_node(self, items: list[_Read]) -> int:
        """Read one node's records and validate them; returns payload bytes landed.

        A large batch is read in a few groups, and each group is validated on a helper
        thread while the next one lands: the CRC pass then overlaps the transfer instead of
        following it (both release the GIL).
        """
        node = items[0].descriptor.node
        _, client = self._data.route(node)
        groups = _split_by_bytes(items, _PIPELINE_GROUP_BYTES)
        if len(groups) == 1:
            self._land(client, node, items)
            return self._validate(items)
        pending: Future[int] | None = None
        landed = 0
        try:
            for group in groups:
                self._land(client, node, group)
                if pending is not None:
                    landed += pending.result()
                pending = self._validator().submit(self._validate, group)
        finally:
            if pending is not None:
                landed += pending.result()
        return landed

    @staticmethod
    def _land(client: TransportClient, node: int, items: list[_Read]) -> None:
        segments: list[Segment] = []
        spans: list[int] = []
        for item in items:
            d = item.descriptor
            segments.append(Segment(d.region, d.rkey, d.offset, item.header))
            offset = d.offset + HEADER_SIZE
            for piece in item.pieces:
                segments.append(Segment(d.region, d.rkey, offset, piece))
                offset += piece.nbytes
            spans.append(1 + len(item.pieces))
        errors = client.read(node, segments)
        start = 0
        for item, span in zip(items, spans, strict=True):
            if any(error is not None for error in errors[start : start + span]):
                item.refused = True
            start += span

    @staticmethod
    def _validate(items: list[_Read]) -> int:
        landed = 0
        for item in items:
            if item.refused:
                continue
            landed += item.descriptor.length
            try:
                validate_record(item.header, item.pieces, item.descriptor, item.key)
            except ValidationError as exc:
                log.info("kvfabric: record for key %s invalid (%s): miss", item.key.hex(), exc)
                continue
            item.result = item.pieces[0]
        return landed

    def _validator(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._validator_pool is None:
                self._validator_pool = ThreadPoolExecutor(2, thread_name_prefix="kvfabric-crc")
            return self._validator_pool

    def _write(
        self,
        grants: dict[int, list[tuple[int, Descriptor]]],
        pieces: Sequence[list[memoryview]],
    ) -> tuple[list[tuple[int, Descriptor, int]], list[tuple[int, Descriptor]]]:
        """Checksum and write the granted records, per node (nodes in parallel).

        Returns (index, grant, crc) for records that landed and (index, grant) for the rest.
        """
        if not grants:
            return [], []
        self._ensure_routes(set(grants))

        def job(
            node: int, items: list[tuple[int, Descriptor]]
        ) -> tuple[list[int], list[Any], list[int]]:
            _, client = self._data.route(node)
            segments: list[Segment] = []
            crcs: list[int] = []
            spans: list[int] = []
            for i, d in items:
                crc = checksum_pieces(pieces[i])
                crcs.append(crc)
                head = pack_header(d.key, d.version, d.length, crc)
                segments.append(Segment(d.region, d.rkey, d.offset, memoryview(head)))
                offset = d.offset + HEADER_SIZE
                for piece in pieces[i]:
                    segments.append(Segment(d.region, d.rkey, offset, piece))
                    offset += piece.nbytes
                spans.append(1 + len(pieces[i]))
            return crcs, client.write(node, segments), spans

        outcomes = self._data.run_per_node(
            {node: functools.partial(job, node, items) for node, items in grants.items()}
        )
        written: list[tuple[int, Descriptor, int]] = []
        failed: list[tuple[int, Descriptor]] = []
        for node, items in grants.items():
            outcome = outcomes[node]
            if isinstance(outcome, BaseException):
                log.warning("kvfabric: write to node %d failed (%s): not stored", node, outcome)
                self._counters.add("transport_failures")
                failed.extend(items)
                continue
            crcs, errors, spans = outcome
            start = 0
            for n, (i, d) in enumerate(items):
                if all(error is None for error in errors[start : start + spans[n]]):
                    written.append((i, d, crcs[n]))
                else:
                    failed.append((i, d))
                start += spans[n]
        return written, failed

    def _publish(self, written: list[tuple[int, Descriptor, int]]) -> dict[int, bool]:
        if not written:
            return {}
        try:
            flags = self._rpc(self._index.publish, [GrantRef.of(d, crc) for _, d, crc in written])
        except ControllerUnavailableError:
            return {}
        return {i: ok for (i, _, _), ok in zip(written, flags, strict=True)}

    def _observe(self, keys: Sequence[bytes], hits: int) -> None:
        hook = self._plugins.pm.hook.kvfabric_lookup_done
        if not hook.get_hookimpls():
            return
        if self._observer_pool is None:
            self._observer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-observe")
        self._observer_pool.submit(hook, keys=list(keys), hits=hits)


def _value_pieces(value: Any) -> list[memoryview]:
    """A value as flat views: one buffer, or a list of buffers concatenated."""
    if isinstance(value, list | tuple):
        return [byte_view(piece) for piece in value]
    return [byte_view(value)]


def _landing_pieces(target: Any, length: int) -> list[memoryview] | None:
    """The views a value of ``length`` bytes lands in: one buffer, or several in order.

    None when they hold less than ``length`` bytes.
    """
    buffers = target if isinstance(target, list | tuple) else (target,)
    pieces: list[memoryview] = []
    need = length
    for buffer in buffers:
        if need == 0:
            break
        view = writable_view(buffer)
        take = min(view.nbytes, need)
        pieces.append(view[:take])
        need -= take
    if need or not buffers:
        return None
    if not pieces:  # an empty value still lands "somewhere", for a uniform read path
        pieces.append(writable_view(buffers[0])[:0])
    return pieces


def _split_by_bytes(items: list[_Read], group_bytes: int) -> list[list[_Read]]:
    groups: list[list[_Read]] = [[]]
    size = 0
    for item in items:
        if size >= group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.descriptor.length
    return groups


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_SIZE:
            raise InvalidKeyError(
                f"keys must be {KEY_SIZE}-byte bytes (see kvfabric.chain_key / fold_key), "
                f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
            )
