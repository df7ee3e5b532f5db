"""The index interface and the values that cross it.

The control plane's map from key to entry, behind an interface so it can be served by a
controller process, embedded in the caller, or later sharded or backed by a distributed
store. Every method is batched: one call is one control round trip.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvfabric.descriptor import Descriptor
from kvfabric.spi.codec import Reader, Writer
from kvfabric.spi.transport import NodeEndpoint

__all__ = [
    "AllocateResult",
    "Allocation",
    "AllocationKind",
    "AllocationRequest",
    "GrantRef",
    "Index",
    "NodeInfo",
    "NodeRegistry",
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


@attrs.frozen(kw_only=True)
class AllocateResult:
    allocations: tuple[Allocation, ...]
    evictions: int = 0
    """Entries this call evicted to make room."""


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

    def write_to(self, w: Writer) -> None:
        w.u32(self.id).text(self.name).u32(len(self.regions))
        for region in self.regions:
            w.u32(region.id).u64(region.size).u64(region.rkey)
        w.u32(len(self.endpoints))
        for endpoint in self.endpoints:
            endpoint.write_to(w)

    @classmethod
    def read_from(cls, r: Reader) -> NodeInfo:
        node_id, name = r.u32(), r.text()
        regions = tuple(
            RegionInfo(id=r.u32(), size=r.u64(), rkey=r.u64()) for _ in range(r.count(20))
        )
        endpoints = tuple(NodeEndpoint.read_from(r) for _ in range(r.count(12, 64)))
        return cls(name=name, regions=regions, endpoints=endpoints, id=node_id)

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


@runtime_checkable
class Index(Protocol):
    """What a client needs from the index; every method is one control round trip."""

    def nodes(self) -> list[NodeInfo]:
        """The data nodes and how to reach them."""
        ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        """Descriptors of the leading run of published keys (stops at the first gap)."""
        ...

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Descriptor of every published key, ``None`` for the others."""
        ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult: ...

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        """Make written grants visible with their CRC; False where the lease ran out.

        The CRC comes with the publish, not the allocate, so a put of values that are
        already stored costs one round trip and no checksum at all.
        """
        ...

    def abort(self, grants: Sequence[GrantRef]) -> None: ...

    def unpublish(self, keys: Sequence[bytes]) -> int:
        """Remove keys at once; their slots are retired, reused only after the grace period."""
        ...

    def stats(self) -> dict[str, int]: ...


@runtime_checkable
class NodeRegistry(Protocol):
    """What the controller needs besides :class:`Index`: data nodes joining and leaving."""

    def register_node(self, info: NodeInfo) -> NodeInfo:
        """Add (or refresh) a node's regions; returns the info with its assigned id."""
        ...

    def remove_node(self, node: int) -> int:
        """Forget a node and every entry on it; returns how many entries went."""
        ...
