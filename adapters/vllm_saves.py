"""The vLLM connector's saves: copied out of the paged cache in the step, stored behind it.

After each forward the blocks that became full are copied out of the pages into fresh
buffers (one copy, while the pages certainly hold those blocks, so vLLM may reuse them at
once) and stored by one ``batched_put`` on a background thread, with vLLM's view of each
block for the tier's KV events (:mod:`kvfabric.adapters.vllm_events`, built on that
thread). The bytes waiting to be stored are bounded: when the store is slower than the
engine, new blocks are dropped and counted, never queued without bound, so a slow or dead
store costs future misses, never a stalled step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

# Typed where torch is installed; Any where it is not (kvfabric's lint env).
import torch  # type: ignore[import-not-found, unused-ignore]

import kvfabric
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.adapters.vllm_events import EngineView, engine_blocks
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.errors import ValueTooLargeError
from kvfabric.spi import Counters

__all__ = ["SAVE_COUNTERS", "BackgroundSaves"]

log = logging.getLogger("kvfabric.adapters.vllm")

SAVE_COUNTERS = (
    "saved_blocks",
    "saved_bytes",
    "save_deduplicated_blocks",
    "save_failed_blocks",
    "save_skipped_blocks",
)
"""What the saves count (part of ``KVFabricConnector.counters()`` on a worker)."""


class BackgroundSaves:
    """One worker's saves; see the module docstring."""

    def __init__(
        self,
        *,
        store: kvfabric.Store,
        pages: PagedKV,
        counters: Counters,
        max_pending_bytes: int,
    ) -> None:
        self._store = store
        self._pages = pages
        self._counters = counters
        # What recurs per load or save: a line a minute each, with a count of the rest.
        self._limited = LimitedLog(log)
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._saver: ThreadPoolExecutor | None = None
        self._last: Future[None] | None = None

    def save(
        self,
        keys: list[bytes],
        block_ids: list[int],
        views: Sequence[tuple[Sequence[bytes], EngineView | None]] = (),
    ) -> None:
        """Copy blocks ``block_ids`` out now and store them under ``keys`` in the background
        (dropped and counted when the bytes already waiting would exceed the bound).
        ``views``: vLLM's hashes and view of the blocks, in the keys' order, per transfer
        (none: the events name the blocks by their keys)."""
        size = len(keys) * self._pages.value_bytes
        with self._lock:
            behind = self._pending_bytes + size > self._max_pending_bytes
            if not behind:
                self._pending_bytes += size
        if behind:
            self._counters.add("save_skipped_blocks", len(keys))
            self._limited.warning(
                "behind", "KVFabricConnector: saves are behind: %d blocks not saved", len(keys)
            )
            return
        values = self._pages.new_values(len(keys))
        self._pages.gather(block_ids, values)
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-vllm-save")
        self._last = self._saver.submit(self._put, keys, values, views)

    def _put(
        self,
        keys: list[bytes],
        values: torch.Tensor,
        views: Sequence[tuple[Sequence[bytes], EngineView | None]],
    ) -> None:
        # A controller or data-node failure comes back as FAILED outcomes, counted below.
        try:
            blocks = _blocks(views) if views else None
            outcomes = self._store.batched_put(keys, [row.numpy() for row in values], blocks=blocks)
        except ValueTooLargeError as exc:
            # A block larger than the store's max_value: configuration, not an outage.
            self._limited.error("too large", "KVFabricConnector: blocks not stored: %s", exc)
            self._counters.add("save_failed_blocks", len(keys))
        else:
            stored = sum(o is kvfabric.PutOutcome.STORED for o in outcomes)
            deduplicated = sum(o is kvfabric.PutOutcome.DEDUPLICATED for o in outcomes)
            self._counters.update(
                saved_blocks=stored,
                saved_bytes=stored * self._pages.value_bytes,
                save_deduplicated_blocks=deduplicated,
                save_failed_blocks=len(keys) - stored - deduplicated,
            )
        finally:
            with self._lock:
                self._pending_bytes -= values.numel()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background saves; False if some are still running after ``timeout``."""
        # One saver thread runs saves in order: when the last one is done, all are.
        if self._last is None:
            return True
        try:
            self._last.result(timeout)
        except FutureTimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop the saver thread (saves not started are dropped)."""
        if self._saver is not None:
            self._saver.shutdown(wait=False, cancel_futures=True)


def _blocks(
    views: Sequence[tuple[Sequence[bytes], EngineView | None]],
) -> list[kvfabric.EngineBlock | None]:
    """One block per key (None where a transfer came without vLLM's view)."""
    blocks: list[kvfabric.EngineBlock | None] = []
    for hashes, view in views:
        blocks += [None] * len(hashes) if view is None else engine_blocks(hashes, view)
    return blocks
