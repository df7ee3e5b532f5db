"""The vLLM connector's worker side: pages, loads before the forward, saves after it.

A worker registers its paged KV cache (:class:`~kvfabric.adapters.vllm_pages.PagedKV`: one
value per block, its page of every layer) and describes its layout for the scheduler. Before
the forward it loads the step's hits in one batched read, with the descriptors the
scheduler's lookup resolved (no round trip of its own): straight into host pages, or into a
staging buffer scattered into device pages. A block that does not land intact is a load
error, which vLLM recomputes (the store reports an invalid record and the index drops it, so
the recomputed block can replace it).
After the forward it copies the step's newly full blocks out of the cache and stores them on
a background thread, bounded by the bytes waiting to be stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

# Typed where torch is installed; Any where it is not (kvfabric's lint env).
import torch  # type: ignore[import-not-found, unused-ignore]

import kvfabric
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.adapters.vllm_keys import KeySpace, Rank
from kvfabric.adapters.vllm_metadata import KVFabricHandshake, KVFabricMetadata, Transfer
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ValueTooLargeError
from kvfabric.spi import Counters

__all__ = ["WORKER_COUNTERS", "WorkerSide", "backend_description", "current_rank"]

log = logging.getLogger("kvfabric.adapters.vllm")

WORKER_COUNTERS = (
    "load_control_rpcs",
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "load_get_ns",
    "load_scatter_ns",
    "saved_blocks",
    "save_deduplicated_blocks",
    "save_failed_blocks",
    "save_skipped_blocks",
)
"""What a worker side counts (``KVFabricConnector.counters()`` on a worker)."""


def current_rank() -> Rank:
    """This worker's (pipeline-parallel, tensor-parallel) rank, from vLLM's process groups."""
    from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
        get_pp_group,
        get_tp_group,
    )

    return (get_pp_group().rank_in_group, get_tp_group().rank_in_group)


def backend_description(vllm_config: Any, kv_cache_config: Any) -> str:
    """Which kernel wrote the pages: the backend, and on CPU the ISA that packs them."""
    from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]

    parts = [f"device={current_platform.device_type}"]
    context = vllm_config.compilation_config.static_forward_context
    for layer in context.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            parts.append(f"backend={backend.get_name()}")
            break
    if current_platform.device_type == "cpu":
        parts.append(f"isa={_cpu_attention_isa(vllm_config, kv_cache_config)}")
    return ",".join(parts)


def _cpu_attention_isa(vllm_config: Any, kv_cache_config: Any) -> str:
    """The instruction set vLLM's CPU attention packs pages for (vec, vec16, amx, ...)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import (  # type: ignore[import-not-found, unused-ignore]
            _get_attn_isa,
        )

        # An attention spec (dtype, head_size); any other kind fails here and is "unknown".
        spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        isa = _get_attn_isa(
            spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
        )
        return str(isa)
    except Exception:
        # Unknown here; the vLLM version in the namespace still pins the kernel code.
        return "unknown"


class WorkerSide:
    """The connector's state in one vLLM worker; see the module docstring.

    ``enabled`` False (a KV-cache configuration the connector does not support) keeps the
    worker from reporting a layout, so the scheduler never looks anything up.
    """

    def __init__(
        self,
        *,
        keyspace: KeySpace,
        store: kvfabric.Store | None,
        enabled: bool = True,
        max_pending_save_bytes: int = 1 << 30,
    ) -> None:
        self._keyspace = keyspace
        self._store = store
        self._enabled = enabled
        self._max_pending_save_bytes = max_pending_save_bytes
        self.counters = Counters(WORKER_COUNTERS)
        # What recurs per load or save (blocks that did not load, saves falling behind):
        # a line a minute each, with a count of the rest.
        self._limited = LimitedLog(log)
        self.rank: Rank = (0, 0)
        self.layout = ""
        """This worker's KV layout as namespace text (set by ``register_kv_caches``)."""
        self._pages: PagedKV | None = None
        self._staging: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._last_save: Future[None] | None = None
        self._pending_save_bytes = 0
        self._pending_lock = threading.Lock()

    # -- set-up --------------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int, rank: Rank, backend: str
    ) -> None:
        """Take the layers' caches (in layer order) as one value per block.

        ``backend``: which kernel wrote the pages (``backend_description``), the first part
        of this worker's layout.
        """
        self.rank = rank
        try:
            self._pages = PagedKV(kv_caches, num_blocks)
        except ValueError as exc:
            log.warning("KVFabricConnector: unsupported KV cache (%s): disabled", exc)
            self._enabled = False
            return
        self.layout = f"{backend};{self._pages.describe()}"
        log.info(
            "KVFabricConnector worker pp%d/tp%d: %d bytes per block value",
            *self.rank,
            self._pages.value_bytes,
        )

    def handshake(self) -> KVFabricHandshake | None:
        """What the scheduler needs from this worker: its layout (None: disabled)."""
        if not self._enabled or self._pages is None:
            return None
        return KVFabricHandshake(layout=self.layout)

    def keys_for(self, block_hashes: Sequence[bytes], cache_salt: str | None) -> list[bytes]:
        """This worker's keys of ``block_hashes``."""
        return self._keyspace.keys(
            block_hashes, rank=self.rank, layout=self.layout, cache_salt=cache_salt
        )

    def _transfer_keys(self, transfer: Transfer) -> list[bytes]:
        return self.keys_for(transfer.block_hashes, transfer.cache_salt)

    # -- loads ---------------------------------------------------------------------------

    def _landing_buffer(self, pages: PagedKV, rows: int) -> torch.Tensor:
        """A reused [rows, value bytes] buffer that loads land in (grown, never shrunk)."""
        if self._staging is None or self._staging.shape[0] < rows:
            self._staging = pages.new_values(rows)
        return self._staging[:rows]

    def start_load_kv(self, meta: KVFabricMetadata) -> None:
        """Load this step's hits before the forward: one batched read, then a scatter."""
        self._failed_loads = set()
        if not meta.loads:
            return
        keys: list[bytes] = []
        block_ids: list[int] = []
        owners: list[str] = []
        for transfer in meta.loads:
            keys += self._transfer_keys(transfer)
            block_ids += transfer.block_ids
            owners += [transfer.req_id] * len(transfer.block_ids)
        pages = self._pages
        if self._store is None or pages is None:
            self._fail_loads(keys, block_ids, owners, range(len(keys)))
            return
        started = time.perf_counter_ns()
        self._store.remember(
            [
                Descriptor.from_bytes(wire)
                for transfer in meta.loads
                for rank, wires in transfer.descriptors
                if rank == self.rank
                for wire in wires
            ]
        )
        rpcs_before = self._store.stats()["control_rpcs"]
        host_pages = [pages.host_pages_of(block_id) for block_id in block_ids]
        if all(p is not None for p in host_pages):
            # Host pages: each value lands straight in its block's page of every layer (one
            # copy, by the transport; the checksum runs over the pages). A block that fails
            # holds garbage, and is reported below so vLLM recomputes it over that garbage.
            # An unreachable node or controller reads as misses, like an invalid record.
            flags = self._store.batched_get_scattered(keys, host_pages)  # type: ignore[arg-type]
            landed = time.perf_counter_ns()
            good = [i for i, ok in enumerate(flags) if ok]
        else:
            # Device pages: values land in a pinned staging buffer, then copy to the device.
            landing = self._landing_buffer(pages, len(keys))
            values = self._store.batched_get(keys, into=[row.numpy() for row in landing])
            landed = time.perf_counter_ns()
            size = pages.value_bytes
            good = [i for i, v in enumerate(values) if v is not None and v.nbytes == size]
            pages.scatter(landing, [(i, block_ids[i]) for i in good])
        self.counters.add("load_control_rpcs", self._store.stats()["control_rpcs"] - rpcs_before)
        if len(good) < len(keys):
            bad = sorted(set(range(len(keys))) - set(good))
            self._fail_loads(keys, block_ids, owners, bad)
        self.counters.update(
            loaded_blocks=len(good),
            loaded_bytes=len(good) * pages.value_bytes,
            load_get_ns=landed - started,
            load_scatter_ns=time.perf_counter_ns() - landed,
        )

    def _fail_loads(
        self, keys: list[bytes], block_ids: list[int], owners: list[str], bad: Iterable[int]
    ) -> None:
        # No delete of the bad records here: the store reports a record that fails
        # validation to the index, which drops it, so the recomputed block can be stored in
        # its place; an absent or unreachable one has nothing to drop.
        bad = list(bad)
        self._load_errors.update(block_ids[i] for i in bad)
        self._failed_loads.update(owners[i] for i in bad)
        self.counters.add("load_errors", len(bad))
        self._limited.warning(
            "load",
            "KVFabricConnector: %d of %d blocks did not load intact: vLLM recomputes them",
            len(bad),
            len(keys),
        )

    def take_load_errors(self) -> set[int]:
        """Block ids that failed to load since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------

    def wait_for_save(self, meta: KVFabricMetadata) -> None:
        """Copy this step's new full blocks out of the cache; store them in the background."""
        # A request whose load failed this step computed its new blocks over bad KV: vLLM
        # discards that work, and so must we.
        saves = [t for t in meta.saves if t.req_id not in self._failed_loads]
        pages = self._pages
        if not saves or self._store is None or pages is None:
            return
        keys: list[bytes] = []
        block_ids: list[int] = []
        for transfer in saves:
            keys += self._transfer_keys(transfer)
            block_ids += transfer.block_ids
        size = len(keys) * pages.value_bytes
        with self._pending_lock:
            behind = self._pending_save_bytes + size > self._max_pending_save_bytes
            if not behind:
                self._pending_save_bytes += size
        if behind:
            self.counters.add("save_skipped_blocks", len(keys))
            self._limited.warning(
                "behind", "KVFabricConnector: saves are behind: %d blocks not saved", len(keys)
            )
            return
        # Copied out now, while the pages are certain to hold these blocks; stored later.
        values = pages.new_values(len(keys))
        pages.gather(block_ids, values)
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-vllm-save")
        self._last_save = self._saver.submit(self._put, keys, values)

    def _put(self, keys: list[bytes], values: torch.Tensor) -> None:
        # A controller or data-node failure comes back as FAILED outcomes, counted below.
        try:
            assert self._store is not None
            outcomes = self._store.batched_put(keys, [row.numpy() for row in values])
        except ValueTooLargeError as exc:
            # A block larger than the store's max_value: configuration, not an outage.
            self._limited.error("too large", "KVFabricConnector: blocks not stored: %s", exc)
            self.counters.add("save_failed_blocks", len(keys))
        else:
            stored = sum(o is kvfabric.PutOutcome.STORED for o in outcomes)
            deduplicated = sum(o is kvfabric.PutOutcome.DEDUPLICATED for o in outcomes)
            self.counters.update(
                saved_blocks=stored,
                save_deduplicated_blocks=deduplicated,
                save_failed_blocks=len(keys) - stored - deduplicated,
            )
        finally:
            with self._pending_lock:
                self._pending_save_bytes -= values.numel()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background saves; False if some are still running after ``timeout``."""
        # One saver thread runs saves in order: when the last one is done, all are.
        if self._last_save is None:
            return True
        try:
            self._last_save.result(timeout)
        except FutureTimeoutError:
            return False
        return True

    def shutdown(self) -> None:
        """Give pending saves a while, then stop the saver thread and close the store."""
        if not self.flush(timeout=10.0):
            log.warning("KVFabricConnector: shutting down with saves still running")
        if self._saver is not None:
            self._saver.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()
            self._store = None
