"""The index interface and the values that cross it.

The control plane's map from key to entry, behind an interface so it can be served by a
controller process, embedded in the caller, or later sharded or backed by a distributed
store. Every method is batched: one call is one control round trip.

**Replicas.** An index configured with ``replicas=k`` (:attr:`IndexConfig.replicas`) stores
each value on up to k distinct data nodes. ``allocate`` grants the first copy as today and
the others in :attr:`Allocation.replicas`; the writer writes every copy and publishes those
that landed (one :class:`GrantRef` per copy); lookups name the copy to read first and, in
:class:`Copies`, the others, so a read whose node is dead or whose record fails validation
tries the next copy in the same call. Indexes without replicas need none of it: the
``*_copies`` methods default to the plain ones.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvfabric._runtime.codec import Reader, Writer
from kvfabric.descriptor import Descriptor
from kvfabric.errors import NotSupportedError, ProtocolError
from kvfabric.spi.backend import Region
from kvfabric.spi.events import EngineBlock, IndexEvents
from kvfabric.spi.options import Plugin
from kvfabric.spi.transport import NodeEndpoint

__all__ = [
    "AllocateResult",
    "Allocation",
    "AllocationKind",
    "AllocationRequest",
    "CarveOutcome",
    "CarvedRecord",
    "Copies",
    "Extent",
    "GrantRef",
    "Index",
    "IndexConfig",
    "IndexPlugin",
    "NodeInfo",
    "RegionInfo",
]


class AllocationKind(enum.Enum):
    GRANTED = 1
    """A free slot, a new version and a lease: write the record, then publish."""
    EXISTS = 2
    """Already published: retention +1, no bytes move."""
    IN_FLIGHT = 3
    """Another writer holds the grant: skip."""
    NO_SPACE = 4
    """Nothing fits, even after eviction (or evicted slots are still in their grace period)."""


@attrs.frozen(kw_only=True)
class AllocationRequest:
    key: bytes
    length: int


@attrs.frozen(kw_only=True)
class Allocation:
    kind: AllocationKind
    descriptor: Descriptor | None = None
    """The grant (GRANTED; its ``crc`` is set when it is published) or the existing record."""
    replicas: tuple[Descriptor, ...] = ()
    """With ``replicas`` > 1: grants of further copies of the value, each on a data node no
    other copy uses. GRANTED: the rest of the copies (fewer than asked for when fewer nodes
    have room: the index counts the shortfall as ``replica_shortfall``). EXISTS: copies the
    stored key lacks (a node holding one was lost), granted to repair it from free space; the
    writer writes and publishes them like any grant."""


@attrs.frozen(kw_only=True)
class AllocateResult:
    allocations: tuple[Allocation, ...]
    evictions: int = 0
    """Entries this call evicted to make room."""
    lease: float = 0.0
    """Seconds the grants are valid from the allocate (0: not said). A writer that finds it
    has used up a good part of it does not write at all: a slot whose lease ran out may
    already hold another key's record."""


@attrs.frozen(kw_only=True)
class GrantRef:
    """A grant being published (with the CRC32C of what was written) or aborted."""

    key: bytes
    version: int
    crc: int = 0

    @classmethod
    def of(cls, descriptor: Descriptor, crc: int | None = None) -> GrantRef:
        return cls(
            key=descriptor.key,
            version=descriptor.version,
            crc=descriptor.crc if crc is None else crc,
        )


class CarveOutcome(enum.Enum):
    """What publishing one record carved from an extent did."""

    STORED = 1
    """Published: readable through its key."""
    EXISTS = 2
    """The key was already published (retention +1): the record's bytes are not used."""
    IN_FLIGHT = 3
    """Another writer holds a grant for the key: the record's bytes are not used."""
    REFUSED = 4
    """Not published: the extent is unknown or its lease ran out, or the record does not
    lie in the extent's unused part (before an earlier record, past its end, misaligned) or
    does not carry one of its versions."""


@attrs.frozen(kw_only=True)
class Extent:
    """A run of one region leased to one writer, which lays records into it itself.

    The writer carves records from ``offset`` on, in order, each at the next multiple of
    :data:`~kvfabric._runtime.record.SLOT_ALIGN` after the last, versions counting up from
    ``first_version``; then one :meth:`Index.publish_carved` makes them readable. A put
    then costs one control round trip (the publish) where ``allocate`` + ``publish`` cost
    two, and the index places nothing per key. The lease works as a grant's: past it the
    index takes the unused part back, and a writer that used much of it leases anew. A
    writer spreads a put over the nodes by holding an extent on each.
    """

    id: int
    node: int
    region: int
    rkey: int
    offset: int
    size: int
    first_version: int
    versions: int
    """How many versions, from ``first_version``, records carved from it may carry: one
    per smallest record it could hold (writers count on as many)."""
    lease: float
    """Seconds the extent is leased for, from the call that leased it."""
    evictions: int = 0
    """Entries the call that leased it evicted to make room (on the first extent it
    leased; 0 on the others)."""
    nodes_generation: int = 0
    """The index's nodes generation when it was leased (also in its lookup image's header):
    a writer uses the extent only while the image says the same. A node that restarted
    since may have lost the extent (the index dropped it with the node's old regions, and
    may have handed its space to others), and the writer hears of it in no other way
    without asking."""

    @property
    def end(self) -> int:
        return self.offset + self.size


@attrs.frozen(kw_only=True)
class CarvedRecord:
    """A record written into an extent, being published."""

    extent: int
    key: bytes
    offset: int
    length: int
    """The payload's length (the record is its header, then the payload)."""
    version: int
    crc: int


@attrs.frozen(kw_only=True)
class Copies:
    """What a lookup found where values may be stored on several nodes.

    ``descriptors`` is what :meth:`Index.lookup_prefix` (the leading run) or
    :meth:`Index.resolve` (one per key, None for a miss) returns: the copy to read first.
    ``alternates`` maps a position in it to the key's other copies, in the order a read
    tries them; keys stored once are absent.
    """

    descriptors: Sequence[Descriptor | None]
    alternates: Mapping[int, tuple[Descriptor, ...]] = attrs.field(factory=dict)


MAX_REGIONS = 4096
"""Regions one node may register: with 1 GiB regions, 4 TiB of memory per node."""
MAX_REGION_SIZE = 1 << 44
"""16 TiB: more than any one mapping a node could hold, and far from overflowing the u64
counters that sum region sizes."""
MAX_ENDPOINTS = 64


@attrs.frozen(kw_only=True)
class RegionInfo:
    id: int
    size: int
    rkey: int


@attrs.frozen(kw_only=True)
class NodeInfo:
    """A data node as the index knows it: its memory and how to reach it."""

    name: str
    """Stable, unique name the node chose; re-registering under it keeps the node's id."""
    regions: tuple[RegionInfo, ...]
    endpoints: tuple[NodeEndpoint, ...]
    """One per transport the node serves; ``endpoint.node`` is filled in by the index."""
    id: int = 0
    """Assigned by the index; never given to another node (another name)."""
    incarnation: int = 0
    """Assigned by the index, new at every registration: what clients cache about a node
    (routes, mappings, connections) is keyed by it, and relearned when it changes."""
    instance: int = 0
    """Chosen by the node process at start (random): tells a node re-registering from a
    second process claiming its name."""
    restoring: bool = False
    """The node holds records it will report (``IndexPlugin.restore``); its regions take no
    new grants until it says it is done."""

    def write_to(self, w: Writer) -> None:
        w.u32(self.id).u64(self.incarnation).u64(self.instance).u8(1 if self.restoring else 0)
        w.text(self.name).u32(len(self.regions))
        for region in self.regions:
            w.u32(region.id).u64(region.size).u64(region.rkey)
        w.u32(len(self.endpoints))
        for endpoint in self.endpoints:
            endpoint.write_to(w)

    @classmethod
    def read_from(cls, r: Reader) -> NodeInfo:
        node_id, incarnation, instance, flags = r.u32(), r.u64(), r.u64(), r.u8()
        name = r.text(256)
        # Bounded before anything is built: one frame must not make the controller hold
        # (or loop over) an absurd number of regions, nor one region of absurd size.
        regions = tuple(
            RegionInfo(id=r.u32(), size=r.u64(), rkey=r.u64())
            for _ in range(r.count(20, MAX_REGIONS))
        )
        if any(region.size > MAX_REGION_SIZE for region in regions):
            raise ProtocolError(f"a region larger than {MAX_REGION_SIZE} bytes is refused")
        if len({region.id for region in regions}) != len(regions):
            raise ProtocolError("a node registered two regions with one id")
        endpoints = tuple(NodeEndpoint.read_from(r) for _ in range(r.count(12, MAX_ENDPOINTS)))
        return cls(
            name=name,
            regions=regions,
            endpoints=endpoints,
            id=node_id,
            incarnation=incarnation,
            instance=instance,
            restoring=bool(flags & 1),
        )

    def to_bytes(self) -> bytes:
        w = Writer()
        self.write_to(w)
        return w.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> NodeInfo:
        r = Reader(data)
        info = cls.read_from(r)
        r.end()
        return info


class Index(abc.ABC):
    """What a client needs from the index; every method is one batched call.

    Implemented by index plugins (:class:`IndexPlugin`) and by the client of a controller
    that serves one. Methods may raise :class:`~kvfabric.errors.ControllerUnavailableError`
    when the index cannot be reached; the store turns that into misses.
    """

    @abc.abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """The data nodes and how to reach them."""

    @abc.abstractmethod
    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        """Descriptors of the leading run of published keys (stops at the first gap)."""

    @abc.abstractmethod
    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Descriptor of every published key, ``None`` for the others."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is published."""

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        """:meth:`lookup_prefix`, with the other copies of each key found (same call)."""
        return Copies(descriptors=self.lookup_prefix(keys))

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        """:meth:`resolve`, with the other copies of each key found (same call)."""
        return Copies(descriptors=self.resolve(keys))

    @abc.abstractmethod
    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        """Per key: EXISTS (retention +1), IN_FLIGHT, a GRANTED slot with a lease, or NO_SPACE."""

    @abc.abstractmethod
    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        """Make written grants visible with their CRC; False where the lease ran out.

        The CRC comes with the publish, not the allocate, so a put of values that are
        already stored costs one round trip and no checksum at all.

        With replicas, one grant per copy that landed: the key becomes visible with those
        copies and its grants not named are dropped (their slots retire), so a copy whose
        node failed costs no abort call. True for each copy now readable through the key.
        """

    @abc.abstractmethod
    def abort(self, grants: Sequence[GrantRef]) -> None:
        """Give up grants that were not (fully) written; their slots are retired."""

    @abc.abstractmethod
    def unpublish(self, keys: Sequence[bytes]) -> int:
        """Remove keys at once; their slots are retired, reused only after the grace period."""

    @abc.abstractmethod
    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        """A reader found these published records invalid (torn, overwritten by a late
        writer): unpublish each whose published version still matches, so the next put of
        its key stores it again; returns how many went. With replicas only that copy goes
        (each copy has a version of its own); the key stays readable from the others."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters and gauges (entries, capacity, hits, evictions, ...)."""

    def shared_stats(self) -> dict[str, int]:
        """The counters of the index's shared state alone, for processes that read a
        *shared* index without being its clients (``kvfabric stats --index``, a data node's
        metrics): :meth:`stats` less what counts this process's own calls (a shared index's
        lookups, say, run in each client and are counted there), which would read as zero.
        By default: :meth:`stats`."""
        return self.stats()

    def leases_extents(self) -> bool:
        """Whether :meth:`lease_extents` may lease any (no round trip: writers ask it before
        every put). By default: no."""
        return False

    def lease_extents(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int] = (),
        returned: Sequence[int] = (),
    ) -> list[Extent]:
        """Give back the unused part of the extents ``returned`` (their ids: the writer is
        done with them), then lease up to ``count`` extents, each on another data node and
        none on a node in ``exclude``, each of at least ``need`` bytes and up to ``want``.
        One round trip.

        Fewer (none) when fewer nodes have ``need`` bytes to give, or when this index
        leases none: the writer then allocates per key. By default an index leases none
        (and takes ``returned`` as nothing to do).
        """
        return []

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes] = ()
    ) -> list[CarveOutcome]:
        """Publish records written into extents, each extent's in the order they lie in
        it: one outcome per record. Space the records skip in an extent (where a record was
        not published) is taken back, as an aborted grant's slot is.

        ``again``: keys the writer found stored already (in the lookup image) and so did
        not write: each published one counts as stored once more and used now, as an
        ``allocate`` that finds it does (``EXISTS``)."""
        raise NotSupportedError(f"{type(self).__name__} leases no extents")

    def publish_described(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock]
    ) -> list[bool]:
        """:meth:`publish`, with what the events should say of some of the keys (by key:
        the writer attached an :class:`~kvfabric.spi.EngineBlock` to them; see
        :mod:`kvfabric.spi.events`). Called instead of :meth:`publish` only where a writer
        attached any. By default the blocks are dropped: an index that reports no events
        (:meth:`IndexPlugin.report_events`) has no use for them."""
        return self.publish(grants)

    def publish_carved_described(
        self,
        records: Sequence[CarvedRecord],
        again: Sequence[bytes],
        blocks: Mapping[bytes, EngineBlock],
    ) -> list[CarveOutcome]:
        """:meth:`publish_carved`, with what the events should say of some of the keys (as
        :meth:`publish_described`). By default the blocks are dropped."""
        return self.publish_carved(records, again)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Clients used these keys without asking the index (they read its lookup image):
        count them as used now, so eviction still sees the use. Clients send these in the
        background, batched, at most about once a second. By default: a resolve."""
        self.resolve(keys)


@attrs.frozen(kw_only=True)
class IndexConfig:
    """What every index is configured with (the same for every plugin), plus its own options."""

    lease: float = 30.0
    """Seconds a writer has between allocate and publish."""
    grace: float = 2.0
    """Seconds a freed slot waits before reuse (a reader may still hold its descriptor)."""
    headroom: float = 0.05
    """Share of capacity kept free, or on its way to free, by evicting ahead of need."""
    options: Mapping[str, Any] = attrs.field(factory=dict)
    """The plugin's declared options, parsed (every one present, defaulted if not given)."""
    address: str = ""
    """HOST:PORT from the store URL (``kvfabric://HOST:PORT?index=NAME``), for a shared index
    that lives elsewhere; empty when none was given."""
    replicas: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Copies of each value, on distinct data nodes (fewer when fewer nodes have room).
    Set where the index's writes are decided: ``kvfabric controller --replicas K``,
    ``embedded://?replicas=K``, or for a shared index the writers' URL
    (``kvfabric://HOST:PORT?index=redis&replicas=K``). Readers need not know it: lookups
    return the copies there are. An index whose class says ``supports_replicas = False``
    refuses more than 1."""


class IndexPlugin(Plugin, Index):
    """An index plugin: the whole index, including the data nodes' membership.

    Selected by name from entry-point group ``kvfabric.indexes`` (``embedded://?index=NAME``,
    ``kvfabric controller --index NAME``); its declared ``options`` come from the URL
    (``?NAME.OPTION=VALUE``) or ``--index-opt NAME.OPTION=VALUE``. It must be thread-safe.

    A *shared* index keeps its state outside the processes that use it (in Redis, say):
    clients (``kvfabric://HOST:PORT?index=NAME``) and data nodes
    (``kvfabric node --index NAME``) then use it directly, with no controller in the
    metadata path, and each of them calls :meth:`tick` now and then. An index that is not
    shared lives in one process and is served to the others by a controller.
    """

    shared: ClassVar[bool] = False
    supports_replicas: ClassVar[bool] = False
    """Whether the index can keep values on several nodes (``IndexConfig.replicas`` > 1)."""

    @classmethod
    @abc.abstractmethod
    def create(cls, config: IndexConfig) -> IndexPlugin:
        """A new, empty index."""

    @classmethod
    def check_replicas(cls, replicas: int) -> None:
        """Raise :class:`NotSupportedError` when ``replicas`` asks more than the index can."""
        if replicas > 1 and not cls.supports_replicas:
            raise NotSupportedError(
                f"index {cls.name!r} keeps one copy of each value: replicas={replicas} needs "
                "an index that supports replicas (memory, redis)"
            )

    @abc.abstractmethod
    def register_node(self, info: NodeInfo) -> NodeInfo:
        """Add a node, or replace what the index knows of it; returns its id and incarnation.

        A name keeps its id for the index's lifetime; every registration gets a new
        incarnation. Re-registration replaces the node's regions: entries in regions that
        are gone or changed (size, rkey) are dropped, and with ``restoring`` set every
        region waits for the node's records (:meth:`restore`) before taking grants.
        """

    @abc.abstractmethod
    def heartbeat(self, node: int, incarnation: int) -> bool:
        """The node is alive; False when that incarnation is not the registered one (the
        node was dropped, or registered again from elsewhere): it must register again.

        A shared index keeps liveness itself (a node that stops heartbeating is dropped by
        whoever ticks); under a controller, the controller tracks heartbeats and this only
        checks the incarnation.
        """

    @abc.abstractmethod
    def remove_node(self, node: int) -> int:
        """Forget a node and every entry on it; returns how many entries went.

        The node's id stays reserved for its name: it is never given to another node.
        """

    @abc.abstractmethod
    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        """Publish records a node found in its own memory; returns how many were kept.

        Called after the node registered with ``restoring`` set (it restarted with a file
        backend, or this index restarted and lost its entries), possibly several times, then
        :meth:`restore_done`. A record is dropped when it does not fit its region, overlaps
        one already kept, or its key is already published or being written (a key found on
        two nodes is kept once). Kept records are published at once (retention and last use
        start afresh).
        """

    @abc.abstractmethod
    def restore_done(self, node: int) -> None:
        """The node reported all its records: the rest of its regions take new grants."""

    def tick(self) -> None:
        """Periodic upkeep (lease expiry, retired slots); the owner calls it every ~0.25 s."""

    def idle(self) -> None:
        """Upkeep that can wait for a quiet moment. An owner that serves requests (a
        controller) calls it whenever it has answered every request waiting; an index may
        then leave such work to it rather than do it before a reply (the memory index
        evicts ahead of need here once an owner has called it). Never required: an owner
        that does not call it keeps every call as it was."""

    def report_events(self, events: IndexEvents) -> bool:
        """Tell ``events`` from now on of every entry stored and removed, and of the index
        emptied (see :mod:`kvfabric.spi.events`); False where this index reports none (the
        default: an index may ignore events). Called once, by the owner that publishes them
        (a controller started with ``--kv-events``), before the index serves anything. An
        index that does keeps each entry's engine hash (from :meth:`publish_described`) for
        its removal."""
        return False

    def lookup_image(self) -> Region | None:
        """The index's lookup image (:mod:`kvfabric._runtime.image`), kept up to date from this
        call on; None when the index keeps none. A controller that serves the image asks
        once, registers it with its transport servers and tells clients where it is."""
        return None

    def close(self) -> None:
        """Release what the index holds (connections, threads)."""
