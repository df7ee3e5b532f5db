"""The ``redis`` index: kvfabric's index kept in Redis, Redis Cluster or Valkey.

No kvfabric process sits in the metadata path: every client (and data node) opens this index
on the same Redis deployment and namespace, and the state lives there. The design, with its
reasons, is in docs/redis.md; in short:

* Data nodes' regions are carved into *arenas* (:mod:`kvfabric.indexes.redis_layout`); an
  arena's free space, grants, entries and retired slots live in one hash slot, changed only by
  the server-side functions of ``redis_functions.lua``. So the index allocates, atomically with
  the entry, and no two writers can ever be given overlapping bytes: arenas never overlap, and
  within one Redis runs one function at a time.
* A key belongs to one arena (consistent hashing over the arenas, computed by every client
  from the registry). A batched call groups its keys by arena and sends one function call per
  arena, pipelined per master, all masters at once: one round trip per shard that holds any
  of the keys (:mod:`kvfabric.indexes.redis_shards`). A put is allocate + publish: two rounds.
* Lookups only read (``FCALL_RO``): they replicate nothing, and reading an entry moves Redis's
  own LRU clock of it, which eviction samples (``OBJECT IDLETIME``), weighted by retention.
* The registry (ids by name, incarnations, arenas, liveness keys with a TTL) is one more hash
  slot; ``tick`` removes nodes whose liveness key expired.
* With ``replicas=k`` (the writers' ``?replicas=K``) a key's copies go to the first k arenas
  clockwise on distinct nodes (:meth:`~kvfabric.indexes.redis_layout.Ring.copies_of`); each
  copy is an ordinary entry of the arena holding it, allocated in the same round as the
  first, and the home's entry lists the others, so lookups still read the home alone. The
  key is published when its home copy landed. When the home's node goes, the arena of the
  second copy becomes the key's home, entry and all.

:class:`RedisIndex` is the plug-in and composes one class per job, each in a module of its
own: ``redis_calls`` (function calls per arena, rounds), ``redis_registry`` (nodes, arenas,
this client's view of them), ``redis_lookups``, ``redis_allocation`` (and the puts in flight
between allocate and publish), ``redis_publish`` (publish, abort), ``redis_unpublish``
(deletes, invalid records), ``redis_restore``, ``redis_upkeep`` (``tick``), ``redis_stats``
and ``redis_events`` (the KV events relay of a controller started with ``--kv-events``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import TYPE_CHECKING

from kvfabric._runtime.bounds import MAX_DURATION, bounded
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ConfigError
from kvfabric.indexes.redis_layout import check_namespace
from kvfabric.spi import (
    SLOT_ALIGN,
    AllocateResult,
    AllocationRequest,
    Copies,
    Counters,
    EngineBlock,
    GrantRef,
    IndexConfig,
    IndexEvents,
    IndexPlugin,
    NodeInfo,
    OptionSpec,
    Registry,
    hookimpl,
    parse_duration,
    parse_size,
)

if TYPE_CHECKING:
    from kvfabric.indexes.redis_allocation import Allocator
    from kvfabric.indexes.redis_calls import ArenaCalls
    from kvfabric.indexes.redis_events import EventRelay
    from kvfabric.indexes.redis_lookups import Lookups
    from kvfabric.indexes.redis_publish import Publisher
    from kvfabric.indexes.redis_registry import NodeRegistry, RegistryView
    from kvfabric.indexes.redis_restore import Restorer
    from kvfabric.indexes.redis_shards import ShardSet
    from kvfabric.indexes.redis_stats import IndexStats
    from kvfabric.indexes.redis_unpublish import Unpublisher
    from kvfabric.indexes.redis_upkeep import Upkeep

__all__ = ["RedisIndex"]


def _url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{text!r} is not a redis:// or rediss:// (TLS) URL")
    return text


class RedisIndex(IndexPlugin):
    """The index in Redis (single server or Cluster). Thread-safe; one per process is enough."""

    name = "redis"
    shared = True
    supports_replicas = True
    install_hint = "pip install 'kvfabric[redis]'"
    options = (
        OptionSpec(
            name="url",
            parse=_url,
            default=None,
            help="any node of the Redis deployment: redis:// or rediss:// (TLS), "
            "user:password@ for ACL auth; a cluster is found from it (default: "
            "redis://HOST:PORT of kvfabric://HOST:PORT?index=redis, else 127.0.0.1:6379)",
        ),
        OptionSpec(
            name="namespace",
            parse=check_namespace,
            default="kvfabric",
            help="prefix of every key: stores sharing a namespace share the cache",
        ),
        OptionSpec(
            name="arena_size",
            parse=parse_size,
            default=1 << 30,
            help="regions are carved into arenas of at most this size, the unit of placement "
            "(a value must fit in one)",
        ),
        OptionSpec(
            name="timeout",
            parse=bounded(parse_duration, above=0.0, at_most=MAX_DURATION, unit="s"),
            default=2.0,
            help="seconds a Redis server has to answer before its calls count as failed",
        ),
        OptionSpec(
            name="node_ttl",
            parse=bounded(parse_duration, above=0.0, at_most=MAX_DURATION, zero="never", unit="s"),
            default=10.0,
            help="a data node that has not heartbeated for this long is dropped (0: never)",
        ),
        OptionSpec(
            name="wait_replicas",
            parse=bounded(int, at_least=0),
            default=0,
            help="a publish succeeds once this many replicas of its master have it (WAIT), "
            "so a failover cannot lose it",
        ),
        OptionSpec(
            name="pool",
            parse=bounded(int, at_least=1),
            default=16,
            help="connections per Redis server",
        ),
    )

    @classmethod
    def check_available(cls) -> None:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise cls.unavailable("redis-py is not installed") from None

    @classmethod
    def create(cls, config: IndexConfig) -> RedisIndex:
        cls.check_available()
        options = cls.parse_options(config.options)
        address = config.address or "127.0.0.1:6379"
        return cls(
            url=options["url"] or f"redis://{address}",
            namespace=options["namespace"],
            arena_size=options["arena_size"],
            timeout=options["timeout"],
            node_ttl=options["node_ttl"],
            wait_replicas=options["wait_replicas"],
            pool=options["pool"],
            lease=config.lease,
            grace=config.grace,
            headroom=config.headroom,
            replicas=config.replicas,
        )

    def __init__(
        self,
        *,
        url: str = "redis://127.0.0.1:6379",
        namespace: str = "kvfabric",
        arena_size: int = 1 << 30,
        timeout: float = 2.0,
        node_ttl: float = 10.0,
        wait_replicas: int = 0,
        pool: int = 16,
        lease: float = 30.0,
        grace: float = 2.0,
        headroom: float = 0.05,
        replicas: int = 1,
    ) -> None:
        # Imported here, not above: this module is loaded to list the plugin, where
        # redis-py may be missing (check_available then says what to install).
        from kvfabric.indexes.redis_allocation import Allocator, PutsInFlight
        from kvfabric.indexes.redis_calls import ArenaCalls
        from kvfabric.indexes.redis_lookups import Lookups
        from kvfabric.indexes.redis_publish import Publisher
        from kvfabric.indexes.redis_registry import NodeRegistry, RegistryView
        from kvfabric.indexes.redis_restore import Restorer
        from kvfabric.indexes.redis_shards import ShardSet
        from kvfabric.indexes.redis_stats import CLIENT_COUNTERS, IndexStats
        from kvfabric.indexes.redis_unpublish import Unpublisher
        from kvfabric.indexes.redis_upkeep import Upkeep

        if arena_size < SLOT_ALIGN:
            raise ConfigError(f"redis.arena_size must be at least {SLOT_ALIGN} bytes")
        if wait_replicas < 0 or pool < 1:
            raise ConfigError("redis.wait_replicas must be >= 0 and redis.pool >= 1")
        if replicas < 1:
            raise ConfigError("replicas must be at least 1")
        self._ns = check_namespace(namespace)
        library = resources.files("kvfabric.indexes").joinpath("redis_functions.lua").read_text()
        self._shards: ShardSet = ShardSet(url, timeout=timeout, pool=pool, library=library)
        counters = Counters(CLIENT_COUNTERS)
        calls = ArenaCalls(
            self._shards, namespace=self._ns, grace_ms=int(grace * 1000), counters=counters
        )
        self._calls: ArenaCalls = calls
        self._relay: EventRelay | None = None
        self._view: RegistryView = RegistryView(calls, namespace=self._ns, counters=counters)
        self._unpublisher: Unpublisher = Unpublisher(calls, self._view, replicas=replicas)
        self._registry: NodeRegistry = NodeRegistry(
            calls,
            self._view,
            self._unpublisher,
            counters,
            arena_size=arena_size,
            node_ttl_ms=int(node_ttl * 1000),
        )
        self._restorer: Restorer = Restorer(calls, self._view, replicas=replicas)
        self._lookups: Lookups = Lookups(calls, self._view, counters)
        puts = PutsInFlight(counters)
        self._allocator: Allocator = Allocator(
            calls,
            self._view,
            self._registry,
            self._unpublisher,
            puts,
            counters,
            replicas=replicas,
            lease=lease,
            headroom=headroom,
        )
        self._publisher: Publisher = Publisher(
            calls, self._view, puts, counters, replicas=replicas, wait_replicas=wait_replicas
        )
        self._upkeep: Upkeep = Upkeep(calls, self._view, self._registry, puts)
        self._stats: IndexStats = IndexStats(self._shards, calls, self._view, counters)

    # -- data nodes ---------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        return self._registry.nodes()

    def register_node(self, info: NodeInfo) -> NodeInfo:
        return self._registry.register_node(info)

    def heartbeat(self, node: int, incarnation: int) -> bool:
        """The node is alive for ``node_ttl`` more; False if that incarnation is not the
        registered one (the node was dropped, or registered again elsewhere): re-register."""
        return self._registry.heartbeat(node, incarnation)

    def remove_node(self, node: int) -> int:
        return self._registry.remove_node(node)

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        return self._restorer.restore(node, records)

    def restore_done(self, node: int) -> None:
        self._restorer.restore_done(node)

    # -- what clients call ----------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        return [d for d in self._lookups.lookup_copies(keys).descriptors if d is not None]

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return list(self._lookups.resolve_copies(keys).descriptors)

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        return self._lookups.lookup_copies(keys)

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        return self._lookups.resolve_copies(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._lookups.exists(keys)

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        return self._allocator.allocate(requests)

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        """Publish the copies that landed, in one round: each in the arena holding it, the
        home's entry listing the others (:mod:`kvfabric.indexes.redis_publish`)."""
        return self._publisher.publish(grants)

    def publish_described(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock]
    ) -> list[bool]:
        """:meth:`publish`, each item carrying its key's encoded block for the KV events
        (the functions keep it only while a relay wants events)."""
        return self._publisher.publish(grants, blocks)

    def abort(self, grants: Sequence[GrantRef]) -> None:
        self._publisher.abort(grants)

    def unpublish(self, keys: Sequence[bytes]) -> int:
        return self._unpublisher.unpublish(keys)

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        return self._unpublisher.drop_invalid(records)

    # -- upkeep, counters ---------------------------------------------------------------------

    def tick(self) -> None:
        """Read the registry if it changed, drop nodes whose liveness key expired, finish
        dropping arenas, and now and then sweep every arena's leases and retired slots."""
        self._upkeep.tick()

    def stats(self) -> dict[str, int]:
        return self._stats.stats()

    def shared_stats(self) -> dict[str, int]:
        return self._stats.shared_stats()

    def round_trip_counts(self) -> dict[str, int]:
        """Rounds and round trips this client made so far (``rounds``, ``round_trips``, and
        one count per master address), read without asking Redis."""
        return self._stats.round_trip_counts()

    # -- where things are ---------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._ns

    @property
    def epoch(self) -> int:
        """The registry's epoch as last read (by ``tick``, ``nodes`` or a registration):
        it moves whenever a node registers or goes, so routes cached by node can be
        checked without asking Redis."""
        return self._view.epoch

    def home(self, key: bytes) -> tuple[int, int]:
        """(node, region) of the arena that owns ``key``: where a grant for it is placed."""
        arena = self._view.current().ring.arena_of(key)
        return arena.node, arena.region

    def shard_of(self, key: bytes) -> str:
        """Address of the Redis master holding ``key``'s entry (where its lookups go)."""
        view = self._view.current()
        if not view.ring:
            return ""
        self._shards.refresh()
        return self._shards.master_of(view.ring.arena_of(key).slot)

    def purge(self) -> None:
        """Delete everything this namespace holds in Redis (every node, entry and counter)."""
        self._registry.purge()

    def report_events(self, events: IndexEvents) -> bool:
        """Relay every client's changes to ``events``: the functions append them to
        each arena's stream while this relay renews its ask, and a thread reads them
        (:mod:`kvfabric.indexes.redis_events`); until :meth:`close`."""
        from kvfabric.indexes.redis_events import EventRelay

        if self._relay is None:
            self._relay = EventRelay(self._calls, self._view, events)
            self._relay.start()
        return True

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        self._shards.close()


@hookimpl
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    registry.add(RedisIndex.name, RedisIndex)
