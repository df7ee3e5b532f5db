"""An :class:`~kvfabric.spi.Index` served by a controller process, one round trip per call."""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric._control.client import ControlClient, ControllerRefusedError
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import ErrorCode, ImageLocation, MsgType
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ProtocolError
from kvfabric.spi.index import (
    AllocateResult,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
    Index,
    NodeInfo,
)

__all__ = ["RemoteIndex", "fetch_stats"]


class RemoteIndex(Index):
    """The index a controller serves, one control round trip per call."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        self._leases_extents = False

    def leases_extents(self) -> bool:
        """What the controller said when this client last asked where its image is."""
        return self._leases_extents

    def nodes(self) -> list[NodeInfo]:
        r = self.client.call(MsgType.NODES)
        nodes = p.read_nodes(r)
        r.end()
        return nodes

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[Descriptor]:
        return [d for d in self.lookup_copies(keys).descriptors if d is not None]

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        return list(self.resolve_copies(keys).descriptors)

    def lookup_copies(self, keys: Sequence[bytes]) -> Copies:
        r = self.client.call(MsgType.LOOKUP_PREFIX, p.write_keys(keys))
        found = p.read_copies(r, optional=False)
        r.end()
        return found

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        r = self.client.call(MsgType.RESOLVE, p.write_keys(keys))
        found = p.read_copies(r, optional=True)
        r.end()
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        r = self.client.call(MsgType.EXISTS, p.write_keys(keys))
        flags = p.read_flags(r)
        r.end()
        return flags

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        r = self.client.call(MsgType.ALLOCATE, p.write_allocation_requests(requests))
        result = p.read_allocate_result(r)
        r.end()
        return result

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        r = self.client.call(MsgType.PUBLISH, p.write_grants(grants))
        flags = p.read_flags(r)
        r.end()
        return flags

    def lease_extents(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int] = (),
        returned: Sequence[int] = (),
    ) -> list[Extent]:
        body = p.write_lease_request(need, want, count, exclude, returned)
        r = self.client.call(MsgType.LEASE_EXTENTS, body)
        extents = p.read_extents(r)
        r.end()
        if len(extents) > count:
            raise ProtocolError(f"{len(extents)} extents leased of {count} asked for")
        return extents

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes] = ()
    ) -> list[CarveOutcome]:
        r = self.client.call(MsgType.PUBLISH_CARVED, p.write_carved(records, again))
        outcomes = p.read_carve_outcomes(r)
        r.end()
        if len(outcomes) != len(records):
            raise ProtocolError(f"{len(outcomes)} outcomes for {len(records)} records")
        return outcomes

    def abort(self, grants: Sequence[GrantRef]) -> None:
        self.client.call(MsgType.ABORT, p.write_grants(grants)).end()

    def unpublish(self, keys: Sequence[bytes]) -> int:
        r = self.client.call(MsgType.UNPUBLISH, p.write_keys(keys))
        removed = r.u32()
        r.end()
        return removed

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        r = self.client.call(MsgType.REPORT_INVALID, p.write_grants(records))
        dropped = r.u32()
        r.end()
        return dropped

    def stats(self) -> dict[str, int]:
        return fetch_stats(self.client)["index"]

    def touch(self, keys: Sequence[bytes]) -> None:
        self.client.call(MsgType.TOUCH, p.write_keys(keys)).end()

    def image_location(self) -> ImageLocation | None:
        """Where the controller serves its index's lookup image; None if it serves none
        (or predates lookup images)."""
        try:
            r = self.client.call(MsgType.IMAGE)
        except ControllerRefusedError as exc:
            if exc.code == ErrorCode.UNKNOWN_TYPE:
                return None
            raise
        location = p.read_image_location(r)
        r.end()
        self._leases_extents = location is not None and location.extents
        return location


def fetch_stats(client: ControlClient) -> dict[str, dict[str, int]]:
    """Every scope of counters the controller reports: "controller", "index", "node N ..."."""
    r = client.call(MsgType.STATS)
    scopes = {}
    for _ in range(r.count(8, 1 << 16)):
        scope = r.text()
        scopes[scope] = p.read_counters(r)
    r.end()
    return scopes
