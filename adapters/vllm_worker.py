"""The vLLM connector's worker side: the paged cache, the layout handshake, loads and saves.

A worker registers its paged KV cache (:class:`~kvfabric.adapters.vllm_pages.PagedKV`: one
value per block, its page of every layer) and describes its layout for the scheduler. It
hands each step's loads to :class:`~kvfabric.adapters.vllm_loads.AsyncLoads` (off the
forward path, within a deadline, reported through ``poll_loads``) and its newly full blocks
to :class:`~kvfabric.adapters.vllm_saves.BackgroundSaves` (copied out in the step, stored
behind it). A block that does not land intact, or not in time, is a load error, which vLLM
recomputes (a record that fails validation is reported to the index, which drops it, so the
recomputed block can replace it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Typed where torch is installed; Any where it is not (kvfabric's lint env).
import torch  # type: ignore[import-not-found, unused-ignore]

import kvfabric
from kvfabric.adapters.vllm_keys import KeySpace, Rank
from kvfabric.adapters.vllm_loads import LOAD_COUNTERS, AsyncLoads
from kvfabric.adapters.vllm_metadata import KVFabricHandshake, KVFabricMetadata, Transfer
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.adapters.vllm_saves import SAVE_COUNTERS, BackgroundSaves
from kvfabric.adapters.vllm_stats import IntervalStats, KVFabricConnectorStats
from kvfabric.spi import Counters

__all__ = ["WORKER_COUNTERS", "WorkerSide", "backend_description", "current_rank"]

log = logging.getLogger("kvfabric.adapters.vllm")

WORKER_COUNTERS = LOAD_COUNTERS + SAVE_COUNTERS
"""What a worker side counts (``KVFabricConnector.counters()`` on a worker)."""

DEFAULT_LOAD_TIMEOUT = 2.0
"""Seconds a request's load may take before its blocks are recomputed instead."""


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
    ``load_timeout``: seconds a request's load may take (its blocks are load errors after).
    """

    def __init__(
        self,
        *,
        keyspace: KeySpace,
        store: kvfabric.Store | None,
        enabled: bool = True,
        max_pending_save_bytes: int = 1 << 30,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT,
    ) -> None:
        self._keyspace = keyspace
        self._store = store
        self._enabled = enabled
        self._max_pending_save_bytes = max_pending_save_bytes
        self._load_timeout = load_timeout
        self.counters = Counters(WORKER_COUNTERS)
        self._stats = IntervalStats(self.counters)
        self.rank: Rank = (0, 0)
        self.layout = ""
        """This worker's KV layout as namespace text (set by ``register_kv_caches``)."""
        self._pages: PagedKV | None = None
        self._loads: AsyncLoads | None = None
        self._saves: BackgroundSaves | None = None
        self._load_errors: set[int] = set()
        self._orphans: set[str] = set()
        """Loads that could not even start, reported done at the next poll."""

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
            self._pages = pages = PagedKV(kv_caches, num_blocks)
        except ValueError as exc:
            log.warning("KVFabricConnector: unsupported KV cache (%s): disabled", exc)
            self._enabled = False
            return
        self.layout = f"{backend};{pages.describe()}"
        self._loads = AsyncLoads(
            store=self._store,
            pages=pages,
            rank=rank,
            keys_of=self._transfer_keys,
            counters=self.counters,
            stats=self._stats,
            timeout=self._load_timeout,
        )
        if self._store is not None:
            self._saves = BackgroundSaves(
                store=self._store,
                pages=pages,
                counters=self.counters,
                max_pending_bytes=self._max_pending_save_bytes,
            )
        log.info(
            "KVFabricConnector worker pp%d/tp%d: %d bytes per block value",
            *self.rank,
            pages.value_bytes,
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

    @property
    def load_timeout(self) -> float:
        """Seconds a request's load may take; a new value applies to loads started after."""
        return self._load_timeout

    @load_timeout.setter
    def load_timeout(self, seconds: float) -> None:
        self._load_timeout = seconds
        if self._loads is not None:
            self._loads.timeout = seconds

    @property
    def loads_in_flight(self) -> int:
        """Loads started and not yet reported done."""
        return 0 if self._loads is None else self._loads.in_flight

    def start_load_kv(self, meta: KVFabricMetadata) -> None:
        """Start this step's loads (one per request); they finish in later steps."""
        for transfer in meta.loads:
            if self._loads is None:
                # No pages registered (unsupported cache): nothing can land.
                self._load_errors.update(transfer.block_ids)
                self._orphans.add(transfer.req_id)
            else:
                self._loads.submit(transfer)

    def poll_loads(self, finished_req_ids: Iterable[str] = ()) -> set[str]:
        """Requests whose loads are done since the last call; their failed blocks go to
        :meth:`take_load_errors` in the same call (vLLM wants them no later).

        ``finished_req_ids``: requests vLLM has ended; their loads are dropped.
        """
        done, self._orphans = self._orphans, set()
        if self._loads is not None:
            finished, errors = self._loads.poll(finished_req_ids)
            done |= finished
            self._load_errors |= errors
        return done

    def take_load_errors(self) -> set[int]:
        """Block ids that failed to load since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------

    def wait_for_save(self, meta: KVFabricMetadata) -> None:
        """Copy this step's new full blocks out of the cache; store them in the background."""
        if not meta.saves or self._saves is None:
            return
        keys: list[bytes] = []
        block_ids: list[int] = []
        for transfer in meta.saves:
            keys += self._transfer_keys(transfer)
            block_ids += transfer.block_ids
        self._saves.save(keys, block_ids, [(t.block_hashes, t.engine) for t in meta.saves])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background saves; False if some are still running after ``timeout``."""
        return self._saves is None or self._saves.flush(timeout)

    # -- the rest ------------------------------------------------------------------------

    def take_stats(self) -> KVFabricConnectorStats | None:
        """What this worker did since the last call, as vLLM's connector stats."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Abandon loads, give pending saves a while, stop the threads, close the store."""
        if self._loads is not None:
            self._loads.close()
        if self._saves is not None:
            if not self._saves.flush(timeout=10.0):
                log.warning("KVFabricConnector: shutting down with saves still running")
            self._saves.close()
        if self._store is not None:
            self._store.close()
            self._store = None
