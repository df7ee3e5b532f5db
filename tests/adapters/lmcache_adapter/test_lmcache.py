"""The LMCache adapter against real lmcache==0.5.6 on CPU and real kvfabric processes.

LMCache builds the plugin backend itself, from the documented configuration, through its
``StorageManager`` (which calls ``CreateStorageBackends``); the tests drive it through the
calls an engine makes — the manager's lookups and reads, and the ``RemoteBackend`` the
manager holds — with ``MemoryObj`` s from LMCache's own allocator, filled with random bytes.
Every engine checks on close that no ``MemoryObj`` leaked or was released twice.

``KVFABRIC_ADAPTER_INDEX=redis`` (or ``redis-cluster``) runs the same tests against data
nodes registered with the redis index, no controller: only the store URL changes
(``adapter_deployment``). The tests whose outcome depends on that index are marked
``per_index``: the tox env runs those a second time, on Redis Cluster.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_LMCACHE"):  # tox's lmcache env sets it: no skipping
    pytest.importorskip("lmcache", reason="needs kvfabric[lmcache] (tox -e lmcache)")

import torch
from adapter_deployment import LOOKUP_RPCS, Deployment, controller_rpcs, deployment
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager, EventStatus, EventType
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.storage_manager import StorageManager

from kvfabric.adapters.lmcache import (
    KVFabricAdapter,
    KVFabricConnector,
    _Lookups,
    fold_cache_key,
)
from kvfabric.adapters.lmcache_hashing import chunk_hash_problem
from kvfabric.testing import Cluster, free_port, wait_for

CHUNK = 16  # tokens per chunk
KV_SHAPE = (2, 2, CHUNK, 4, 8)  # layers, K/V, tokens, heads, head size: 4 KiB per bf16 chunk
REMOTE = "RemoteBackend-kvfabric"


# -- harness ------------------------------------------------------------------------------------


def plugin_config(url: str, plugin: str = "kvfabric", **extra: Any) -> dict[str, Any]:
    """The configuration docs/lmcache.md shows, as LMCache's extra_config."""
    return {
        f"remote_storage_plugin.{plugin}.module_path": "kvfabric.adapters.lmcache",
        f"remote_storage_plugin.{plugin}.class_name": "KVFabricAdapter",
        f"remote_storage_plugin.{plugin}.url": url,
        **extra,
    }


def lmcache_config(extra_config: dict[str, Any], **options: Any) -> Any:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,  # LMCache still makes its CPU backend: it is the allocator
        max_local_cpu_size=0.05,
        remote_serde="naive",
        save_unfull_chunk=True,
        enable_async_loading=True,
        **{"remote_storage_plugins": ["kvfabric"], "extra_config": extra_config, **options},
    )


def lmcache_metadata(model: str, world_size: int = 1, worker_id: int = 0) -> Any:
    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )


class _LookupServer:
    """Stands in for vLLM's scheduler side: records what each async lookup retrieved."""

    def __init__(self) -> None:
        self.responses: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, retrieved_tokens: int) -> None:
        self.responses[lookup_id] = retrieved_tokens


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Engine:
    """LMCache's storage side as an engine runs it, over the kvfabric plugin."""

    def __init__(
        self,
        url: str,
        *,
        save_chunk_meta: bool = True,
        model: str | None = None,
        world_size: int = 1,
        worker_id: int = 0,
        **options: Any,
    ) -> None:
        self.model = model or f"test/{uuid.uuid4().hex[:8]}"  # keys of one test only
        self.metadata = lmcache_metadata(self.model, world_size, worker_id)
        config = plugin_config(url, save_chunk_meta=save_chunk_meta)
        self.config = lmcache_config(config, **options)
        self.lookups = _LookupServer()
        self.events = EventManager()
        self.manager = StorageManager(
            self.config, self.metadata, self.events, async_lookup_server=self.lookups
        )
        self.remote = self.manager.storage_backends[REMOTE]
        self.cpu = self.manager.storage_backends["LocalCPUBackend"]
        self.connector: KVFabricConnector = self.remote.connection.getWrappedConnector()
        self._owned: list[Any] = []

    # keys and chunks

    def key(self, chunk_hash: int) -> Any:
        return CacheEngineKey(
            self.model,
            self.metadata.world_size,
            self.metadata.worker_id,
            chunk_hash,
            torch.bfloat16,
        )

    def keys(self, n: int, start: int = 0) -> list[Any]:
        return [self.key(start + i) for i in range(n)]

    def chunk(self, tokens: int = CHUNK) -> Any:
        """A chunk of random KV bytes from LMCache's allocator (this test's reference)."""
        shapes = self.metadata.get_shapes(num_tokens=tokens)
        obj = self.cpu.allocate(shapes, self.metadata.get_dtypes())
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape, dtype=torch.float32))
        return self.own(obj)

    def own(self, obj: Any) -> Any:
        """Take ownership of an object LMCache handed over; released when the engine closes."""
        if obj is not None:
            self._owned.append(obj)
        return obj

    # what an engine does

    def put(self, key: Any, obj: Any) -> None:
        self.remote.submit_put_task(key, obj).result(timeout=30)

    def put_all(self, keys: Sequence[Any], objs: Sequence[Any]) -> None:
        """LMCache's batched put (fire and forget); returns once the connector has returned."""
        self.remote.batched_submit_put_task(list(keys), list(objs))
        # The backend holds one reference per object until the write is done.
        wait_for("the batched put finished", lambda: all(o.get_ref_count() == 1 for o in objs))

    def lookup(self, keys: Sequence[Any]) -> tuple[int, dict[str, Any]]:
        """The sync lookup: hits and which backend holds them."""
        hits, mapping = self.manager.batched_contains(list(keys))
        return int(hits), mapping

    def retrieve(self, keys: Sequence[Any]) -> list[Any]:
        """The sync read of what a lookup found in the kvfabric backend."""
        return [self.own(o) for o in self.manager.batched_get(list(keys), location=REMOTE)]

    def lookup_and_prefetch(self, lookup_id: str, keys: Sequence[Any]) -> list[Any]:
        """The async path (lookup_id): LMCache looks up, then reads the hits on its loop."""
        cum = [i * CHUNK for i in range(len(keys) + 1)]
        self.run(self.manager.async_lookup_and_prefetch(lookup_id, list(keys), cum))
        wait_for("the async lookup responded", lambda: lookup_id in self.lookups.responses)
        if self.events.get_event_status(EventType.LOADING, lookup_id) != EventStatus.DONE:
            return []  # nothing found: LMCache answered without loading
        task = self.events.pop_event(EventType.LOADING, lookup_id)
        return [self.own(obj) for tier in task.result() for _, obj in tier]

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on LMCache's storage loop, as LMCache does."""
        return asyncio.run_coroutine_threadsafe(coro, self.manager.loop).result(timeout)

    def active_objects(self) -> int:
        return int(self.cpu.memory_allocator.pin_allocator.num_active_allocations)

    def close(self) -> None:
        for obj in self._owned:
            obj.ref_count_down()
        self._owned.clear()
        gc.collect()
        # Everything the connector allocated went back to LMCache (or to us, released above).
        wait_for("every MemoryObj freed", self.active_objects, until=lambda n: n == 0)
        self.manager.close()


def same_bytes(a: Any, b: Any) -> bool:
    """Same shape, dtype and format, and the same bytes."""
    return bool(
        a.get_shapes() == b.get_shapes()
        and a.get_dtypes() == b.get_dtypes()
        and a.get_memory_format() == b.get_memory_format()
        and a.byte_array.tobytes() == b.byte_array.tobytes()
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with deployment(nodes=1) as d:
        yield d.cluster


@pytest.fixture(autouse=True)
def memory_warnings() -> Iterator[_LogCapture]:
    """Fails a test after which LMCache reports a leaked or doubly released MemoryObj."""
    capture = _LogCapture()
    logger = logging.getLogger("lmcache.v1.memory_management")
    logger.addHandler(capture)
    try:
        yield capture
        gc.collect()
        leaks = [m for m in capture.messages if "garbage collected" in m or "negative" in m]
        assert not leaks, leaks
    finally:
        logger.removeHandler(capture)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(url: str, **kwargs: Any) -> Engine:
        engine = Engine(url, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


# -- loading ------------------------------------------------------------------------------------


def test_create_storage_backends_builds_the_plugin_backend_from_the_documented_config(
    cluster: Cluster,
) -> None:
    config = lmcache_config(plugin_config(cluster.url()))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        backends = CreateStorageBackends(config, lmcache_metadata("test/create"), loop)
        assert list(backends) == ["LocalCPUBackend", REMOTE]
        connector = backends[REMOTE].connection.getWrappedConnector()
        assert isinstance(connector, KVFabricConnector)
        assert connector.url == cluster.url()
        assert connector.plugin_name == "kvfabric"
        wrapper = backends[REMOTE].connection
        assert all(
            getattr(wrapper, f"support_{name}")()
            for name in (
                "ping",
                "batched_get",
                "batched_put",
                "batched_async_contains",
                "batched_get_non_blocking",
            )
        )
        assert connector.support_batched_contains()
        for backend in reversed(backends.values()):
            backend.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_adapter_takes_its_plugin_urls_and_kvfabric_urls_only() -> None:
    adapter = KVFabricAdapter()
    for url in ("plugin://kvfabric", "plugin://kvfabric.primary", "kvfabric://10.0.0.1:7100"):
        assert adapter.can_parse(url), url
    for url in ("plugin://kvfabricx", "plugin://redis", "redis://h:1", "embedded://", "fs:///x"):
        assert not adapter.can_parse(url), url


def test_a_plugin_instance_reads_its_own_url_and_falls_back_to_the_type_url(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    extra = {
        **plugin_config("kvfabric://127.0.0.1:1", plugin="kvfabric.a"),
        **plugin_config(cluster.url(), plugin="kvfabric.b"),
        "remote_storage_plugin.kvfabric.url": cluster.url(),
    }
    del extra["remote_storage_plugin.kvfabric.b.url"]
    config = lmcache_config(extra, remote_storage_plugins=["kvfabric.a", "kvfabric.b"])
    manager = StorageManager(config, lmcache_metadata("test/instances"), EventManager())
    try:
        a = manager.storage_backends["RemoteBackend-kvfabric.a"].connection.getWrappedConnector()
        b = manager.storage_backends["RemoteBackend-kvfabric.b"].connection.getWrappedConnector()
        assert (a.plugin_name, a.url) == ("kvfabric.a", "kvfabric://127.0.0.1:1")
        assert (b.plugin_name, b.url) == ("kvfabric.b", cluster.url())
    finally:
        manager.close()


def test_legacy_remote_url_may_name_the_store_directly(cluster: Cluster) -> None:
    config = lmcache_config(plugin_config(cluster.url()), remote_url=cluster.url())
    manager = StorageManager(config, lmcache_metadata("test/legacy"), EventManager())
    try:
        connector = manager.storage_backends["RemoteBackend"].connection.getWrappedConnector()
        assert isinstance(connector, KVFabricConnector)
        assert connector.url == cluster.url()
    finally:
        manager.close()


def test_importing_and_connecting_need_no_running_kvfabric(
    engines: Callable[..., Engine],
) -> None:
    code = "import kvfabric.adapters.lmcache as m; print(m.KVFabricAdapter.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "KVFabricAdapter"
    nobody = f"kvfabric://127.0.0.1:{free_port()}?control_timeout=200ms"
    engine = engines(nobody)
    keys = engine.keys(3)
    assert engine.lookup(keys) == (0, {})
    assert engine.run(engine.connector.ping()) != 0


# -- round trips --------------------------------------------------------------------------------

LAYOUTS = [pytest.param(True, id="save_chunk_meta"), pytest.param(False, id="raw")]


@pytest.mark.per_index
@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_put_contains_get_round_trip_is_byte_exact(
    cluster: Cluster, engines: Callable[..., Engine], save_chunk_meta: bool
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    key, chunk = engine.key(7), engine.chunk()
    assert not engine.remote.contains(key)
    engine.put(key, chunk)
    assert chunk.get_ref_count() == 1  # the put took nothing of ours
    assert engine.remote.contains(key)
    got = engine.own(engine.remote.get_blocking(key))
    assert got is not None
    assert got is not chunk
    assert got.get_ref_count() == 1  # ours now
    assert same_bytes(got, chunk)


@pytest.mark.per_index
@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_batched_put_then_lookup_counts_the_prefix_up_to_a_gap(
    cluster: Cluster, engines: Callable[..., Engine], save_chunk_meta: bool
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    keys = engine.keys(8)
    chunks = [engine.chunk() for _ in keys]
    stored = [i for i in range(8) if i != 3]  # chunk 3 was never stored
    engine.put_all([keys[i] for i in stored], [chunks[i] for i in stored])
    assert engine.remote.batched_contains(keys) == 3
    assert engine.lookup(keys) == (3, {REMOTE: keys[:3]})
    assert engine.lookup(keys[4:]) == (4, {REMOTE: keys[4:]})
    got = engine.retrieve(keys[:3])
    assert all(same_bytes(g, c) for g, c in zip(got, chunks[:3], strict=True))
    # The backend's batched read reports a miss in place and still reads the others.
    got = [engine.own(o) for o in engine.remote.batched_get_blocking(keys[2:5])]
    assert got[1] is None
    assert same_bytes(got[0], chunks[2])
    assert same_bytes(got[2], chunks[4])


@pytest.mark.per_index
@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_lookup_id_path_retrieves_the_leading_hits(
    cluster: Cluster, engines: Callable[..., Engine], save_chunk_meta: bool
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    keys = engine.keys(6)
    chunks = [engine.chunk() for _ in keys]
    engine.put_all(keys[:4], chunks[:4])
    got = engine.lookup_and_prefetch("req-1", keys)
    assert engine.lookups.responses["req-1"] == 4 * CHUNK
    assert all(same_bytes(g, c) for g, c in zip(got, chunks[:4], strict=True))
    assert engine.lookup_and_prefetch("req-2", keys[4:]) == []
    assert engine.lookups.responses["req-2"] == 0


@pytest.mark.per_index
@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_get_non_blocking_frees_the_hits_after_a_miss(
    cluster: Cluster, engines: Callable[..., Engine], save_chunk_meta: bool
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    keys = engine.keys(4)
    chunks = [engine.chunk() for _ in keys]
    engine.put_all([keys[0], keys[2], keys[3]], [chunks[0], chunks[2], chunks[3]])
    got = [engine.own(o) for o in engine.run(engine.remote.batched_get_non_blocking("x", keys))]
    assert len(got) == 1
    assert same_bytes(got[0], chunks[0])
    # Chunks 2 and 3 were read too; LMCache cannot take them, the connector freed them
    # (checked when the engine closes).


@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_partial_last_chunk_round_trips_with_its_shape(
    cluster: Cluster, engines: Callable[..., Engine], save_chunk_meta: bool
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    keys = engine.keys(3)
    chunks = [engine.chunk(), engine.chunk(), engine.chunk(tokens=5)]
    engine.put_all(keys, chunks)
    assert engine.lookup(keys)[0] == 3
    for got in (engine.retrieve(keys), engine.lookup_and_prefetch("req", keys)):
        assert [tuple(g.tensor.shape) for g in got] == [(2, 2, CHUNK, 32)] * 2 + [(2, 2, 5, 32)]
        assert all(same_bytes(g, c) for g, c in zip(got, chunks, strict=True))
        assert got[2].get_size() == 5 * chunks[0].get_size() // CHUNK
        assert tuple(got[2].get_tensor(0).shape) == (2, 2, 5, 32)  # what GPU connectors read


@pytest.mark.per_index
def test_remove_makes_the_chunk_miss(cluster: Cluster, engines: Callable[..., Engine]) -> None:
    engine = engines(cluster.url())
    key = engine.key(1)
    engine.put(key, engine.chunk())
    assert engine.remote.remove(key)
    assert not engine.remote.contains(key)
    assert engine.remote.get_blocking(key) is None
    assert not engine.remote.remove(key)


@pytest.mark.per_index
def test_list_names_the_chunks_this_connector_stored_that_are_still_there(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    engine = engines(cluster.url())
    keys = engine.keys(3)
    engine.put_all(keys, [engine.chunk() for _ in keys])
    assert engine.remote.remove(keys[1])
    names = engine.run(engine.remote.connection.list())
    assert sorted(names) == sorted(k.to_string() for k in (keys[0], keys[2]))


@pytest.mark.per_index
def test_ping_answers_zero_while_the_controller_answers(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    engine = engines(cluster.url())
    assert engine.run(engine.remote.connection.ping()) == 0


# -- keys ---------------------------------------------------------------------------------------


def test_ranks_models_dtypes_and_tags_never_share_a_key_while_equal_chunks_do() -> None:
    base = CacheEngineKey("org/model", 2, 0, 12345, torch.bfloat16)
    variants = [
        CacheEngineKey("org/model", 2, 1, 12345, torch.bfloat16),  # another TP rank
        CacheEngineKey("org/model", 4, 0, 12345, torch.bfloat16),  # another world size
        CacheEngineKey("org/other", 2, 0, 12345, torch.bfloat16),  # another model
        CacheEngineKey("org/model", 2, 0, 12345, torch.float16),  # another dtype
        CacheEngineKey("org/model", 2, 0, 12345, torch.bfloat16, {"lmcache.tag.user": "a"}),
        CacheEngineKey("org/model", 2, 0, 12346, torch.bfloat16),  # another chunk
    ]
    folded = {fold_cache_key(k, "meta") for k in [base, *variants]}
    assert len(folded) == 1 + len(variants)
    assert fold_cache_key(base, "raw") != fold_cache_key(base, "meta")
    again = CacheEngineKey("org/model", 2, 0, 12345, torch.bfloat16, {"unrelated": 1})
    assert fold_cache_key(again, "meta") == fold_cache_key(base, "meta")
    tagged = [
        CacheEngineKey(
            "m", 1, 0, 1, torch.bfloat16, {"lmcache.tag.a": "b@c", "lmcache.tag.d": "e"}
        ),
        CacheEngineKey(
            "m", 1, 0, 1, torch.bfloat16, {"lmcache.tag.a": "b", "lmcache.tag.c@d": "e"}
        ),
    ]
    assert tagged[0].to_string() == tagged[1].to_string()  # a fold of the string would collide
    assert fold_cache_key(tagged[0], "raw") != fold_cache_key(tagged[1], "raw")
    # Exactly LMCache's equality: tag order and tag value types count.
    reordered = CacheEngineKey(
        "m", 1, 0, 1, torch.bfloat16, {"lmcache.tag.d": "e", "lmcache.tag.a": "b@c"}
    )
    assert reordered != tagged[0]
    assert fold_cache_key(reordered, "raw") != fold_cache_key(tagged[0], "raw")
    typed = [CacheEngineKey("m", 1, 0, 1, torch.bfloat16, {"lmcache.tag.n": v}) for v in (1, "1")]
    assert fold_cache_key(typed[0], "raw") != fold_cache_key(typed[1], "raw")


def test_chunk_hashes_of_any_sign_and_width_fold_to_distinct_keys(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    hashes = [0, 1, -1, 255, -256, 2**63, -(2**63), 2**64 - 1, -(2**64), 2**256 - 1, -(2**255)]
    keys = [CacheEngineKey("m", 1, 0, h, torch.bfloat16) for h in hashes]
    assert len({fold_cache_key(k, "meta") for k in keys}) == len(hashes)
    engine = engines(cluster.url())
    keys = [engine.key(h) for h in (-1, 2**64 - 1, -(2**255), 2**256 - 1)]
    chunks = [engine.chunk() for _ in keys]
    engine.put_all(keys, chunks)
    got = engine.retrieve(keys)
    assert all(same_bytes(g, c) for g, c in zip(got, chunks, strict=True))


@pytest.mark.per_index
def test_tp_ranks_keep_their_own_chunks_and_equal_chunks_are_stored_once(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    model = f"test/{uuid.uuid4().hex[:8]}"
    rank0 = engines(cluster.url(), model=model, world_size=2, worker_id=0)
    rank1 = engines(cluster.url(), model=model, world_size=2, worker_id=1)
    chunks = [rank0.chunk(), rank1.chunk()]
    rank0.put(rank0.key(42), chunks[0])
    rank1.put(rank1.key(42), chunks[1])  # the same chunk hash, another rank's KV
    assert same_bytes(rank0.own(rank0.remote.get_blocking(rank0.key(42))), chunks[0])
    assert same_bytes(rank1.own(rank1.remote.get_blocking(rank1.key(42))), chunks[1])
    # Another engine of rank 0 (another vLLM instance) offers the same chunk: stored once.
    twin = engines(cluster.url(), model=model, world_size=2, worker_id=0)
    before = twin.connector.store.stats()
    twin.put(twin.key(42), twin.chunk())
    after = twin.connector.store.stats()
    assert after["dedup_hits"] - before["dedup_hits"] == 1
    assert after["payload_bytes_written"] == before["payload_bytes_written"]


# -- counted ------------------------------------------------------------------------------------


def _rpcs(cluster: Cluster, engine: Engine) -> tuple[int, int]:
    return controller_rpcs(cluster), engine.connector.store.stats()["control_rpcs"]


@pytest.mark.per_index
@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
@pytest.mark.parametrize("path", ["sync", "lookup_id"])
def test_lookup_of_n_chunks_and_their_retrieval_cost_no_control_rpc(
    cluster: Cluster, engines: Callable[..., Engine], path: str, save_chunk_meta: bool
) -> None:
    n = 32
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta)
    keys = engine.keys(n)
    chunks = [engine.chunk() for _ in keys]
    engine.put_all(keys, chunks)
    controller_before, client_before = _rpcs(cluster, engine)
    if path == "sync":
        assert engine.lookup(keys) == (n, {REMOTE: keys})
        got = engine.retrieve(keys)
    else:
        got = engine.lookup_and_prefetch("req-counted", keys)
        assert engine.lookups.responses["req-counted"] == n * CHUNK
    controller_after, client_after = _rpcs(cluster, engine)
    assert all(same_bytes(g, c) for g, c in zip(got, chunks, strict=True))
    # The lookup reads the controller's lookup image (Redis: one round); the retrieval uses
    # its descriptors.
    assert controller_after - controller_before == 0
    assert client_after - client_before == LOOKUP_RPCS


@pytest.mark.per_index
def test_a_lookup_id_read_uses_its_lookups_descriptors_after_others_pushed_them_out(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    # A prefetch cache of 8 entries, shared by every lookup of the connector.
    engine = engines(cluster.url(prefetch_entries="8"))
    mine, others = engine.keys(4), engine.keys(8, start=100)
    chunks = [engine.chunk() for _ in mine]
    engine.put_all(mine, chunks)
    engine.put_all(others, [engine.chunk() for _ in others])
    remote = engine.remote
    controller_before, client_before = _rpcs(cluster, engine)
    assert engine.run(remote.batched_async_contains("mine", mine)) == 4
    assert engine.run(remote.batched_async_contains("others", others)) == 8  # pushes mine out
    got = [engine.own(o) for o in engine.run(remote.batched_get_non_blocking("mine", mine))]
    controller_after, client_after = _rpcs(cluster, engine)
    assert all(same_bytes(g, c) for g, c in zip(got, chunks, strict=True))
    # The two lookups read the lookup image (Redis: a round each); the read asked nothing.
    assert controller_after - controller_before == 0
    assert client_after - client_before == 2 * LOOKUP_RPCS


def test_a_chunk_of_another_layout_round_trips_with_its_header(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    # A layerwise chunk: one layer, tokens first. Only save_chunk_meta can carry its shape.
    engine = engines(cluster.url(), save_chunk_meta=True)
    layer = engine.own(
        engine.cpu.allocate(torch.Size([CHUNK, 2, 32]), torch.bfloat16, fmt=MemoryFormat.KV_T2D)
    )
    layer.tensor.copy_(torch.randn(layer.tensor.shape))
    key = LayerCacheEngineKey(engine.model, 1, 0, 77, torch.bfloat16, layer_id=1)
    engine.put(key, layer)
    assert engine.remote.contains(key)
    assert not engine.remote.contains(engine.key(77))  # the chunk's own key is another key
    got = engine.own(engine.remote.get_blocking(key))
    assert got.get_memory_format() == MemoryFormat.KV_T2D
    assert same_bytes(got, layer)


# -- threads, memory and faults -----------------------------------------------------------------


def test_coroutines_leave_blocking_work_to_worker_threads(
    cluster: Cluster, engines: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines(cluster.url())
    store = engine.connector.store
    threads: list[str] = []

    def recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return call

    for name in ("batched_contains", "batched_exists", "batched_get", "batched_put", "ping"):
        monkeypatch.setattr(store, name, recorded(getattr(store, name)))
    keys = engine.keys(4)
    engine.put_all(keys, [engine.chunk() for _ in keys])
    engine.put(engine.key(9), engine.chunk())
    engine.lookup_and_prefetch("req", keys)
    engine.own(engine.remote.get_blocking(keys[0]))
    assert engine.remote.contains(keys[1])
    assert engine.run(engine.remote.connection.ping()) == 0
    assert len(threads) >= 7
    assert all(name.startswith("kvfabric-lmcache") for name in threads), threads


@pytest.mark.per_index
def test_lookups_and_reads_from_many_threads_stay_byte_exact(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    engine = engines(cluster.url())
    keys = engine.keys(8)
    chunks = [engine.chunk() for _ in keys]
    engine.put_all(keys, chunks)
    errors: list[str] = []

    def worker(n: int) -> None:
        for i in range(10):
            hits, _ = engine.lookup(keys)
            got = engine.retrieve(keys[:hits])
            if hits != 8 or not all(same_bytes(g, c) for g, c in zip(got, chunks, strict=True)):
                errors.append(f"thread {n} round {i}: {hits} hits")
            lookup_id = f"req-{n}-{i}"
            if len(engine.lookup_and_prefetch(lookup_id, keys)) != 8:
                errors.append(f"thread {n} round {i}: async lookup short")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


@pytest.mark.parametrize("save_chunk_meta", LAYOUTS)
def test_a_get_lmcache_gave_up_on_frees_what_it_allocated(
    cluster: Cluster,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    save_chunk_meta: bool,
) -> None:
    engine = engines(cluster.url(), save_chunk_meta=save_chunk_meta, blocking_timeout_secs=1)
    keys = engine.keys(2)
    engine.put_all(keys, [engine.chunk() for _ in keys])
    store = engine.connector.store
    slow_get = store.batched_get
    finished = threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2.0)  # past LMCache's 1 s timeout: it cancels the get and moves on
        try:
            return slow_get(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(store, "batched_get", slow)
    owned = engine.active_objects()
    assert engine.remote.batched_get_blocking(keys) == [None, None]
    wait_for("the read LMCache gave up on finished", finished.is_set)
    wait_for(
        "the abandoned read's objects freed", engine.active_objects, until=lambda n: n == owned
    )


@pytest.fixture
def lonely_deployment() -> Iterator[Deployment]:
    """A deployment of its own, for a test that kills its index (and starts it again: on
    one Redis server, where it is the redis index)."""
    with deployment(nodes=1, single_redis=True) as d:
        yield d


@pytest.mark.per_index
def test_controller_outage_reads_as_misses_not_exceptions(
    lonely_deployment: Deployment, engines: Callable[..., Engine]
) -> None:
    cluster = lonely_deployment.cluster
    # Lookups by RPC: with the lookup image they answer from it for a moment after the crash.
    engine = engines(cluster.url(control_timeout="300ms", retry_interval="300ms", lookup_image="0"))
    keys = engine.keys(4)
    chunks = [engine.chunk() for _ in keys]
    engine.put_all(keys, chunks)
    backend_log = _LogCapture()
    logging.getLogger("lmcache.v1.storage_backend.remote_backend").addHandler(backend_log)
    try:
        lonely_deployment.kill_index()
        conn = engine.connector
        # What the engine sees: misses everywhere.
        assert engine.lookup(keys) == (0, {})
        assert engine.lookup_and_prefetch("req-down", keys) == []
        assert not engine.remote.contains(keys[0])
        assert engine.remote.get_blocking(keys[0]) is None
        assert engine.remote.batched_get_blocking(keys) == [None] * 4
        engine.put(engine.key(99), engine.chunk())  # dropped, without an error
        assert not engine.remote.remove(keys[0])
        # What the connector itself answers: values, never exceptions.
        assert conn.batched_contains(keys) == 0
        assert not conn.exists_sync(keys[0])
        assert not engine.run(conn.exists(keys[0]))
        assert engine.run(conn.batched_async_contains("r", keys)) == 0
        assert engine.run(conn.batched_get_non_blocking("r", keys)) == []
        assert engine.run(conn.get(keys[0])) is None
        assert engine.run(conn.list()) == []
        assert engine.run(conn.ping()) != 0
        # LMCache's backend never caught an exception from the connector.
        assert not [m for m in backend_log.messages if "fail" in m or "Error" in m]
    finally:
        logging.getLogger("lmcache.v1.storage_backend.remote_backend").removeHandler(backend_log)
    # The controller comes back: the connector recovers by itself. (Whether the restarted
    # controller relearns the other chunks from the node is the controller's business.)
    lonely_deployment.start_index()
    cluster.wait_nodes(1)
    wait_for("ping answered 0", lambda: engine.run(engine.connector.ping()), until=lambda n: n == 0)
    engine.put(keys[0], chunks[0])
    assert engine.lookup(keys[:1]) == (1, {REMOTE: keys[:1]})
    assert same_bytes(engine.retrieve(keys[:1])[0], chunks[0])


def test_a_chunk_over_the_stores_max_value_is_not_stored_and_raises_nothing(
    cluster: Cluster, engines: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = engines(cluster.url(max_value="1KiB"))  # a chunk here is 4 KiB
    key = engine.key(1)
    with caplog.at_level(logging.ERROR, "kvfabric.lmcache"):
        engine.put(key, engine.chunk())
    assert "max_value" in caplog.text
    assert engine.lookup([key]) == (0, {})


def test_a_closed_connector_answers_misses(
    cluster: Cluster, engines: Callable[..., Engine]
) -> None:
    engine = engines(cluster.url())
    keys = engine.keys(2)
    engine.put_all(keys, [engine.chunk() for _ in keys])
    conn = engine.connector
    engine.run(conn.close())
    assert conn.batched_contains(keys) == 0
    assert engine.run(conn.batched_async_contains("r", keys)) == 0
    assert engine.run(conn.batched_get(keys)) == [None, None]
    assert engine.run(conn.batched_get_non_blocking("r", keys)) == []
    engine.put(engine.key(5), engine.chunk())
    assert not conn.remove_sync(keys[0])
    assert engine.run(conn.list()) == []
    assert engine.run(conn.ping()) != 0


# -- lookup state -------------------------------------------------------------------------------


def test_lookup_state_is_bounded_and_expires() -> None:
    now = [0.0]
    lookups = _Lookups(max_entries=3, ttl=10.0, clock=lambda: now[0])
    for i in range(5):
        lookups.remember(f"req-{i}", [i], [bytes([i]) * 32], [None])
    assert len(lookups) == 3  # the oldest made room
    assert lookups.take("req-0") is None
    found = lookups.take("req-4")
    assert found is not None
    assert found.keys == [4]
    assert lookups.take("req-4") is None  # a read takes its lookup
    now[0] = 10.0
    assert lookups.take("req-3") is None  # expired
    lookups.remember("req-5", [5], [b"5" * 32], [None])
    assert len(lookups) == 1  # expired entries leave when new ones come


# -- chunk keys across engine processes ---------------------------------------------------------


def kvfabric_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvfabric.lmcache" and r.levelno == level
    ]


def test_lmcaches_default_hash_without_pythonhashseed_warns_with_the_fix(
    cluster: Cluster,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # tox sets one
    with caplog.at_level(logging.INFO, "kvfabric.lmcache"):
        engines(cluster.url())  # pre_caching_hash_algorithm: builtin, LMCache's default
    (warning,) = kvfabric_records(caplog, logging.WARNING)
    assert "Python's hash() (pre_caching_hash_algorithm: builtin" in warning
    assert "no other engine process finds the chunks this one stores" in warning
    assert "same PYTHONHASHSEED" in warning


def test_a_seeded_engine_process_is_not_warned_and_is_told_the_seed(
    cluster: Cluster,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with caplog.at_level(logging.INFO, "kvfabric.lmcache"):
        engines(cluster.url())
    assert kvfabric_records(caplog, logging.WARNING) == []
    assert any("PYTHONHASHSEED=0" in m for m in kvfabric_records(caplog, logging.INFO))


def test_sha256_cbor_without_vllm_installed_is_still_pythons_hash_and_warns(
    cluster: Cluster,
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # This env has no vLLM, and LMCache takes sha256_cbor from vLLM: it falls back to hash().
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.INFO, "kvfabric.lmcache"):
        engines(cluster.url(), pre_caching_hash_algorithm="sha256_cbor")
    (warning,) = kvfabric_records(caplog, logging.WARNING)
    assert "sha256_cbor is taken from vLLM, which is not installed here" in warning


def test_chunk_hashes_are_reported_unshared_exactly_where_lmcache_salts_or_randomizes_them() -> (
    None
):
    def problem(algorithm: str, seed: str | None, vllm: bool = True) -> str | None:
        return chunk_hash_problem(algorithm, pythonhashseed=seed, vllm_installed=vllm)

    # Deterministic in every process: sha256 from vLLM, or a shared seed.
    for algorithm in ("sha256_cbor", "sha256", "sha256_cbor_64bit"):
        assert problem(algorithm, None) is None
        assert problem(algorithm, "0") is None
    for algorithm in ("builtin", "xxhash", "xxhash_cbor"):
        assert problem(algorithm, "0") is None
    # Per-process: hash() without a seed (PYTHONHASHSEED=random is no seed), xxhash unseeded.
    assert "hash() of a string" in (problem("builtin", None) or "")
    assert problem("builtin", "random") is not None
    assert "random bytes" in (problem("xxhash", None) or "")
    assert "random bytes" in (problem("xxhash_cbor", None) or "")
    assert "does not know 'md5'" in (problem("md5", None) or "")
    # Without vLLM every name is hash(), which only a seed makes safe.
    assert problem("sha256_cbor", None, vllm=False) is not None
    assert problem("sha256_cbor", "7", vllm=False) is None
    assert problem("builtin", None, vllm=False) is not None


# -- LMCache's own check ------------------------------------------------------------------------


@pytest.mark.per_index
def test_lmcache_basic_check_test_remote_passes(cluster: Cluster, tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        "chunk_size: 256\n"
        "local_cpu: false\n"
        "max_local_cpu_size: 0.1\n"
        "remote_serde: naive\n"
        'remote_url: "plugin://kvfabric"\n'
        'remote_storage_plugins: ["kvfabric"]\n'
        "extra_config:\n"
        "  remote_storage_plugin.kvfabric.module_path: kvfabric.adapters.lmcache\n"
        "  remote_storage_plugin.kvfabric.class_name: KVFabricAdapter\n"
        f'  remote_storage_plugin.kvfabric.url: "{cluster.url()}"\n'
    )
    before = _writes(cluster)
    run = subprocess.run(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_remote"],
        env={**os.environ, "LMCACHE_CONFIG_FILE": str(config)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    after = _writes(cluster)
    out = run.stdout
    print(out)  # shown with -s, and in the report of a failure
    # basic_check always exits 0: judge its output.
    assert "Test Failed" not in out + run.stderr, run.stderr[-3000:]
    assert "No adapter found" not in run.stderr
    validations = re.findall(r"Validation[^:]*: (\d+)/(\d+) passed", out)
    assert len(validations) == 5, out
    assert all(passed == total != "0" for passed, total in validations), validations
    rows = re.findall(r"^\| (EXISTS|PUT|GET)\b.*\|\s+(\d+)/(\d+) \|", out, re.MULTILINE)
    assert len(rows) == 4, out
    assert all(p == t for _, p, t in rows), rows
    # The bytes went through kvfabric (lookups read the lookup image: no RPC to count).
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def _writes(cluster: Cluster) -> tuple[int, int]:
    """Where writes got room and how often they published, as the index served them: the
    controller's calls (allocates or extent leases; publishes of grants or of records laid
    into extents), or what the redis index's arenas counted (grants, publishes)."""
    if cluster.redis:
        index = cluster.stats()["index"]
        return index["grants"], index["published"]
    controller = cluster.stats()["controller"]
    return (
        controller.get("rpc_allocate", 0) + controller.get("rpc_lease_extents", 0),
        controller.get("rpc_publish", 0) + controller.get("rpc_publish_carved", 0),
    )
