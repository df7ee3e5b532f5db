"""The vLLM connector's scheduler side: lookups, request state, and each step's metadata.

vLLM asks once per new request (again if it could not schedule it) how many of the blocks
it has not computed are stored elsewhere: :meth:`SchedulerSide.get_num_new_matched_tokens`
answers with one ``batched_contains`` (one control RPC) over the keys of every rank, and
keeps the descriptors that lookup resolved. The lookup runs on a thread of its own, and the
scheduler waits for it only up to ``lookup_wait``, which a healthy index meets; past that
the answer is "not yet" and vLLM asks again at its next step, scheduling the rest of the
batch meanwhile, so a dead or slow controller costs the request its lookup's timeout, never
the engine a stall. Once vLLM has allocated blocks for the request,
the hits become a load, which the workers run while vLLM keeps the request waiting; each
step :meth:`SchedulerSide.build_connector_meta` hands the workers the new loads and the
blocks that became full (saves), skipping what is known to be stored. Load errors the
workers report make those blocks eligible for saving again, and the request is not offered
kvfabric's blocks again (vLLM recomputes what failed instead of waiting for it twice).

The start-up checks of this role are here too: block hashes that cannot agree across
instances are warned about, and vLLM's load-failure policy is set to recompute.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import attrs

import kvfabric
from kvfabric.adapters.vllm_events import EngineView
from kvfabric.adapters.vllm_keys import KeySpace, Rank
from kvfabric.adapters.vllm_metadata import KVFabricHandshake, KVFabricMetadata, Transfer
from kvfabric.adapters.vllm_stats import IntervalStats, KVFabricConnectorStats
from kvfabric.spi import Counters

__all__ = [
    "DEFAULT_LOOKUP_WAIT",
    "SCHEDULER_COUNTERS",
    "SchedulerSide",
    "require_recompute_policy",
    "warn_if_hashes_unshared",
]

log = logging.getLogger("kvfabric.adapters.vllm")

DEFAULT_LOOKUP_WAIT = 0.05
"""Seconds the scheduler waits for a lookup before answering "not yet" (asked again later)."""

SCHEDULER_COUNTERS = (
    "lookups",
    "lookup_blocks",
    "lookup_hit_blocks",
    "lookup_control_rpcs",
    "lookup_deferrals",
    "hit_blocks",
    "miss_blocks",
    "invalid_blocks_reported",
)
"""What the scheduler side counts (``KVFabricConnector.counters()`` on the scheduler).

``lookup_*`` count every lookup, also the repeats vLLM makes for a request it could not
schedule yet; ``lookup_deferrals`` the answers "not yet" (a step's lookup wait spent);
``hit_blocks`` and ``miss_blocks`` count each admitted request once: blocks it loads from
kvfabric, and blocks it looked up that kvfabric did not have."""


def warn_if_hashes_unshared(hash_algo: str) -> None:
    """Warn where block hashes cannot agree across instances: nothing would be shared."""
    seed = os.environ.get("PYTHONHASHSEED")
    if hash_algo.startswith("xxhash") and seed is None:
        log.warning(
            "KVFabricConnector: prefix_caching_hash_algo=%s seeds block hashes randomly in "
            "every process, so no other instance can use the blocks this one stores. "
            "Use --prefix-caching-hash-algo sha256_cbor (or set the same PYTHONHASHSEED "
            "on every instance).",
            hash_algo,
        )
    elif seed is not None:
        log.info(
            "KVFabricConnector: PYTHONHASHSEED=%s seeds vLLM's block hashes; only "
            "instances with the same value share blocks",
            seed,
        )


def require_recompute_policy(kv_transfer_config: Any) -> None:
    """kvfabric is a cache: a block that fails to load must be recomputed, not fail.

    vLLM's scheduler reads the policy right after building the connector, so setting it
    here takes effect; vLLM's default ("fail") would end such requests with an error.
    """
    if kv_transfer_config.kv_load_failure_policy != "recompute":
        log.info(
            "KVFabricConnector: setting kv_load_failure_policy='recompute' (was %r): "
            "a block kvfabric cannot deliver intact is recomputed",
            kv_transfer_config.kv_load_failure_policy,
        )
        kv_transfer_config.kv_load_failure_policy = "recompute"


@attrs.define
class _Lookup:
    """The answer ``get_num_new_matched_tokens`` gave for a request."""

    local_blocks: int
    hit_blocks: int
    asked_blocks: int = 0
    """Blocks looked up (beyond the local ones)."""
    descriptors: dict[Rank, list[bytes]] = attrs.Factory(dict)
    """Per rank, the descriptors of the hit blocks, in block order."""


@attrs.define
class _RequestState:
    request: Any
    """vLLM's ``Request`` (its ``block_hashes`` grow as it decodes)."""
    stored_upto: int
    """Blocks below this index are in kvfabric (or being saved): never saved again."""
    load_block_ids: tuple[int, ...] = ()
    load_start: int = 0
    """Block index of ``load_block_ids[0]``."""


class SchedulerSide:
    """The connector's state in vLLM's scheduler; see the module docstring.

    ``block_ids_of(req_id)``: the request's block ids in the paged cache, in block order
    (vLLM's ``KVCacheManager.get_block_ids(req_id)[0]``); ``lookup_wait``: seconds lookups
    may hold the scheduler in one step before the answers are "not yet".
    """

    def __init__(
        self,
        *,
        keyspace: KeySpace,
        store: kvfabric.Store | None,
        block_size: int,
        ranks_expected: int,
        block_ids_of: Callable[[str], Sequence[int]],
        lookup_wait: float = DEFAULT_LOOKUP_WAIT,
    ) -> None:
        self._keyspace = keyspace
        self._store = store
        self._block_size = block_size
        self._ranks_expected = ranks_expected
        self._block_ids_of = block_ids_of
        self.counters = Counters(SCHEDULER_COUNTERS)
        self._stats = IntervalStats(self.counters)
        self._layouts: dict[Rank, str] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_wait = lookup_wait
        self._step_wait_left = lookup_wait
        """What is left of this step's ``lookup_wait`` (renewed by :meth:`build_connector_meta`)."""
        self._asking: dict[str, tuple[int, Future[_Lookup]]] = {}
        """Lookups under way, by request: the local blocks they started from, and the answer."""
        self._lookup_thread: ThreadPoolExecutor | None = None
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[Transfer] = []
        self._load_failed: set[str] = set()
        """Requests some of whose loaded blocks failed: not offered kvfabric's blocks again."""
        self._warned_no_layouts = False

    # -- keys ----------------------------------------------------------------------------

    def set_layouts(self, handshakes: Mapping[Rank, object]) -> None:
        """Learn each worker's KV layout (once at start-up, before any request)."""
        self._layouts = {
            rank: meta.layout
            for rank, meta in handshakes.items()
            if isinstance(meta, KVFabricHandshake)
        }
        if len(self._layouts) != self._ranks_expected:
            log.warning(
                "KVFabricConnector: %d of %d workers reported their KV layout: lookups disabled",
                len(self._layouts),
                self._ranks_expected,
            )
            self._layouts = {}

    @property
    def layouts(self) -> dict[Rank, str]:
        """The KV layout text in each rank's namespace, as the workers reported them."""
        return dict(self._layouts)

    def keys_for(
        self, block_hashes: Sequence[bytes], cache_salt: str | None, rank: Rank
    ) -> list[bytes]:
        """``rank``'s keys of ``block_hashes``, from the layout that worker reported."""
        return self._keyspace.keys(
            block_hashes, rank=rank, layout=self._layouts[rank], cache_salt=cache_salt
        )

    def _lookup_keys(self, request: Any, start: int, end: int) -> list[bytes]:
        # Every rank holds its own shard of a block, so a block is a hit only when all
        # ranks' keys are; interleaving them keeps that a leading run for batched_contains.
        hashes = request.block_hashes[start:end]
        per_rank = [self.keys_for(hashes, request.cache_salt, rank) for rank in self._layouts]
        return [key for keys in zip(*per_rank, strict=True) for key in keys]

    # -- lookups -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that kvfabric holds: one control RPC.

        Only whole blocks count, and at least one token is left to compute (vLLM needs a
        token to sample from). None: the lookup is still running after ``lookup_wait`` (or
        queued behind one that is), and vLLM asks again at a later step, when the answer
        is given. Asking again for the same request once answered asks kvfabric again and
        replaces the previous answer; nothing else changes. A request whose load failed
        is answered 0 (vLLM asks again when it recomputes from the first block).
        """
        bs = self._block_size
        local = num_computed_tokens // bs
        usable = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        # vLLM ignores external hits for requests that want prompt logprobs: don't ask.
        skip = getattr(request, "skip_reading_prefix_cache", False)
        if self._store is not None and not self._layouts and not self._warned_no_layouts:
            self._warned_no_layouts = True
            log.warning("KVFabricConnector: no worker reported its KV layout: lookups disabled")
        req_id = request.request_id
        failed = req_id in self._load_failed
        if self._store is None or not self._layouts or usable <= local or skip or failed:
            self._asking.pop(req_id, None)
            self._lookups[req_id] = _Lookup(local, 0)
            return 0
        asking = self._asking.get(req_id)
        if asking is None or asking[0] != local:
            if self._lookup_thread is None:
                self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-lookup")
            future = self._lookup_thread.submit(self._lookup, request, local, usable)
            self._asking[req_id] = (local, future)
        else:
            future = asking[1]
        # The wait is a budget per step, not per request: every new request of a step is
        # answered while the index is healthy (one whose lookup queues behind another's
        # still gets its answer), and a dead one holds a step for lookup_wait at most.
        started = time.monotonic()
        try:
            lookup = future.result(timeout=self._step_wait_left)
        except FutureTimeoutError:
            self._step_wait_left = 0.0
            self.counters.update(lookup_deferrals=1)
            return None
        self._step_wait_left = max(0.0, self._step_wait_left - (time.monotonic() - started))
        del self._asking[req_id]
        self._lookups[req_id] = lookup
        return (local + lookup.hit_blocks) * bs - num_computed_tokens if lookup.hit_blocks else 0

    def _lookup(self, request: Any, local: int, usable: int) -> _Lookup:
        """Ask kvfabric about blocks ``[local, usable)`` of ``request`` (on the lookup thread)."""
        assert self._store is not None
        keys = self._lookup_keys(request, local, usable)
        before = self._store.stats()["control_rpcs"]
        # An unreachable or failing controller answers 0 (the store counts and logs it).
        hits = self._store.batched_contains(keys) // len(self._layouts)
        self.counters.update(
            lookups=1,
            lookup_blocks=usable - local,
            lookup_hit_blocks=hits,
            lookup_control_rpcs=self._store.stats()["control_rpcs"] - before,
        )
        descriptors = self._hit_descriptors(keys[: hits * len(self._layouts)])
        return _Lookup(local, hits, usable - local, descriptors)

    def _hit_descriptors(self, keys: list[bytes]) -> dict[Rank, list[bytes]]:
        """The lookup's descriptors of ``keys`` (interleaved by rank), split per rank."""
        assert self._store is not None
        found = self._store.prefetched(keys)
        ranks = list(self._layouts)
        per_rank: dict[Rank, list[bytes]] = {rank: [] for rank in ranks}
        for i, descriptor in enumerate(found):
            if descriptor is None:  # expired meanwhile: the worker resolves what is missing
                return {}
            per_rank[ranks[i % len(ranks)]].append(descriptor.to_bytes())
        return per_rank

    # -- request state -------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (in block order) for ``request``; plan its load.

        Called again, without a lookup, once the request's load is done (vLLM allocates
        its remaining blocks then): nothing changes.
        """
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            state = self._requests.get(request.request_id)
            if state is not None:
                # After its load (whose errors came with it), or resumed: its state stands,
                # but the load's blocks are plain blocks of the request from now on.
                state.load_block_ids = ()
                return
            # Resumed without a lookup: what it computed before was offered for saving then.
            done = request.num_computed_tokens // self._block_size
            lookup = _Lookup(done, 0)
        loaded = max(num_external_tokens, 0) // self._block_size
        if lookup.asked_blocks:
            self.counters.update(hit_blocks=loaded, miss_blocks=lookup.asked_blocks - loaded)
        state = _RequestState(request, stored_upto=lookup.local_blocks + lookup.hit_blocks)
        self._requests[request.request_id] = state
        if not loaded:
            return
        end = lookup.local_blocks + loaded
        state.load_start = lookup.local_blocks
        state.load_block_ids = tuple(block_ids[lookup.local_blocks : end])
        count = end - lookup.local_blocks
        self._pending_loads.append(
            Transfer(
                req_id=request.request_id,
                cache_salt=request.cache_salt,
                block_hashes=tuple(request.block_hashes[lookup.local_blocks : end]),
                block_ids=state.load_block_ids,
                descriptors=tuple(
                    (rank, tuple(wire[:count])) for rank, wire in lookup.descriptors.items()
                ),
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        """This step's loads, and the blocks that become full in it (saves)."""
        meta = KVFabricMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._step_wait_left = self._lookup_wait
        if self._store is None or not self._layouts:
            return meta
        scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for req_id, computed_before in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            # After this step the KV of every position below `computed` is in the cache.
            computed = computed_before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(computed // self._block_size, len(state.request.block_hashes))
            if full <= state.stored_upto:
                continue
            block_ids = self._block_ids_of(req_id)
            meta.saves.append(
                Transfer(
                    req_id=req_id,
                    cache_salt=state.request.cache_salt,
                    block_hashes=tuple(state.request.block_hashes[state.stored_upto : full]),
                    block_ids=tuple(block_ids[state.stored_upto : full]),
                    engine=self._engine_view(state.request, state.stored_upto, full),
                )
            )
            state.stored_upto = full
        return meta

    def _engine_view(self, request: Any, start: int, end: int) -> EngineView:
        """vLLM's view of blocks ``start`` to ``end`` of ``request``, for the KV events."""
        bs = self._block_size
        lora = request.lora_request
        return EngineView(
            parent=request.block_hashes[start - 1] if start else None,
            token_ids=tuple(request.all_token_ids[start * bs : end * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
        )

    def update_connector_output(self, invalid_block_ids: set[int]) -> None:
        """The workers could not load ``invalid_block_ids``: vLLM recomputes them."""
        if not invalid_block_ids:
            return
        self.counters.add("invalid_blocks_reported", len(invalid_block_ids))
        # vLLM recomputes from the first bad block; offer the recomputed blocks for saving
        # again (the worker dropped the bad records, and dedup makes intact ones free).
        for req_id, state in self._requests.items():
            for i, block_id in enumerate(state.load_block_ids):
                if block_id in invalid_block_ids:
                    state.stored_upto = min(state.stored_upto, state.load_start + i)
                    self._load_failed.add(req_id)
                    break

    def request_finished(self, req_id: str) -> None:
        """Forget the request (its saves were copied out when they were issued)."""
        self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._asking.pop(req_id, None)  # a lookup under way ends unread
        self._load_failed.discard(req_id)

    def take_stats(self) -> KVFabricConnectorStats | None:
        """What the lookups found since the last call, as vLLM's connector stats."""
        return self._stats.take()

    def shutdown(self) -> None:
        """Stop the lookup thread and close the store."""
        if self._lookup_thread is not None:
            self._lookup_thread.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()
            self._store = None
