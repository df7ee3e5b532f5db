"""The clients' requests a controller serves: each decoded, applied to the index, encoded.

Lookups (``NODES``, ``LOOKUP_PREFIX``, ``RESOLVE``, ``EXISTS``, ``IMAGE``), writes
(``ALLOCATE``, ``PUBLISH``, ``ABORT``, ``LEASE_EXTENTS``, ``PUBLISH_CARVED``), removals
(``UNPUBLISH``, ``REPORT_INVALID``) and use reports (``TOUCH``). Every handler reads its
whole frame before it returns what applying it does, so a frame refused for any reason
has no effect.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvfabric._control.image_publisher import ImagePublisher
from kvfabric._control.refusal import Handler
from kvfabric._control.reservations import Reservations
from kvfabric._runtime.codec import Reader, Writer
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import MsgType
from kvfabric.spi.events import EngineBlock
from kvfabric.spi.index import Allocation, AllocationKind, GrantRef, IndexPlugin

__all__ = ["CLIENT_TYPES", "ClientRequests"]

CLIENT_TYPES = frozenset(
    {
        MsgType.NODES,
        MsgType.LOOKUP_PREFIX,
        MsgType.RESOLVE,
        MsgType.EXISTS,
        MsgType.ALLOCATE,
        MsgType.PUBLISH,
        MsgType.ABORT,
        MsgType.UNPUBLISH,
        MsgType.IMAGE,
        MsgType.LEASE_EXTENTS,
        MsgType.PUBLISH_CARVED,
    }
)
"""Requests that serve clients' lookups and writes: what "control RPCs" counts."""


class ClientRequests:
    """The handlers of clients' requests against one index (``handlers``, by type)."""

    def __init__(
        self,
        index: IndexPlugin,
        image: ImagePublisher,
        reservations: Reservations,
        *,
        kv_events: bool = False,
    ) -> None:
        """``reservations``: what each client holds reserved, and its bound. ``kv_events``:
        the index reports KV events, so what writers say of their keys is read and passed
        on (else it is skipped unread)."""
        self._kv_events = kv_events
        self._index = index
        self._image = image
        self._reservations = reservations
        self.handlers: dict[int, Handler] = {
            MsgType.NODES: self._nodes,
            MsgType.LOOKUP_PREFIX: self._lookup_prefix,
            MsgType.RESOLVE: self._resolve,
            MsgType.EXISTS: self._exists,
            MsgType.ALLOCATE: self._allocate,
            MsgType.PUBLISH: self._publish,
            MsgType.ABORT: self._abort,
            MsgType.UNPUBLISH: self._unpublish,
            MsgType.REPORT_INVALID: self._report_invalid,
            MsgType.IMAGE: self._image_location,
            MsgType.TOUCH: self._touch,
            MsgType.LEASE_EXTENTS: self._lease_extents,
            MsgType.PUBLISH_CARVED: self._publish_carved,
        }

    def _nodes(self, r: Reader) -> Callable[[], bytes]:
        return lambda: p.write_nodes(self._index.nodes())

    def _lookup_prefix(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        # With replicas the reply ends with the keys' other copies (absent when none).
        return lambda: p.write_copies(self._index.lookup_copies(keys), optional=False)

    def _resolve(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: p.write_copies(self._index.resolve_copies(keys), optional=True)

    def _exists(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: p.write_flags(self._index.exists(keys))

    def _allocate(self, r: Reader) -> Callable[[], bytes]:
        client = p.read_client(r)
        requests = p.read_allocation_requests(r)

        def apply() -> bytes:
            reservations = self._reservations
            admitted = reservations.admit(client, requests)
            result = self._index.allocate(
                requests[:admitted] if admitted < len(requests) else requests
            )
            reservations.granted(client, result)
            if admitted < len(requests):
                # Past this client's bound: refused as a full store would refuse them.
                refused = (_NO_SPACE,) * (len(requests) - admitted)
                result = attrs.evolve(result, allocations=result.allocations + refused)
            return p.write_allocate_result(result)

        return apply

    def _publish(self, r: Reader) -> Callable[[], bytes]:
        grants = p.read_grants(r)
        blocks = self._blocks(r)

        def apply() -> bytes:
            index = self._index
            flags = index.publish_described(grants, blocks) if blocks else index.publish(grants)
            self._reservations.published(grants, flags)
            return p.write_flags(flags)

        return apply

    def _lease_extents(self, r: Reader) -> Callable[[], bytes]:
        client = p.read_client(r)
        need, want, count, exclude, returned = p.read_lease_request(r)

        def apply() -> bytes:
            reservations = self._reservations
            reservations.returned(returned)
            room, extents = reservations.extent_room(client)
            if need > 0:
                # No more than this client may hold: fewer extents, or none (it then
                # allocates per key, under the same bound).
                allowed = min(count, extents, room // need)
                if allowed < count:
                    self._reservations.refused_extents(count - allowed)
                asked = max(need, min(want, room // max(allowed, 1)))
            else:
                allowed, asked = 0, want
            leased = self._index.lease_extents(need, asked, allowed, exclude, returned)
            reservations.leased(client, leased)
            return p.write_extents(leased)

        return apply

    def _publish_carved(self, r: Reader) -> Callable[[], bytes]:
        records, again = p.read_carved(r)
        blocks = self._blocks(r)

        def apply() -> bytes:
            index = self._index
            outcomes = (
                index.publish_carved_described(records, again, blocks)
                if blocks
                else index.publish_carved(records, again)
            )
            return p.write_carve_outcomes(outcomes)

        return apply

    def _blocks(self, r: Reader) -> dict[bytes, EngineBlock] | None:
        """What the writer said of its keys for the KV events, if it said anything; read
        only where the index reports events (else skipped: nothing would use it)."""
        if not r.remaining:
            return None
        if not self._kv_events:
            r.raw(r.remaining)
            return None
        return p.read_blocks(r)

    def _abort(self, r: Reader) -> Callable[[], bytes]:
        grants = p.read_grants(r)

        def apply() -> bytes:
            self._index.abort(grants)
            self._reservations.aborted(grants)
            # Per grant: published (its publish was served first), or not (released now,
            # if it was still pending). A writer whose publish went unanswered learns here.
            return p.write_flags(_published(self._index, grants))

        return apply

    def _unpublish(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: Writer().u32(self._index.unpublish(keys)).getvalue()

    def _image_location(self, r: Reader) -> Callable[[], bytes]:
        return lambda: p.write_image_location(self._image.location)

    def _touch(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)

        def apply() -> bytes:
            self._index.touch(keys)
            return b""

        return apply

    def _report_invalid(self, r: Reader) -> Callable[[], bytes]:
        records = p.read_grants(r)
        return lambda: Writer().u32(self._index.drop_invalid(records)).getvalue()


_NO_SPACE = Allocation(kind=AllocationKind.NO_SPACE)


def _published(index: IndexPlugin, grants: list[GrantRef]) -> list[bool]:
    """Whether each grant's key is published under that grant's version (any copy)."""
    copies = index.resolve_copies([g.key for g in grants])
    out = []
    for position, (grant, found) in enumerate(zip(grants, copies.descriptors, strict=True)):
        versions = {d.version for d in copies.alternates.get(position, ())}
        if found is not None:
            versions.add(found.version)
        out.append(grant.version in versions)
    return out
