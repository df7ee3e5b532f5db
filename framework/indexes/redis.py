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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

import attrs

from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import (
    ConfigError,
    ControllerUnavailableError,
    KvfabricError,
    NameInUseError,
    RegistrationInterruptedError,
)
from kvfabric.indexes.redis_layout import (
    Arena,
    Ring,
    arena_prefix,
    check_namespace,
    key_slot,
    registry_key,
    version_bytes,
)
from kvfabric.spi import (
    SLOT_ALIGN,
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    Copies,
    GrantRef,
    IndexConfig,
    IndexPlugin,
    NodeEndpoint,
    NodeInfo,
    OptionSpec,
    Registry,
    hookimpl,
    parse_duration,
    parse_size,
    record_size,
)

if TYPE_CHECKING:
    from kvfabric.indexes.redis_shards import Call, Round, ShardSet

__all__ = ["RedisIndex"]

# An entry is its descriptor, then its state: 1 while its grant is being written, 3 when
# its record lives in another arena (then the holder's id, 8 bytes); then its alternates.
_PENDING = 1
_PUBLISHED = 2
_FOREIGN = 3
_ENTRY_HEAD = DESCRIPTOR_SIZE + 5
_KINDS = {
    1: AllocationKind.GRANTED,
    2: AllocationKind.EXISTS,
    3: AllocationKind.IN_FLIGHT,
    4: AllocationKind.NO_SPACE,
}
# Every arena's lease expiry and retired slots are also swept by allocations in that arena;
# tick sweeps all arenas this often, so the gauges stay right where nobody writes.
_UPKEEP_INTERVAL = 5.0
# kvf1_init: a round cleared a batch of what an older registry's arena left; rounds at most
# (each clears up to 500 records and 500 entries: millions in all).
_INIT_CLEARING = 2
_INIT_ROUNDS = 10_000

_CLIENT_COUNTERS = (
    "lookups",
    "lookup_keys",
    "prefix_hits",
    "resolves",
    "resolve_hits",
    "exists_calls",
    "unavailable_calls",
    "unreplicated_publishes",
    "stale_arenas",
    "nodes_expired",
    "replica_grants",
    "replica_shortfall",
    "replica_repairs",
    "orphan_grants",
)
_ROUND_COUNTERS = ("rounds", "round_trips", "failed_round_trips", "topology_refreshes")
"""This client's traffic to Redis (in ``stats``; per master too, ``shardN_round_trips``)."""

_ARENA_COUNTERS = (
    "grants",
    "dedup_hits",
    "in_flight",
    "no_space",
    "oversize",
    "published",
    "publish_rejected",
    "aborted",
    "unpublished",
    "evictions",
    "early_reuse",
    "lease_expiries",
    "invalid_reports",
    "restored",
    "restore_duplicates",
    "restore_overlaps",
    "hosted_drops",
    "replicas_dropped",
)


def _url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"{text!r} is not a redis:// or rediss:// (TLS) URL")
    return text


@attrs.frozen(kw_only=True)
class _View:
    """The registry as this client last read it, and the ring computed from it."""

    epoch: int
    nodes: dict[int, NodeInfo]
    arenas: dict[int, Arena]
    ring: Ring
    dropped: frozenset[int]
    born: bytes = b"0"
    """When the registry was created: a new one (Redis restarted empty) starts its epochs
    again, and is told apart by this."""


_EMPTY = _View(epoch=-1, nodes={}, arenas={}, ring=Ring(()), dropped=frozenset())


@attrs.define
class _Put:
    """A put of several copies this client was granted and has not published yet: what its
    publish needs to know (which arena holds which copy, what the home must list)."""

    home: Arena
    home_version: int
    """The home's grant (``granted``) or, for a stored key being repaired, its entry."""
    granted: bool
    copies: dict[int, tuple[Descriptor, Arena]]
    """Version -> the copy granted and the arena holding it."""
    existing: list[Descriptor]
    """Copies already stored elsewhere, for the home to list."""
    deadline: float


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
            parse=parse_duration,
            default=2.0,
            help="seconds a Redis server has to answer before its calls count as failed",
        ),
        OptionSpec(
            name="node_ttl",
            parse=parse_duration,
            default=10.0,
            help="a data node that has not heartbeated for this long is dropped (0: never)",
        ),
        OptionSpec(
            name="wait_replicas",
            parse=int,
            default=0,
            help="a publish succeeds once this many replicas of its master have it (WAIT), "
            "so a failover cannot lose it",
        ),
        OptionSpec(
            name="pool",
            parse=int,
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
        from kvfabric.indexes.redis_shards import ShardSet

        if arena_size < SLOT_ALIGN:
            raise ConfigError(f"redis.arena_size must be at least {SLOT_ALIGN} bytes")
        if wait_replicas < 0 or pool < 1:
            raise ConfigError("redis.wait_replicas must be >= 0 and redis.pool >= 1")
        if replicas < 1:
            raise ConfigError("replicas must be at least 1")
        self._ns = check_namespace(namespace)
        self._replicas = replicas
        self._lease = lease
        # Puts of several copies between their allocate and publish, by key; grants this
        # client could not use (their key's home refused it), aborted in its next round.
        self._puts: dict[bytes, _Put] = {}
        self._orphans: list[tuple[Arena, bytes, int]] = []
        self._arena_size = arena_size
        self._node_ttl_ms = int(node_ttl * 1000)
        self._wait = wait_replicas
        self._lease_ms = max(1, int(lease * 1000))
        self._grace_ms = int(grace * 1000)
        self._headroom = repr(float(headroom))
        self._registry = registry_key(self._ns)
        self._registry_slot = key_slot(self._registry)
        library = resources.files("kvfabric.indexes").joinpath("redis_functions.lua").read_text()
        self._shards: ShardSet = ShardSet(url, timeout=timeout, pool=pool, library=library)
        self._lock = threading.Lock()
        self._view = _EMPTY
        self._stale = True
        self._last_upkeep = time.monotonic()
        self._counters = dict.fromkeys(_CLIENT_COUNTERS, 0)

    # -- the registry --------------------------------------------------------------------------

    def _registry_call(self, function: str, *args: Any, read_only: bool = False) -> Any:
        command = "FCALL_RO" if read_only else "FCALL"
        return self._shards.execute(
            self._registry_slot, command, function, 1, self._registry, *args
        )

    def _current(self) -> _View:
        """The view, read from Redis first if it is known to be out of date."""
        with self._lock:
            stale, view = self._stale, self._view
        return self._refresh() if stale else view

    def _refresh(self, *, force: bool = False) -> _View:
        """Read the registry if its epoch moved (one round trip to the registry's master)."""
        with self._lock:
            known = -1 if force else self._view.epoch
            born = self._view.born
        reply = self._registry_call("kvf1_registry", known, born, read_only=True)
        if len(reply) == 1:
            with self._lock:
                self._stale = False
                return self._view
        epoch, flat_nodes, flat_arenas, dropped, born = reply
        nodes: dict[int, NodeInfo] = {}
        for i in range(0, len(flat_nodes), 3):
            info = NodeInfo.from_bytes(flat_nodes[i + 2])
            nodes[int(flat_nodes[i])] = attrs.evolve(info, incarnation=int(flat_nodes[i + 1]))
        names = {node_id: info.name for node_id, info in nodes.items()}
        arenas = {
            int(flat_arenas[i]): Arena.parse(
                self._ns, int(flat_arenas[i]), flat_arenas[i + 1], names
            )
            for i in range(0, len(flat_arenas), 2)
        }
        view = _View(
            epoch=int(epoch),
            nodes=nodes,
            arenas=arenas,
            ring=Ring(sorted(arenas.values(), key=lambda a: a.id)),
            dropped=frozenset(int(a) for a in dropped),
            born=born,
        )
        with self._lock:
            if view.epoch >= self._view.epoch or view.born != self._view.born or force:
                self._view = view
            self._stale = False
            return self._view

    def nodes(self) -> list[NodeInfo]:
        return list(self._refresh().nodes.values())

    def register_node(self, info: NodeInfo) -> NodeInfo:
        node_id = int(self._registry_call("kvf1_node_id", info.name))
        endpoints = tuple(
            NodeEndpoint(node=node_id, transport=e.transport, address=e.address, regions=e.regions)
            for e in info.endpoints
        )
        registered = attrs.evolve(info, endpoints=endpoints, id=node_id, incarnation=0)
        regions: list[Any] = []
        for region in info.regions:
            regions += [region.id, region.size, region.rkey]
        reply = self._registry_call(
            "kvf1_register",
            node_id,
            1 if info.restoring else 0,
            self._arena_size,
            SLOT_ALIGN,
            self._node_ttl_ms if self._node_ttl_ms > 0 else 0,
            registered.to_bytes(),
            info.instance,
            *regions,
        )
        if reply[0] == b"in-use":
            raise NameInUseError(
                f"node name {info.name!r} belongs to a live node of another process; it is "
                f"released {int(reply[1]) / 1000:.1f}s from now unless that node heartbeats"
            )
        _, incarnation, _, created, dropped = reply
        try:
            view = self._refresh()
            self._init_arenas(view, [view.arenas[int(a)] for a in created if int(a) in view.arenas])
            self._drop_arenas([int(a) for a in dropped])
        except KvfabricError as exc:
            # The registry holds the node now, and clients may be writing to it (its arenas
            # can be ready on one shard while another is lost). Measured: a Redis restarted
            # in this step left a restarted node's 18 records out of the new registry.
            raise RegistrationInterruptedError(
                f"node {node_id} was registered, then Redis was lost before its arenas were "
                f"ready: {exc}"
            ) from exc
        return attrs.evolve(registered, incarnation=int(incarnation))

    def heartbeat(self, node: int, incarnation: int) -> bool:
        """The node is alive for ``node_ttl`` more; False if that incarnation is not the
        registered one (the node was dropped, or registered again elsewhere): re-register."""
        return bool(self._registry_call("kvf1_heartbeat", node, incarnation))

    def remove_node(self, node: int) -> int:
        removed, dropped = self._registry_call("kvf1_remove", node)
        if not removed:
            return 0
        self._refresh()
        return self._drop_arenas([int(a) for a in dropped])

    def _init_arenas(self, view: _View, arenas: Sequence[Arena]) -> None:
        """Make ``arenas`` of ``view``'s registry where they are not made yet (idempotent).

        Each carries the registry's birth: an arena an older registry made under the same id
        (a Redis restarted empty gives ids out again, and a client that read the old registry
        can make its arena in the new Redis) is cleared and made again, a batch per round.
        """
        left = list(arenas)
        for _ in range(_INIT_ROUNDS):
            calls = [
                self._call(
                    arena,
                    "kvf1_init",
                    arena.node,
                    arena.region,
                    arena.base,
                    arena.size,
                    arena.rkey,
                    arena.id,
                    arena.id % 4096,
                    1 if arena.restoring else 0,
                    arena.rkey.to_bytes(8, "little"),
                    view.born,
                )
                for arena in left
            ]
            again = []
            for arena, value in zip(left, self._run(calls).values, strict=True):
                _raise_unexpected(value)
                if value == _INIT_CLEARING:
                    again.append(arena)
            if not again:
                return
            left = again
        raise ControllerUnavailableError(
            f"arenas {[a.id for a in left]} still hold what an older registry left after "
            f"{_INIT_ROUNDS} rounds of clearing"
        )

    def _drop_arenas(self, arena_ids: Sequence[int]) -> int:
        """Delete arenas' keys (a batch per call until none is left); returns the entries that
        went, with entries elsewhere whose records were in these arenas."""
        from kvfabric.indexes.redis_shards import Call

        dropped = 0
        notices: list[Any] = []
        done: list[int] = []
        left = list(arena_ids)
        while left:
            calls = [
                Call(
                    slot=key_slot(arena_prefix(self._ns, a)),
                    args=("FCALL", "kvf1_drop", 1, arena_prefix(self._ns, a) + b"m"),
                )
                for a in left
            ]
            values = self._run(calls).values
            still: list[int] = []
            for arena, value in zip(left, values, strict=True):
                if isinstance(value, Exception):
                    continue  # tick drops it later: the registry keeps it among `dropped`
                count, remaining, found = value
                dropped += int(count)
                notices += found
                if int(remaining):
                    still.append(arena)
                else:
                    done.append(arena)
            left = still
        dropped += self._drop_at_homes(notices)
        if done:
            self._registry_call("kvf1_forget_dropped", *done)
        return dropped

    def _drop_at_homes(self, notices: Iterable[Any]) -> int:
        """Entries whose records (in another arena) were evicted or dropped go too."""
        by_home: dict[int, list[Any]] = {}
        for home, _offset, key, version in notices:
            by_home.setdefault(int(home), []).extend([key, version])
        if not by_home:
            return 0
        calls = [self._unpublish_call(home, "hosted_drops", args) for home, args in by_home.items()]
        return sum(int(v[1]) for v in self._run(calls).values if _ok(v))

    def _release_at_hosts(self, notices: Iterable[Any]) -> None:
        """Slots holding records of entries that went elsewhere retire."""
        from kvfabric.indexes.redis_shards import Call

        by_host: dict[int, list[Any]] = {}
        for host, offset, key, version in notices:
            by_host.setdefault(int(host), []).extend([offset, key, version])
        calls = [
            Call(
                slot=key_slot(arena_prefix(self._ns, host)),
                args=(
                    "FCALL",
                    "kvf1_release_hosted",
                    1,
                    arena_prefix(self._ns, host) + b"m",
                    self._grace_ms,
                    *args,
                ),
            )
            for host, args in by_host.items()
        ]
        if calls:
            self._run(calls)

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        # Read the registry afresh (once per registration): a view cached before Redis came
        # back empty can list this node's id with its old arenas, so every claim went to
        # arenas that no longer exist and the node's records were not restored.
        view = self._refresh()
        holders = [a for a in view.arenas.values() if a.node == node]
        if not holders or not view.ring:
            return 0
        # 1. The arena holding each record claims its slot (fits, overlaps nothing claimed).
        placed: list[tuple[Descriptor, Arena, Arena]] = []
        for record in records:
            size = record_size(record.length)
            holder = next((a for a in holders if a.holds(record.region, record.offset, size)), None)
            if holder is not None:
                placed.append((record, holder, view.ring.arena_of(record.key)))
        claims = self._by_arena(
            (holder, [r.offset, record_size(r.length), r.key, home.id, version_bytes(r.version)])
            for r, holder, home in placed
        )
        claimed_flags = self._flags(claims, "kvf1_claim", SLOT_ALIGN)
        claimed = [p for p, ok in zip(placed, claimed_flags, strict=True) if ok]
        # 2. Each key's arena publishes it unless it already has the key. With replicas, a
        # record held by one of the key's other arenas is that arena's own entry, and the
        # home lists it (step 4).
        targets = [self._restore_target(view, r, holder, home) for r, holder, home in claimed]
        adoptions = self._by_arena(
            (
                target,
                [
                    r.key,
                    node,
                    r.region,
                    holder.rkey.to_bytes(8, "little"),
                    r.offset,
                    r.length,
                    version_bytes(r.version),
                    r.crc,
                    holder.id,
                ],
            )
            for (r, holder, _), target in zip(claimed, targets, strict=True)
        )
        adopted = self._flags(adoptions, "kvf1_adopt")
        # 3. Claims of records not published are let go.
        refused = self._by_arena(
            (holder, [r.offset, r.key])
            for (r, holder, _), ok in zip(claimed, adopted, strict=True)
            if not ok
        )
        calls = [self._call(arena, "kvf1_unclaim", *args) for arena, _, args in refused]
        # 4. Homes list the copies their keys' other arenas adopted, and those the other
        # arenas of keys a home adopted still hold.
        copies = [
            (home, attrs.evolve(r, node=node, rkey=holder.rkey))
            for (r, holder, home), target, ok in zip(claimed, targets, adopted, strict=True)
            if ok and target.id != home.id
        ]
        if self._replicas > 1:
            adopted_keys = [r.key for (r, _, _), ok in zip(claimed, adopted, strict=True) if ok]
            copies += self._held_elsewhere(view, adopted_keys)
        links = self._by_arena((home, [d.key, b"", d.to_bytes()]) for home, d in copies)
        calls += [
            self._call(arena, "kvf1_link", self._replicas - 1, *args) for arena, _, args in links
        ]
        for value in self._run(calls).values:
            _raise_unexpected(value)
        return sum(adopted)

    def _held_elsewhere(self, view: _View, keys: Sequence[bytes]) -> list[tuple[Arena, Descriptor]]:
        """Copies of ``keys`` their other arenas hold, with the home that should list each:
        one round of lookups (listing one twice does no harm)."""
        asks: list[tuple[Arena, list[Any]]] = []
        homes: dict[bytes, Arena] = {}
        for key in keys:
            arenas = view.ring.copies_of(key, self._replicas)
            homes[key] = arenas[0]
            asks += [(arena, [key]) for arena in arenas[1:]]
        groups = self._by_arena(asks)
        calls = [
            self._call(arena, "kvf1_lookup", *args, read_only=True) for arena, _, args in groups
        ]
        found: list[tuple[Arena, Descriptor]] = []
        for (_, _, args), reply in zip(
            groups, self._run(calls).values if calls else [], strict=True
        ):
            if isinstance(reply, Exception) or reply[0] is None:
                continue
            for key, entry in zip(args, reply[1], strict=True):
                if entry is not None and entry[DESCRIPTOR_SIZE] == _PUBLISHED:
                    found.append((homes[key], Descriptor.from_bytes(entry)))
        return found

    def _restore_target(self, view: _View, record: Descriptor, holder: Arena, home: Arena) -> Arena:
        """Where a restored record's entry goes: its holder, when that is one of the arenas
        of the key's copies; else the key's home (an entry pointing into the holder)."""
        if self._replicas == 1 or holder.id == home.id:
            return home
        arenas = view.ring.copies_of(record.key, self._replicas)
        return holder if any(a.id == holder.id for a in arenas) else home

    def _flags(
        self, groups: list[tuple[Arena, list[int], list[Any]]], function: str, *head: Any
    ) -> list[bool]:
        """Run ``function`` per arena; the flags it returns, in the order of the items."""
        total = sum(len(indexes) for _, indexes, _ in groups)
        flags = [False] * total
        calls = [self._call(arena, function, *head, *args) for arena, _, args in groups]
        for (_, indexes, _), value in zip(groups, self._run(calls).values, strict=True):
            _raise_unexpected(value)
            if _ok(value):
                for i, flag in zip(indexes, value[1], strict=True):
                    flags[i] = bool(flag)
        return flags

    def restore_done(self, node: int) -> None:
        view = self._refresh()  # as in restore: the node's arenas as registered now
        calls = [self._call(a, "kvf1_restore_done") for a in view.arenas.values() if a.node == node]
        for value in self._run(calls).values:
            _raise_unexpected(value)
        info = view.nodes.get(node)
        if info is not None and info.restoring:
            # The registry too (it listed the node and its arenas as restoring for good).
            record = attrs.evolve(info, restoring=False, incarnation=0).to_bytes()
            self._registry_call("kvf1_restored", node, info.incarnation, record)

    # -- what clients call ----------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        return [d for d in self.lookup_copies(keys).descriptors if d is not None]

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return list(self.resolve_copies(keys).descriptors)

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        found = self._read(keys)
        out: list[Descriptor | None] = []
        for descriptor in found.descriptors:
            if descriptor is None:
                break
            out.append(descriptor)
        alternates = {i: a for i, a in found.alternates.items() if i < len(out)}
        self._count(lookups=1, lookup_keys=len(keys), prefix_hits=len(out))
        return Copies(descriptors=out, alternates=alternates)

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        found = self._read(keys)
        self._count(resolves=1, resolve_hits=sum(d is not None for d in found.descriptors))
        return found

    def _read(self, keys: Sequence[bytes]) -> Copies:
        view = self._current()
        found: list[Descriptor | None] = [None] * len(keys)
        alternates: dict[int, tuple[Descriptor, ...]] = {}
        if not keys or not view.ring:
            return Copies(descriptors=found)
        groups = self._group_keys(view, keys)
        calls = [
            self._call(arena, "kvf1_lookup", *args, read_only=True) for arena, _, args in groups
        ]
        replies = self._run(calls).values
        for (arena, indexes, _), reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                _raise_unexpected(reply)
                continue  # that shard is down: its keys are misses
            if reply[0] is None:
                self._gone()
                continue
            published = [
                (i, entry)
                for i, entry in zip(indexes, reply[1], strict=True)
                if entry is not None and entry[DESCRIPTOR_SIZE] != _PENDING
            ]
            if not published:
                continue
            wire = b"".join(entry[:DESCRIPTOR_SIZE] for _, entry in published)
            for (i, entry), descriptor in zip(
                published, Descriptor.many_from_bytes(wire), strict=True
            ):
                # A record restored into another node's arena: only while that node is.
                if descriptor.node == arena.node or descriptor.node in view.nodes:
                    found[i] = descriptor
                    if len(entry) > _ENTRY_HEAD:
                        others = _alternates(entry, view)
                        if others:
                            alternates[i] = others
        return Copies(descriptors=found, alternates=alternates)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        view = self._current()
        self._count(exists_calls=1)
        out = [False] * len(keys)
        if not keys or not view.ring:
            return out
        groups = self._group_keys(view, keys)
        calls = [
            self._call(arena, "kvf1_exists", *args, read_only=True) for arena, _, args in groups
        ]
        replies = self._run(calls).values
        for (_, indexes, _), reply in zip(groups, replies, strict=True):
            if isinstance(reply, Exception):
                _raise_unexpected(reply)
                continue
            if reply[0] is None:
                self._gone()
                continue
            for i, flag in zip(indexes, reply[1:], strict=True):
                out[i] = bool(flag)
        return out

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        view = self._current()
        allocations = [Allocation(kind=AllocationKind.NO_SPACE)] * len(requests)
        if not requests or not view.ring:
            return AllocateResult(allocations=tuple(allocations))
        if self._replicas > 1:
            return self._allocate_copies(view, requests, retry=True)
        groups = self._by_arena(
            (view.ring.arena_of(r.key), [r.key, r.length, record_size(r.length)]) for r in requests
        )
        evictions = 0
        notices: list[Any] = []
        for attempt in range(2):
            calls = [
                self._call(
                    arena, "kvf1_allocate", self._lease_ms, self._grace_ms, self._headroom, *args
                )
                for arena, _, args in groups
            ]
            gone: list[tuple[Arena, list[int], list[Any]]] = []
            replies = self._run(calls).values
            for group, reply in zip(groups, replies, strict=True):
                _, indexes, _ = group
                parsed = _allocation_answer(reply)
                if parsed is None:
                    continue  # NO_SPACE: nothing was granted there
                if parsed == "gone":
                    gone.append(group)
                    continue
                evicted, kinds, entries, found = parsed
                evictions += evicted
                notices += found
                for i, kind, raw in zip(indexes, kinds, entries, strict=True):
                    allocation_kind = _KINDS[int(kind)]
                    descriptor = Descriptor.from_bytes(raw) if raw else None
                    allocations[i] = Allocation(kind=allocation_kind, descriptor=descriptor)
            if not gone or attempt:
                break
            # Arenas this client did not know were replaced (or never initialised): read the
            # registry again and send those keys where they belong now.
            groups = self._regroup(gone, requests)
        if notices:
            self._drop_at_homes(notices)
        return AllocateResult(allocations=tuple(allocations), evictions=evictions)

    def _allocate_copies(
        self,
        view: _View,
        requests: Sequence[AllocationRequest],
        *,
        retry: bool,
        aborts_first: Sequence[Call] = (),
    ) -> AllocateResult:
        """Allocate every copy of every key in one round: each key's arenas
        (:meth:`Ring.copies_of`) allocate as for a key of their own, and the home's answer
        decides. A home that says EXISTS lists the copies it lacks, granted as repairs; one
        that refuses (IN_FLIGHT, NO_SPACE) leaves the other grants to abort later."""
        homes = [view.ring.copies_of(r.key, self._replicas) for r in requests]
        where = [(i, rank) for i, arenas in enumerate(homes) for rank in range(len(arenas))]
        groups = self._by_arena(
            (arena, [r.key, r.length, record_size(r.length)])
            for r, arenas in zip(requests, homes, strict=True)
            for arena in arenas
        )
        calls = [
            self._call(
                arena, "kvf1_allocate", self._lease_ms, self._grace_ms, self._headroom, *args
            )
            for arena, _, args in groups
        ]
        answers: list[list[tuple[AllocationKind, bytes] | None]] = [[None] * len(h) for h in homes]
        gone: list[Arena] = []
        evictions = 0
        notices: list[Any] = []
        # ``aborts_first`` go ahead in the same pipelines: a master runs them in order.
        replies = self._run([*aborts_first, *calls]).values
        for value in replies[: len(aborts_first)]:
            _raise_unexpected(value)
        for (arena, positions, _), reply in zip(groups, replies[len(aborts_first) :], strict=True):
            parsed = _allocation_answer(reply)
            if parsed is None:
                continue  # nothing was granted there
            if parsed == "gone":
                gone.append(arena)
                continue
            evicted, kinds, entries, found = parsed
            evictions += evicted
            notices += found
            for position, kind, raw in zip(positions, kinds, entries, strict=True):
                i, rank = where[position]
                answers[i][rank] = (_KINDS[int(kind)], raw)
        if notices:
            self._drop_at_homes(notices)
        allocations: list[Allocation] = []
        again: list[int] = []
        deadline = time.monotonic() + self._lease
        stale = {a.id for a in gone}
        for i, (request, arenas, answer) in enumerate(zip(requests, homes, answers, strict=True)):
            grants = [
                (Descriptor.from_bytes(a[1]), arenas[rank])
                for rank, a in enumerate(answer)
                if rank and a is not None and a[0] is AllocationKind.GRANTED
            ]
            stored = [
                Descriptor.from_bytes(a[1])
                for rank, a in enumerate(answer)
                if rank and a is not None and a[0] is AllocationKind.EXISTS
            ]
            home = answer[0]
            if retry and any(a.id in stale for a in arenas):
                # One of its arenas was gone: its grants go back, and it is asked again.
                if home is not None and home[0] is AllocationKind.GRANTED:
                    grants.append((Descriptor.from_bytes(home[1]), arenas[0]))
                self._orphan(request.key, grants)
                again.append(i)
                allocations.append(Allocation(kind=AllocationKind.NO_SPACE))
                continue
            if home is None or home[0] not in (AllocationKind.GRANTED, AllocationKind.EXISTS):
                self._orphan(request.key, grants)
                kind = AllocationKind.NO_SPACE if home is None else home[0]
                allocations.append(Allocation(kind=kind))
                continue
            first = Descriptor.from_bytes(home[1])
            granted = home[0] is AllocationKind.GRANTED
            if granted:
                shortfall = self._replicas - 1 - len(grants) - len(stored)
                self._count(replica_grants=len(grants), replica_shortfall=max(0, shortfall))
            else:
                stored = [*_alternates(home[1], view), *stored]
                self._count(replica_repairs=len(grants))
            if granted or grants:
                put = _Put(
                    home=arenas[0],
                    home_version=first.version,
                    granted=granted,
                    copies={d.version: (d, arena) for d, arena in grants},
                    existing=stored,
                    deadline=deadline,
                )
                if granted:
                    put.copies[first.version] = (first, arenas[0])
                with self._lock:
                    self._puts[request.key] = put
            allocations.append(
                Allocation(kind=home[0], descriptor=first, replicas=tuple(d for d, _ in grants))
            )
        if again:
            # Arenas this client did not know were replaced, or not initialised yet (a node
            # registering): read the registry again, initialise those it lists, and ask the
            # keys' arenas now (once), the grants they got given back first.
            self._count(stale_arenas=len(gone))
            view = self._refresh()
            self._init_arenas(view, [view.arenas[a.id] for a in gone if a.id in view.arenas])
            retried = self._allocate_copies(
                view,
                [requests[i] for i in again],
                retry=False,
                aborts_first=self._abort_calls(self._take_orphans()),
            )
            evictions += retried.evictions
            for i, allocation in zip(again, retried.allocations, strict=True):
                allocations[i] = allocation
        return AllocateResult(allocations=tuple(allocations), evictions=evictions)

    def _orphan(self, key: bytes, grants: Sequence[tuple[Descriptor, Arena]]) -> None:
        """Grants of copies whose key was refused: aborted with this client's next round."""
        if grants:
            with self._lock:
                self._orphans += [(arena, key, d.version) for d, arena in grants]
                self._counters["orphan_grants"] += len(grants)

    def _regroup(
        self,
        gone: list[tuple[Arena, list[int], list[Any]]],
        requests: Sequence[AllocationRequest],
    ) -> list[tuple[Arena, list[int], list[Any]]]:
        self._count(stale_arenas=len(gone))
        view = self._refresh()
        registered = [a for a, _, _ in gone if a.id in view.arenas]
        if registered:
            self._init_arenas(view, [view.arenas[a.id] for a in registered])
        if not view.ring:
            return []
        indexes = [i for _, group_indexes, _ in gone for i in group_indexes]
        regrouped = self._by_arena(
            (
                view.ring.arena_of(requests[i].key),
                [requests[i].key, requests[i].length, record_size(requests[i].length)],
            )
            for i in indexes
        )
        # Map the regrouped positions back to the request positions.
        return [(arena, [indexes[j] for j in where], args) for arena, where, args in regrouped]

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        """Publish the copies that landed, in one round: each in the arena holding it, the
        home's entry listing the others. A key whose home copy did not land is not
        published (its other copies stay stored: the next put of the key finds them and
        writes no bytes for them); grants of a key that were not named are aborted in the
        same round, with grants left over from refused allocations."""
        view = self._current()
        out = [False] * len(grants)
        if not grants or not view.ring:
            return out
        by_key: dict[bytes, list[int]] = {}
        for i, grant in enumerate(grants):
            by_key.setdefault(grant.key, []).append(i)
        with self._lock:
            puts = {key: self._puts.pop(key) for key in by_key if key in self._puts}
        items: list[tuple[Arena, list[Any]]] = []
        answers: list[int] = []
        """The grant each publish item answers for."""
        homes: dict[bytes, int] = {}
        """Key -> the item publishing its home copy (-1: it did not land)."""
        links: list[tuple[Arena, list[Any]]] = []
        aborts: list[tuple[Arena, list[Any]]] = []
        for key, positions in by_key.items():
            put = puts.get(key)
            landed = {
                grants[i].version: i
                for i in positions
                if put is not None and grants[i].version in put.copies
            }
            for i in positions:
                if grants[i].version not in landed:
                    # Not one of a multi-copy put's grants: published at the key's home.
                    items.append(
                        (
                            view.ring.arena_of(key),
                            [key, version_bytes(grants[i].version), grants[i].crc, b""],
                        )
                    )
                    answers.append(i)
            if put is None:
                continue
            for version, (_, arena) in put.copies.items():
                if version not in landed:
                    aborts.append((arena, [key, version_bytes(version)]))
            others = [
                put.copies[v][0].with_crc(grants[i].crc)
                for v, i in landed.items()
                if not (put.granted and v == put.home_version)
            ]
            for v, i in landed.items():
                if not (put.granted and v == put.home_version):
                    items.append((put.copies[v][1], [key, version_bytes(v), grants[i].crc, b""]))
                    answers.append(i)
            if put.granted:
                i = landed.get(put.home_version, -1)
                homes[key] = len(items) if i >= 0 else -1
                if i >= 0:
                    alternates = [*others, *put.existing][: self._replicas - 1]
                    wire = b"".join(d.to_bytes() for d in alternates)
                    args = [key, version_bytes(put.home_version), grants[i].crc, wire]
                    items.append((put.home, args))
                    answers.append(i)
            elif others:
                wire = b"".join(d.to_bytes() for d in others)
                links.append((put.home, [key, version_bytes(put.home_version), wire]))
        groups = self._by_arena(items)
        calls = [self._call(arena, "kvf1_publish", *args) for arena, _, args in groups]
        calls += [
            self._call(arena, "kvf1_link", self._replicas - 1, *args)
            for arena, _, args in self._by_arena(links)
        ]
        calls += self._abort_calls(aborts, self._take_orphans())
        result = self._run(calls, wait_replicas=self._wait)
        flags = [False] * len(items)
        published = len(groups)
        for (_, positions, _), reply, durable in zip(
            groups, result.values[:published], result.durable[:published], strict=True
        ):
            _raise_unexpected(reply)
            if not _ok(reply):
                continue
            for position, flag in zip(positions, reply[1], strict=True):
                flags[position] = bool(flag) and durable
            if not durable:
                self._count(unreplicated_publishes=sum(bool(f) for f in reply[1]))
        for value in result.values[len(groups) :]:
            _raise_unexpected(value)
        for position, i in enumerate(answers):
            out[i] = flags[position]
        # A key is readable through its home: its other copies count only with it.
        for key, home in homes.items():
            if home < 0 or not flags[home]:
                for i in by_key[key]:
                    out[i] = False
        return out

    def abort(self, grants: Sequence[GrantRef]) -> None:
        view = self._current()
        if not grants or not view.ring:
            return
        with self._lock:
            puts = {g.key: self._puts.pop(g.key) for g in grants if g.key in self._puts}
        aborts: list[tuple[Arena, list[Any]]] = []
        for grant in grants:
            put = puts.get(grant.key)
            held = put.copies.get(grant.version) if put is not None else None
            arena = held[1] if held is not None else view.ring.arena_of(grant.key)
            aborts.append((arena, [grant.key, version_bytes(grant.version)]))
        for value in self._run(self._abort_calls(aborts, self._take_orphans())).values:
            _raise_unexpected(value)

    def _take_orphans(self) -> list[tuple[Arena, list[Any]]]:
        with self._lock:
            orphans, self._orphans = self._orphans, []
        return [(arena, [key, version_bytes(version)]) for arena, key, version in orphans]

    def _abort_calls(self, *items: list[tuple[Arena, list[Any]]]) -> list[Call]:
        return [
            self._call(arena, "kvf1_abort", self._grace_ms, *args)
            for arena, _, args in self._by_arena(item for group in items for item in group)
        ]

    def unpublish(self, keys: Sequence[bytes]) -> int:
        return self._unpublish([(k, b"") for k in keys], "unpublished")

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        """Readers found these published records invalid: unpublish each that is still the
        published version, so the next put of its key stores it again. With replicas, the
        bad copy's own arena drops it and the home forgets it (the arena is told by the
        version's low bits, which name the arena that granted it)."""
        return self._unpublish(
            [(r.key, version_bytes(r.version)) for r in records], "invalid_reports"
        )

    def _unpublish(self, pairs: Sequence[tuple[bytes, bytes]], counter: str) -> int:
        view = self._current()
        if not pairs or not view.ring:
            return 0
        if self._replicas == 1:
            homes = [(view.ring.arena_of(key), [key, version]) for key, version in pairs]
            elsewhere: list[tuple[Arena, list[Any]]] = []
        else:
            homes, elsewhere = [], []
            for key, version in pairs:
                arenas = view.ring.copies_of(key, self._replicas)
                homes.append((arenas[0], [key, version]))
                for arena in arenas[1:]:
                    # Every copy for a delete; for an invalid copy, the arena holding it.
                    if not version or int.from_bytes(version, "little") & 0xFFF == arena.id % 4096:
                        elsewhere.append((arena, [key, version]))
        groups = self._by_arena(homes)
        others = self._by_arena(elsewhere)
        # The homes count: each copy is their own or one they list. Deleting a key takes its
        # other copies too, counted apart.
        calls = [self._unpublish_call(arena.id, counter, args) for arena, _, args in groups]
        calls += [
            self._unpublish_call(arena.id, "replicas_dropped", args) for arena, _, args in others
        ]
        removed = 0
        notices: list[Any] = []
        for position, value in enumerate(self._run(calls).values):
            _raise_unexpected(value)
            if _ok(value):
                if position < len(groups):
                    removed += int(value[1])
                notices += value[2]
        if notices:
            self._release_at_hosts(notices)
        return removed

    def _unpublish_call(self, arena: int, counter: str, args: list[Any]) -> Call:
        from kvfabric.indexes.redis_shards import Call

        prefix = arena_prefix(self._ns, arena)
        return Call(
            slot=key_slot(prefix),
            args=("FCALL", "kvf1_unpublish", 1, prefix + b"m", self._grace_ms, counter, *args),
        )

    # -- upkeep, counters ---------------------------------------------------------------------

    def tick(self) -> None:
        """Read the registry if it changed, drop nodes whose liveness key expired, finish
        dropping arenas, and now and then sweep every arena's leases and retired slots."""
        try:
            view = self._refresh()
            self._forget_old_puts()
            orphans = self._take_orphans()
            if orphans:
                self._run(self._abort_calls(orphans))
            for node in self._registry_call("kvf1_silent", read_only=True):
                if self.remove_node(int(node)):
                    self._count(nodes_expired=1)
            if view.dropped:
                self._drop_arenas(sorted(view.dropped))
            now = time.monotonic()
            if now - self._last_upkeep >= _UPKEEP_INTERVAL:
                self._last_upkeep = now
                self._run(
                    [self._call(a, "kvf1_tick", self._grace_ms) for a in view.arenas.values()]
                )
        except ControllerUnavailableError:
            pass  # the next tick tries again

    def _forget_old_puts(self) -> None:
        """Puts whose writer never published: their leases ran out, Redis dropped them."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, put in self._puts.items() if put.deadline < now]:
                del self._puts[key]

    def stats(self) -> dict[str, int]:
        view = self._refresh()
        arenas = list(view.arenas.values())
        result = self._run([self._call(a, "kvf1_stats", read_only=True) for a in arenas])
        totals = dict.fromkeys(_ARENA_COUNTERS, 0)
        gauges = dict.fromkeys(("n_pub", "n_pend", "size", "free", "retired", "payload"), 0)
        masters = self._shards.masters()
        per_shard: dict[str, dict[str, int]] = {m: {"entries": 0, "used": 0} for m in masters}
        for reply, shard in zip(result.values, result.shards, strict=True):
            if isinstance(reply, Exception) or not reply or reply[0] is None:
                continue
            fields = {
                reply[i].decode(): int(reply[i + 1]) if reply[i + 1].isdigit() else 0
                for i in range(0, len(reply), 2)
            }
            for name in totals:
                totals[name] += fields.get(name, 0)
            for name in gauges:
                gauges[name] += fields.get(name, 0)
            used = fields.get("size", 0) - fields.get("free", 0) - fields.get("retired", 0)
            slot = per_shard.setdefault(shard, {"entries": 0, "used": 0})
            slot["entries"] += fields.get("n_pub", 0)
            slot["used"] += used
        with self._lock:
            client = dict(self._counters)
        out = {
            **totals,
            **client,
            "nodes": len(view.nodes),
            "arenas": len(arenas),
            "entries": gauges["n_pub"],
            "pending": gauges["n_pend"],
            "capacity_bytes": gauges["size"],
            "free_bytes": gauges["free"],
            "retired_bytes": gauges["retired"],
            "used_bytes": gauges["size"] - gauges["free"] - gauges["retired"],
            "stored_payload_bytes": gauges["payload"],
            "shards": len(masters),
            "rounds": self._shards.rounds,
            "round_trips": self._shards.round_trips,
            "failed_round_trips": self._shards.failed_round_trips,
            "topology_refreshes": self._shards.refreshes,
        }
        trips = self._shards.round_trips_by_master()
        for i, master in enumerate(sorted(per_shard)):
            out[f"shard{i}_entries"] = per_shard[master]["entries"]
            out[f"shard{i}_used_bytes"] = per_shard[master]["used"]
            out[f"shard{i}_round_trips"] = trips.get(master, 0)
        return out

    def shared_stats(self) -> dict[str, int]:
        # Lookups run read-only in Redis (FCALL_RO) and count nothing there: they, the
        # rounds and every other client-side counter belong to each client's own stats.
        local = {*_CLIENT_COUNTERS, *_ROUND_COUNTERS}
        return {
            name: value
            for name, value in self.stats().items()
            if name not in local and not name.endswith("_round_trips")
        }

    def round_trip_counts(self) -> dict[str, int]:
        """Rounds and round trips this client made so far (``rounds``, ``round_trips``, and
        one count per master address), read without asking Redis."""
        return {
            "rounds": self._shards.rounds,
            "round_trips": self._shards.round_trips,
            **self._shards.round_trips_by_master(),
        }

    @property
    def namespace(self) -> str:
        return self._ns

    @property
    def epoch(self) -> int:
        """The registry's epoch as last read (by ``tick``, ``nodes`` or a registration):
        it moves whenever a node registers or goes, so routes cached by node can be
        checked without asking Redis."""
        with self._lock:
            return self._view.epoch

    def home(self, key: bytes) -> tuple[int, int]:
        """(node, region) of the arena that owns ``key``: where a grant for it is placed."""
        arena = self._current().ring.arena_of(key)
        return arena.node, arena.region

    def shard_of(self, key: bytes) -> str:
        """Address of the Redis master holding ``key``'s entry (where its lookups go)."""
        view = self._current()
        if not view.ring:
            return ""
        self._shards.refresh()
        return self._shards.master_of(view.ring.arena_of(key).slot)

    def purge(self) -> None:
        """Delete everything this namespace holds in Redis (every node, entry and counter)."""
        view = self._refresh(force=True)
        for node in list(view.nodes):
            self.remove_node(node)
        view = self._refresh(force=True)
        self._drop_arenas(sorted(set(view.arenas) | view.dropped))
        self._registry_call("kvf1_purge")
        with self._lock:
            self._view = _EMPTY
            self._stale = True

    def close(self) -> None:
        self._shards.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _call(self, arena: Arena, function: str, *args: Any, read_only: bool = False) -> Call:
        from kvfabric.indexes.redis_shards import Call

        command = "FCALL_RO" if read_only else "FCALL"
        return Call(slot=arena.slot, args=(command, function, 1, arena.meta, *args))

    def _run(self, calls: Sequence[Call], *, wait_replicas: int = 0) -> Round:
        """One round; raises ControllerUnavailableError when no master answered at all."""
        result = self._shards.run(calls, wait_replicas=wait_replicas)
        failed = sum(isinstance(v, ControllerUnavailableError) for v in result.values)
        if failed:
            self._count(unavailable_calls=1)
            if failed == len(calls):
                first = next(v for v in result.values if isinstance(v, Exception))
                raise first
        return result

    @staticmethod
    def _by_arena(
        items: Iterable[tuple[Arena, list[Any]]],
    ) -> list[tuple[Arena, list[int], list[Any]]]:
        """Items grouped by arena: (arena, item positions, concatenated arguments)."""
        groups: dict[int, tuple[Arena, list[int], list[Any]]] = {}
        for position, (arena, args) in enumerate(items):
            group = groups.get(arena.id)
            if group is None:
                group = groups[arena.id] = (arena, [], [])
            group[1].append(position)
            group[2].extend(args)
        return list(groups.values())

    @staticmethod
    def _group_keys(view: _View, keys: Sequence[bytes]) -> list[tuple[Arena, list[int], list[Any]]]:
        return [(arena, where, [keys[i] for i in where]) for arena, where in view.ring.group(keys)]

    def _gone(self) -> None:
        with self._lock:
            self._stale = True
            self._counters["stale_arenas"] += 1

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] += amount


def _alternates(entry: bytes, view: _View) -> tuple[Descriptor, ...]:
    """The other copies an entry lists, those on nodes still registered."""
    tail = entry[_ENTRY_HEAD:]
    if entry[DESCRIPTOR_SIZE] == _FOREIGN:
        tail = tail[8:]
    usable = len(tail) - len(tail) % DESCRIPTOR_SIZE
    return tuple(d for d in Descriptor.many_from_bytes(tail[:usable]) if d.node in view.nodes)


def _allocation_answer(
    reply: Any,
) -> tuple[int, list[Any], list[Any], list[Any]] | Literal["gone"] | None:
    """An arena's ``kvf1_allocate`` reply as (evictions, kinds, entries, notices of keys held
    elsewhere); ``"gone"`` for an arena that is gone (replaced, or not initialised yet by a
    registering node); None where the call failed, so that nothing was granted there (an
    unexpected failure raises)."""
    if isinstance(reply, Exception):
        _raise_unexpected(reply)
        return None
    if reply[0] == b"gone":
        return "gone"
    _, evicted, kinds, entries, found = reply
    return int(evicted), kinds, entries, found


def _ok(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and value[0] == b"ok"


def _raise_unexpected(value: Any) -> None:
    """A function failing inside Redis is a bug, not an outage: never read it as a miss."""
    if isinstance(value, Exception) and not isinstance(value, ControllerUnavailableError):
        raise value


@hookimpl
def kvfabric_register_indexes(registry: Registry[IndexPlugin]) -> None:
    registry.add(RedisIndex.name, RedisIndex)
