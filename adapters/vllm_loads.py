"""The vLLM connector's loads: off the forward path, each within a deadline.

A load is one request's hit blocks. vLLM keeps the request waiting (its waiting-for-remote-KV
state) while the rest of the batch runs. :meth:`AsyncLoads.submit` hands the load to a
loader thread, which reads the values in one batched read, with the descriptors the
scheduler's lookup resolved, into a staging buffer of the load's own, then copies the ones
that landed intact into the pages vLLM allocated. Each step vLLM asks which loads are done
(:meth:`AsyncLoads.poll`): a load that landed is finished, its blocks that did not land
intact are load errors; a load still running at its deadline is abandoned, all its blocks
are load errors and it is finished at once, so vLLM recomputes them while the read goes on.

Why a staging buffer, although a value could land straight in the pages: an abandoned read
may still be landing (a frozen data node that wakes up, a transfer that outlives the
deadline), and by then vLLM has recomputed into those pages or handed them to another
request. Only the copy into the pages writes them, and it holds the load's lock, which
abandoning the load takes too: once a load is reported, nothing of it reaches the pages.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import attrs

# Typed where torch is installed; Any where it is not (kvfabric's lint env).
import torch  # type: ignore[import-not-found, unused-ignore]

import kvfabric
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.adapters.vllm_keys import Rank
from kvfabric.adapters.vllm_metadata import Transfer
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.adapters.vllm_stats import IntervalStats
from kvfabric.descriptor import Descriptor
from kvfabric.spi import Counters

__all__ = ["LOAD_COUNTERS", "AsyncLoads"]

log = logging.getLogger("kvfabric.adapters.vllm")

LOAD_COUNTERS = (
    "load_control_rpcs",
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "load_timeouts",
    "late_loads",
    "load_get_ns",
    "load_scatter_ns",
)
"""What the loads count (part of ``KVFabricConnector.counters()`` on a worker);
``late_loads``: reads that returned after their load was abandoned (landed nowhere)."""

_KEPT_STAGING_BUFFERS = 4
"""Staging buffers kept for reuse (a fresh one costs page faults, or pinning on a GPU host)."""
_KEPT_STAGING_BYTES = 1 << 30
"""Bytes of staging buffers kept for reuse, at most (larger ones are freed after use)."""


class _State(enum.Enum):
    RUNNING = enum.auto()
    LANDED = enum.auto()
    """Read, and what landed intact copied into the pages."""
    ABANDONED = enum.auto()
    """Reported before it landed (deadline, or the request ended): never copied."""


@attrs.define(eq=False)
class _Load:
    transfer: Transfer
    started: float
    """When the worker was handed the load (on the loads' clock)."""
    deadline: float
    lock: threading.Lock = attrs.Factory(threading.Lock)
    """Held while the values are copied into the pages, and to abandon the load."""
    state: _State = _State.RUNNING
    landed: frozenset[int] = frozenset()
    """Block ids whose values landed intact and are in the pages (once LANDED)."""


class _StagingBuffers:
    """Host buffers that loads land in, reused; a buffer is handed back once no read can
    write it any more."""

    def __init__(self, pages: PagedKV) -> None:
        self._pages = pages
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self, rows: int) -> torch.Tensor:
        """A [>= rows, value bytes] buffer: the smallest free one that fits, or a new one."""
        with self._lock:
            # By position, never by value: tensors compare element by element.
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= rows]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
        return self._pages.new_values(rows)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > _KEPT_STAGING_BUFFERS:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].shape[0])
                del self._free[smallest]
            while sum(b.numel() for b in self._free) > _KEPT_STAGING_BYTES:
                largest = max(range(len(self._free)), key=lambda i: self._free[i].shape[0])
                del self._free[largest]


class AsyncLoads:
    """One worker's loads in flight; see the module docstring.

    ``keys_of(transfer)``: this worker's keys of a load's blocks; ``timeout``: seconds a load
    may take from :meth:`submit` before it is abandoned; ``threads``: loads read at once;
    ``clock``: the monotonic clock deadlines are kept on.
    """

    def __init__(
        self,
        *,
        store: kvfabric.Store | None,
        pages: PagedKV,
        rank: Rank,
        keys_of: Callable[[Transfer], list[bytes]],
        counters: Counters,
        stats: IntervalStats,
        timeout: float,
        threads: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._pages = pages
        self._rank = rank
        self._keys_of = keys_of
        self._counters = counters
        # What recurs per load or save: a line a minute each, with a count of the rest.
        self._limited = LimitedLog(log)
        self._stats = stats
        self._clock = clock
        self.timeout = timeout
        """Seconds a load may take; read when a load is submitted."""
        self._staging = _StagingBuffers(pages)
        self._loads: dict[str, _Load] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfabric-vllm-load")

    @property
    def in_flight(self) -> int:
        """Loads submitted and not yet reported by :meth:`poll`."""
        return len(self._loads)

    def submit(self, transfer: Transfer) -> None:
        """Start loading ``transfer``'s blocks into its pages (returns at once)."""
        now = self._clock()
        load = _Load(transfer=transfer, started=now, deadline=now + self.timeout)
        self._loads[transfer.req_id] = load
        if self._store is not None:
            self._pool.submit(self._run, load, self._store)
        else:
            self._finish(load, landed=[])

    def poll(self, ended: Iterable[str] = ()) -> tuple[set[str], set[int]]:
        """The requests whose loads are done, and the block ids that failed to load.

        Done: landed (the blocks that did not land intact are errors), or abandoned at the
        deadline (every block is an error). ``ended``: requests vLLM has finished (aborted
        while loading): their loads are abandoned and reported done, without errors.
        Never waits: a load being copied into its pages is reported at the next poll.
        """
        now = self._clock()
        ended = set(ended)
        done: set[str] = set()
        errors: set[int] = set()
        for req_id, load in list(self._loads.items()):
            if not load.lock.acquire(blocking=False):
                continue  # copying into the pages right now: done by the next poll
            try:
                if load.state is _State.RUNNING:
                    if req_id in ended:
                        load.state = _State.ABANDONED
                    elif now >= load.deadline:
                        load.state = _State.ABANDONED
                        self._timed_out(load, now)
                        errors.update(load.transfer.block_ids)
                    else:
                        continue
                elif req_id not in ended:
                    errors.update(b for b in load.transfer.block_ids if b not in load.landed)
            finally:
                load.lock.release()
            del self._loads[req_id]
            done.add(req_id)
        return done, errors

    def close(self) -> None:
        """Abandon every load; the threads end once their reads return."""
        for load in self._loads.values():
            with load.lock:
                load.state = _State.ABANDONED
        self._loads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the loader threads --------------------------------------------------------------

    def _run(self, load: _Load, store: kvfabric.Store) -> None:
        if load.state is not _State.RUNNING or self._clock() >= load.deadline:
            return  # abandoned, or due, while it waited for a thread: nothing to read
        try:
            self._read(load, store)
        except Exception:
            # Not a store failure (those are misses): a bug. The load's blocks are errors,
            # so vLLM recomputes them.
            log.exception("KVFabricConnector: load of %s failed", load.transfer.req_id)
            with load.lock:
                if load.state is _State.RUNNING:
                    self._finish(load, landed=[])

    def _read(self, load: _Load, store: kvfabric.Store) -> None:
        transfer = load.transfer
        keys = self._keys_of(transfer)
        store.remember(
            [
                Descriptor.from_bytes(wire)
                for rank, wires in transfer.descriptors
                if rank == self._rank
                for wire in wires
            ]
        )
        size = self._pages.value_bytes
        staging = self._staging.take(len(keys))
        try:
            rpcs_before = store.stats()["control_rpcs"]
            started = time.perf_counter_ns()
            host = staging.numpy()
            values = store.batched_get(keys, into=[host[i] for i in range(len(keys))])
            landed_ns = time.perf_counter_ns()
            good = [i for i, v in enumerate(values) if v is not None and v.nbytes == size]
            self._counters.update(
                load_control_rpcs=store.stats()["control_rpcs"] - rpcs_before,
                load_get_ns=landed_ns - started,
            )
            with load.lock:
                if load.state is not _State.RUNNING:
                    # Abandoned while it read: the pages are no longer its own.
                    self._counters.add("late_loads")
                    return
                self._pages.scatter(staging, [(i, transfer.block_ids[i]) for i in good])
                self._finish(load, landed=[transfer.block_ids[i] for i in good])
            self._counters.add("load_scatter_ns", time.perf_counter_ns() - landed_ns)
        finally:
            # The read has returned, so nothing writes the buffer any more.
            self._staging.give(staging)

    def _finish(self, load: _Load, landed: list[int]) -> None:
        """The load is over: ``landed`` block ids are in the pages (caller holds the lock,
        or the load was never shared)."""
        load.landed = frozenset(landed)
        load.state = _State.LANDED
        failed = len(load.transfer.block_ids) - len(landed)
        self._counters.update(
            loaded_blocks=len(landed),
            loaded_bytes=len(landed) * self._pages.value_bytes,
            load_errors=failed,
        )
        self._stats.load_took(self._clock() - load.started)
        if failed:
            self._limited.warning(
                "load",
                "KVFabricConnector: %d of %d blocks did not load intact: vLLM recomputes them",
                failed,
                len(load.transfer.block_ids),
            )

    def _timed_out(self, load: _Load, now: float) -> None:
        blocks = len(load.transfer.block_ids)
        self._counters.update(load_timeouts=1, load_errors=blocks)
        self._stats.load_took(now - load.started)
        self._limited.warning(
            "timeout",
            "KVFabricConnector: load of %d blocks not done within %.3gs: vLLM recomputes them",
            blocks,
            load.deadline - load.started,
        )
