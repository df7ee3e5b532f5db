"""kvfabric as an LMCache (0.5.6) remote-storage plugin.

LMCache loads :class:`KVFabricAdapter` through its plugin mechanism (configuration only)::

    remote_storage_plugins: ["kvfabric"]
    extra_config:
      remote_storage_plugin.kvfabric.module_path: kvfabric.adapters.lmcache
      remote_storage_plugin.kvfabric.class_name: KVFabricAdapter
      remote_storage_plugin.kvfabric.url: kvfabric://127.0.0.1:7100

and the adapter builds one :class:`KVFabricConnector` per LMCache remote backend. A lookup
of N chunks and their retrieval cost one kvfabric control round trip: the lookup keeps the
descriptors it resolved (the store's prefetch cache) and the read uses them, landing each
chunk straight in the ``MemoryObj`` LMCache allocated. A kvfabric outage reads as misses.
Each connector warns at start-up when LMCache's chunk keys would differ between engine
processes (``lmcache_hashing``): nothing would be shared. See docs/lmcache.md.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric._runtime.buffers import copy_into
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.adapters.lmcache_hashing import warn_if_chunk_hashes_unshared
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ConfigError, PluginUnavailableError, ValueTooLargeError
from kvfabric.keys import fold_key, namespace_bytes
from kvfabric.urls import parse_url

# lmcache ships no type information (and is absent where only the linters run): its names
# are Any to mypy either way.
try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryObj
    from lmcache.v1.protocol import RemoteMetadata
    from lmcache.v1.storage_backend.connector import (
        ConnectorAdapter,
        ConnectorContext,
        extract_plugin_type,
    )
    from lmcache.v1.storage_backend.connector.base_connector import (
        RemoteConnector,
    )
except ImportError as exc:
    raise PluginUnavailableError(
        f"the LMCache adapter needs lmcache==0.5.6 ({exc}); install torch first "
        "(CPU: pip install torch==2.13.0), then: pip install 'kvfabric[lmcache]'"
    ) from exc

__all__ = ["PLUGIN_TYPE", "KVFabricAdapter", "KVFabricConnector", "fold_cache_key"]

log = logging.getLogger("kvfabric.lmcache")
T = TypeVar("T")

PLUGIN_TYPE = "kvfabric"
"""LMCache plugin names of type ``kvfabric`` (``kvfabric``, ``kvfabric.<instance>``) are ours."""

_MAX_LOOKUPS = 4096
"""Async lookups whose read has not come yet (LMCache never says when one is abandoned)."""
_MAX_LISTED = 65536
"""Keys this connector stored that ``list()`` can report."""
# Any fixed key: ping only needs the controller to answer a lookup.


def fold_cache_key(key: CacheEngineKey, layout: str) -> bytes:
    """The kvfabric key of an LMCache ``CacheEngineKey``.

    The namespace holds everything LMCache's own key equality compares besides the chunk
    hash (model, world size, worker id, dtype, tags in order, the layer of a layerwise key)
    plus the value ``layout``, so TP ranks, models and byte layouts never share a key while
    equal chunks of one of them do (and are stored once).
    """
    return fold_key(
        _hash_bytes(key.chunk_hash),
        _namespace(
            layout,
            key.model_name,
            key.world_size,
            key.worker_id,
            str(key.dtype),
            key.tags,
            getattr(key, "layer_id", None),
        ),
    )


def _hash_bytes(chunk_hash: int | bytes) -> bytes:
    # LMCache chunk hashes are ints of any sign and width (Python's hash() is negative half
    # the time, basic_check uses 256-bit ones): minimal two's complement is exact for all.
    if isinstance(chunk_hash, int):
        width = (chunk_hash.bit_length() + 8) // 8
        return b"i" + chunk_hash.to_bytes(width, "little", signed=True)
    return b"b" + bytes(chunk_hash)


@functools.lru_cache(maxsize=1024)
def _namespace(
    layout: str,
    model: str,
    world_size: int,
    worker_id: int,
    dtype: str,
    tags: tuple[tuple[str, Any], ...] | None,
    layer: int | None,
) -> bytes:
    parts = ["lmcache", layout, model, str(world_size), str(worker_id), dtype, str(len(tags or ()))]
    for name, value in tags or ():
        parts += [str(name), repr(value)]  # repr: LMCache tells the tag 1 from the tag "1"
    if layer is not None:
        parts.append(f"layer {layer}")
    return namespace_bytes(parts)


class _Lookup(NamedTuple):
    expires: float
    keys: list[CacheEngineKey]
    folded: list[bytes]
    descriptors: list[Descriptor | None]


class _Lookups:
    """The hits of recent async lookups, by ``lookup_id``: keys and descriptors for the read.

    LMCache never releases a lookup (a request can be dropped between its lookup and its
    read), so entries expire after ``ttl`` and the oldest make room beyond ``max_entries``.
    A read takes its lookup's entry.
    """

    def __init__(
        self, *, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[str, _Lookup] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def remember(
        self,
        lookup_id: str,
        keys: list[CacheEngineKey],
        folded: list[bytes],
        descriptors: list[Descriptor | None],
    ) -> None:
        with self._lock:
            now = self._clock()
            self._items[lookup_id] = _Lookup(now + self.ttl, keys, folded, descriptors)
            self._items.move_to_end(lookup_id)
            while self._items and (
                len(self._items) > self.max_entries
                or next(iter(self._items.values())).expires <= now
            ):
                self._items.popitem(last=False)

    def take(self, lookup_id: str) -> _Lookup | None:
        with self._lock:
            found = self._items.pop(lookup_id, None)
        if found is None or found.expires <= self._clock():
            return None
        return found


class _Stored:
    """The most recent keys this connector stored: what ``list()`` can name."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, str] = OrderedDict()

    def add(self, folded: bytes, name: str) -> None:
        with self._lock:
            self._items[folded] = name
            self._items.move_to_end(folded)
            if len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def drop(self, folded: bytes) -> None:
        with self._lock:
            self._items.pop(folded, None)

    def snapshot(self) -> tuple[list[bytes], list[str]]:
        with self._lock:
            return list(self._items), list(self._items.values())


class KVFabricConnector(RemoteConnector):  # type: ignore[misc]
    """An LMCache ``RemoteConnector`` over a kvfabric store.

    Threads: the sync calls (``batched_contains``, ``exists_sync``, ``remove_sync``) run on
    LMCache's calling thread; every coroutine hands its blocking work (control round trips,
    transfers, allocation) to a worker thread and awaits it, so LMCache's event loop never
    blocks. Lookups and transfers use separate workers: a lookup never queues behind a read.
    """

    def __init__(
        self,
        *,
        url: str,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        super().__init__(config, metadata)
        options = parse_url(url).options  # a bad URL fails here, with what is accepted
        warn_if_chunk_hashes_unshared(config)
        self.url = url
        self.plugin_name = plugin_name
        self.local_cpu_backend = local_cpu_backend
        # Records of the two layouts are not interchangeable, so they never share a key.
        self.layout = "meta" if self.save_chunk_meta else "raw"
        self.store: Store = kvfabric.connect(url)  # never needs a live controller
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvfabric-lmcache-lookup")
        self._data_pool = ThreadPoolExecutor(4, thread_name_prefix="kvfabric-lmcache-data")
        self._lookups = _Lookups(max_entries=_MAX_LOOKUPS, ttl=options.prefetch_ttl)
        self._stored = _Stored(_MAX_LISTED)
        self._closed = False
        # A layout that does not fit, or a chunk over max_value, recurs per record or
        # put: a line a minute each, with a count of the rest.
        self._limited = LimitedLog(log)

    def fold(self, key: CacheEngineKey) -> bytes:
        return fold_cache_key(key, self.layout)

    # -- what LMCache may use ----------------------------------------------------------------

    def support_ping(self) -> bool:
        return True

    def support_batched_get(self) -> bool:
        return True

    def support_batched_put(self) -> bool:
        return True

    def support_batched_contains(self) -> bool:
        return True

    def support_batched_async_contains(self) -> bool:
        return True

    def support_batched_get_non_blocking(self) -> bool:
        return True

    # -- lookups -------------------------------------------------------------------------------

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading keys are stored (one round trip; their descriptors are kept)."""
        return self._contains(keys)[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._contains([key])[0] > 0

    async def exists(self, key: CacheEngineKey) -> bool:
        hits, _ = await self._lookup(self._contains, [key])
        return hits > 0

    async def batched_async_contains(
        self, lookup_id: str, keys: Sequence[CacheEngineKey], pin: bool = False
    ) -> int:
        """Like ``batched_contains``, remembering the hits for this lookup's read.

        ``pin`` is ignored: kvfabric has no pins (LMCache's remote backend ignores them too).
        """
        hits, folded, held = await self._lookup(self._contains_holding, keys)
        if hits:
            self._lookups.remember(lookup_id, list(keys[:hits]), folded[:hits], held)
        return hits

    def _contains_holding(
        self, keys: Sequence[CacheEngineKey]
    ) -> tuple[int, list[bytes], list[Descriptor | None]]:
        hits, folded = self._contains(keys)
        # The lookup's own descriptors: the store's prefetch cache is shared by every lookup
        # of this process, and may have dropped them by the time this lookup's read comes.
        return hits, folded, self.store.prefetched(folded[:hits]) if hits else []

    def _contains(self, keys: Sequence[CacheEngineKey]) -> tuple[int, list[bytes]]:
        if self._closed or not keys:
            return 0, []
        folded = [self.fold(k) for k in keys]
        # An outage answers 0 (the store counts and logs it): a miss, never an exception.
        return self.store.batched_contains(folded), folded

    # -- reads ---------------------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        """One object per key, ``None`` for a miss; each returned object is the caller's."""
        return await self._transfer_objects(self._read, keys, None)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: Sequence[CacheEngineKey]
    ) -> builtins.list[MemoryObj]:
        """The leading run of hits among ``keys``, read with the lookup's descriptors."""
        found = self._lookups.take(lookup_id)
        if found is not None and found.keys[: len(keys)] != list(keys):
            found = None  # LMCache asks for other keys than the lookup found
        objs = await self._transfer_objects(self._read, keys, found)
        prefix: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                # LMCache takes only the leading run: the hits after a miss are ours to free.
                _release(objs[i:])
                break
            prefix.append(obj)
        return prefix

    def _read(
        self, keys: Sequence[CacheEngineKey], lookup: _Lookup | None
    ) -> builtins.list[MemoryObj | None]:
        """Land each record straight in a full-chunk object from LMCache's pool, then shape it.

        With ``save_chunk_meta`` the record's ``RemoteMetadata`` header lands in a small
        buffer of its own and the payload in the object (a scattered read: no copy).
        """
        if self._closed or not keys:
            return [None] * len(keys)
        if lookup is not None:
            folded = lookup.folded[: len(keys)]
            self.store.remember([d for d in lookup.descriptors[: len(keys)] if d is not None])
        else:
            folded = [self.fold(k) for k in keys]
        objs: list[MemoryObj] = []
        for _ in folded:
            obj = self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                break  # out of LMCache memory: the rest are misses
            objs.append(obj)
        head = self.remote_metadata_bytes if self.save_chunk_meta else 0
        headers = memoryview(bytearray(head * len(objs)))
        into: list[Any] = [o.byte_array.cast("B") for o in objs]
        if head:
            into = [[headers[i * head : (i + 1) * head], buf] for i, buf in enumerate(into)]
        try:
            # An unreachable node or controller reads as misses, like an invalid record.
            landed = self.store.batched_get(folded[: len(objs)], into=into)
        except BaseException:
            _release(objs)
            raise
        out: list[MemoryObj | None] = []
        for i, (obj, view) in enumerate(zip(objs, landed, strict=True)):
            if view is None:
                obj.ref_count_down()
                out.append(None)
            elif head:
                out.append(self._unpack(obj, headers[i * head : (i + 1) * head]))
            else:
                out.append(self._fit(obj, view.nbytes))
        return out + [None] * (len(folded) - len(objs))

    def _fit(self, obj: MemoryObj, size: int) -> MemoryObj | None:
        """The full-chunk object holding ``size`` landed bytes, shaped to them (or released)."""
        if size == self.full_chunk_size_bytes:
            return obj
        # Fewer bytes are a partial last chunk: fewer tokens, same layout. Its token count
        # follows from its length only when the chunk holds one KV group.
        try:
            if len(self.meta_shapes) != 1:
                raise ValueError(f"{size} bytes of a {len(self.meta_shapes)}-group layout")
            fitted = self.reshape_partial_chunk(obj, size)
        except ValueError as exc:
            self._limited.warning(
                "size", "kvfabric record does not fit this LMCache layout (%s): a miss", exc
            )
            obj.ref_count_down()
            return None
        # lmcache 0.5.6's reshape_partial_chunk updates the shape but not the per-group
        # shapes that get_tensor() (its GPU connectors) reads: keep them in step.
        fitted.meta.shapes = [fitted.meta.shape]
        return fitted

    def _unpack(self, obj: MemoryObj, header: memoryview) -> MemoryObj | None:
        """The object holding a record's payload, shaped as its ``RemoteMetadata`` says."""
        try:
            meta = RemoteMetadata.deserialize(header)
        except (struct.error, ValueError, KeyError) as exc:
            self._limited.warning(
                "header", "kvfabric record has no valid LMCache header (%s): a miss", exc
            )
            obj.ref_count_down()
            return None
        if meta.fmt == self.meta_fmt and meta.dtypes == self.meta_dtypes:
            fitted = self._fit(obj, meta.length)
            if fitted is None or fitted.get_shapes() == meta.shapes:
                return fitted
            self._limited.warning(
                "shape", "kvfabric record of shape %s does not fit this layout", meta.shapes
            )
            fitted.ref_count_down()
            return None
        # Another layout (layerwise chunks): a new object as the header says, filled from
        # the landing one.
        new = self._allocate(meta.shapes, meta.dtypes, meta.fmt)
        if new is not None and new.get_size() == meta.length <= obj.get_size():
            copy_into(new.byte_array.cast("B"), obj.byte_array.cast("B")[: meta.length])
        elif new is not None:
            new.ref_count_down()
            new = None
        obj.ref_count_down()
        return new

    def _allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> MemoryObj | None:
        # No busy loop: when LMCache's memory is full it would sleep and retry until some is
        # freed; a miss lets the engine recompute instead.
        return self.local_cpu_backend.allocate(shapes, dtypes, fmt, eviction=True, busy_loop=False)

    # -- writes --------------------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(
        self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]
    ) -> None:
        """Store the objects; their bytes are read before this returns.

        The objects stay LMCache's: its wrapper releases them when this returns.
        """
        if self._closed:
            return
        future = self._data_pool.submit(self._write, list(keys), list(memory_objs))
        waiter = asyncio.wrap_future(future)
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # LMCache frees the buffers as soon as we return, and the write still reads them.
            await asyncio.wait({waiter})
            raise

    def _write(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        if self._closed or not keys:
            return
        folded = [self.fold(k) for k in keys]
        values = (
            [self._pack(o) for o in objs] if self.save_chunk_meta else [o.byte_array for o in objs]
        )
        # An outage comes back as FAILED outcomes (counted by the store): those stay unlisted.
        try:
            outcomes = self.store.batched_put(folded, values)
        except ValueTooLargeError as exc:
            # A chunk larger than the store's max_value: configuration, not an outage.
            self._limited.error("too large", "kvfabric: %d chunks not stored: %s", len(keys), exc)
            return
        for key, k, outcome in zip(keys, folded, outcomes, strict=True):
            if outcome in (PutOutcome.STORED, PutOutcome.DEDUPLICATED):
                self._stored.add(k, key.to_string())

    def _pack(self, obj: MemoryObj) -> list[memoryview]:
        """``RemoteMetadata`` then the payload, as two pieces of one value (gathered, no copy)."""
        payload = obj.byte_array.cast("B")
        header = memoryview(bytearray(self.remote_metadata_bytes))
        meta = RemoteMetadata(
            payload.nbytes, obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()
        )
        meta.serialize_into(header)
        return [header, payload]

    def remove_sync(self, key: CacheEngineKey) -> bool:
        folded = self.fold(key)
        self._stored.drop(folded)
        if self._closed:
            return False
        # 0 when the controller cannot be asked (counted by the store as delete_failures).
        return self.store.delete([folded]) > 0

    # -- the rest ------------------------------------------------------------------------------

    async def list(self) -> builtins.list[str]:
        """The keys this connector stored that the store still holds (most recent 65536).

        kvfabric keys are one-way hashes and the store has no listing call, so keys written
        by other processes, or before this connector was made, cannot be named.
        """
        folded, names = self._stored.snapshot()
        if not folded or self._closed:
            return []
        # All False while the controller is away (the store counts it).
        present = await self._lookup(self.store.batched_exists, folded)
        return [n for n, here in zip(names, present, strict=True) if here]

    async def ping(self) -> int:
        """0 when the controller answers, 1 when it does not."""
        return await self._lookup(self._ping)

    def _ping(self) -> int:
        if self._closed:
            return 1
        return 0 if self.store.ping() else 1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=True)
        self._data_pool.shutdown(wait=True)
        self.store.close()

    # -- helpers -------------------------------------------------------------------------------

    async def _lookup(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            return fn(*args)  # a miss at once: the workers are gone
        return await asyncio.get_running_loop().run_in_executor(
            self._lookup_pool, functools.partial(fn, *args)
        )

    async def _transfer_objects(
        self, fn: Callable[..., builtins.list[MemoryObj | None]], *args: Any
    ) -> builtins.list[MemoryObj | None]:
        """Run a read that allocates objects; if our caller gives up, free what it returns."""
        if self._closed:
            return fn(*args)  # misses at once: the workers are gone
        future = self._data_pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # LMCache cancels a get that outlives its timeout; the read finishes anyway.
            future.add_done_callback(_release_result)
            raise


def _release(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def _release_result(future: Future[builtins.list[MemoryObj | None]]) -> None:
    if not future.cancelled() and future.exception() is None:
        _release(future.result())


class KVFabricAdapter(ConnectorAdapter):  # type: ignore[misc]
    """Builds a :class:`KVFabricConnector` for ``plugin://kvfabric[.INSTANCE]`` (what LMCache
    asks for a plugin named ``kvfabric``) and for ``kvfabric://HOST:PORT`` (``remote_url``).

    LMCache instantiates it with no arguments.
    """

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        if url.startswith("kvfabric://"):
            return True
        if url.startswith("plugin://"):
            return bool(extract_plugin_type(url.removeprefix("plugin://")) == PLUGIN_TYPE)
        return False

    def create_connector(self, context: ConnectorContext) -> KVFabricConnector:
        url: str = context.url
        # basic_check's legacy remote_url path passes no plugin name: take it from the URL.
        name: str = context.plugin_name or (
            url.removeprefix("plugin://") if url.startswith("plugin://") else PLUGIN_TYPE
        )
        if not url.startswith("kvfabric://"):
            url = _plugin_url(context.config, name)
        log.info("LMCache plugin %s: kvfabric store at %s", name, url)
        return KVFabricConnector(
            url=url,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            metadata=context.metadata,
            plugin_name=name,
        )


def _plugin_url(config: Any, name: str) -> str:
    """The store URL of plugin ``name``: its own ``url`` key, else its type's."""
    extra: dict[str, Any] = (getattr(config, "extra_config", None) or {}) if config else {}
    candidates = [f"remote_storage_plugin.{name}.url"]
    if name != PLUGIN_TYPE:
        candidates.append(f"remote_storage_plugin.{PLUGIN_TYPE}.url")
    for option in candidates:
        value = extra.get(option)
        if value:
            return str(value)
    raise ConfigError(
        f"LMCache plugin {name!r} has no kvfabric URL: set extra_config "
        f"{candidates[0]}: kvfabric://HOST:PORT"
    )
