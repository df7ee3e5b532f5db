"""An :class:`~kvfabric.spi.Index` served by a controller process, one round trip per call.

A call of a normal size is one request; a large one goes in chunks, pipelined on one socket
(:mod:`kvfabric._control.session`), and fails whole if any chunk does. A lookup of the
leading run sends no further chunk once one came back short (the run ended there). The
writes, whose outcomes must be known, are :mod:`kvfabric._control.remote_writes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from kvfabric._control.client import ControlClient, ControllerRefusedError
from kvfabric._control.remote_writes import RemoteWrites
from kvfabric._control.session import CHUNK_BYTES, CHUNK_KEYS, allowance, chunks
from kvfabric._runtime.codec import Reader
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import ErrorCode, ImageLocation, MsgType
from kvfabric._wire.usage import write_usage
from kvfabric.descriptor import Descriptor, PackedDescriptors
from kvfabric.errors import ControllerUnavailableError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.events import EngineBlock
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

T = TypeVar("T")
R = TypeVar("R")


class RemoteIndex(Index):
    """The index a controller serves, one control round trip per call."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        self._writes = RemoteWrites(client)
        self._leases_extents = False

    @property
    def client_id(self) -> int:
        """The id this client reserves space under (see :mod:`kvfabric._control.reservations`)."""
        return self._writes.client_id

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
        parts = self._ask(
            MsgType.LOOKUP_PREFIX,
            keys,
            KEY_SIZE,
            p.write_keys,
            lambda r: p.read_copies(r, optional=False),
            # The run ended in this chunk: the keys after it are not part of it.
            short=lambda part, asked: len(part.descriptors) < asked,
        )
        if len(parts) == 1:
            return parts[0]
        wires: list[bytes] = []
        alternates: dict[int, tuple[Descriptor, ...]] = {}
        found = 0
        for part in parts:
            descriptors = part.descriptors
            assert isinstance(descriptors, PackedDescriptors)
            wires.append(descriptors.wires)
            alternates.update((found + i, copies) for i, copies in part.alternates.items())
            found += len(descriptors)
        return Copies(descriptors=PackedDescriptors(b"".join(wires)), alternates=alternates)

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        parts = self._ask(
            MsgType.RESOLVE, keys, KEY_SIZE, p.write_keys, lambda r: p.read_copies(r, optional=True)
        )
        if len(parts) == 1:
            return parts[0]
        descriptors: list[Descriptor | None] = []
        alternates: dict[int, tuple[Descriptor, ...]] = {}
        for part in parts:
            offset = len(descriptors)
            descriptors += part.descriptors
            alternates.update((offset + i, copies) for i, copies in part.alternates.items())
        return Copies(descriptors=descriptors, alternates=alternates)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        parts = self._ask(MsgType.EXISTS, keys, KEY_SIZE, p.write_keys, p.read_flags)
        return [flag for part in parts for flag in part]

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        return self._writes.allocate(requests)

    def publish(self, grants: Sequence[GrantRef]) -> list[bool]:
        """Publish ``grants``; where the controller did not answer in time, what became of
        them is asked (:mod:`kvfabric._control.remote_writes`), and what stays unknown
        raises :class:`~kvfabric._control.remote_writes.OutcomeUnknownError`."""
        return self._writes.publish(grants)

    def publish_described(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock]
    ) -> list[bool]:
        """:meth:`publish`, the blocks sent with their grants for the controller's events."""
        return self._writes.publish(grants, blocks)

    def lease_extents(
        self,
        need: int,
        want: int,
        count: int,
        exclude: Sequence[int] = (),
        returned: Sequence[int] = (),
    ) -> list[Extent]:
        return self._writes.lease_extents(need, want, count, exclude, returned)

    def publish_carved(
        self, records: Sequence[CarvedRecord], again: Sequence[bytes] = ()
    ) -> list[CarveOutcome]:
        """As :meth:`publish`, for records laid into extents."""
        return self._writes.publish_carved(records, again)

    def publish_carved_described(
        self,
        records: Sequence[CarvedRecord],
        again: Sequence[bytes],
        blocks: Mapping[bytes, EngineBlock],
    ) -> list[CarveOutcome]:
        return self._writes.publish_carved(records, again, blocks)

    def abort(self, grants: Sequence[GrantRef]) -> None:
        self._writes.abort(grants)

    def unpublish(self, keys: Sequence[bytes]) -> int:
        parts = self._ask(MsgType.UNPUBLISH, keys, KEY_SIZE, p.write_keys, Reader.u32)
        return sum(parts)

    def drop_invalid(self, records: Sequence[GrantRef]) -> int:
        parts = self._ask(MsgType.REPORT_INVALID, records, p.GRANT_SIZE, p.write_grants, Reader.u32)
        return sum(parts)

    def stats(self) -> dict[str, int]:
        return fetch_stats(self.client)["index"]

    def touch(self, keys: Sequence[bytes]) -> None:
        self._ask(MsgType.TOUCH, keys, KEY_SIZE, p.write_keys, _nothing)

    def report_usage(self, usage: dict[str, int]) -> bool:
        """Send one usage report (:mod:`kvfabric._wire.usage`); False if the controller
        takes none (it predates them)."""
        try:
            r = self.client.call(MsgType.USAGE, write_usage(usage))
        except ControllerRefusedError as exc:
            if exc.code == ErrorCode.UNKNOWN_TYPE:
                return False
            raise
        r.end()
        return True

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

    def _ask(
        self,
        msg_type: MsgType,
        items: Sequence[T],
        item_bytes: int,
        write: Callable[[Sequence[T]], bytes],
        read: Callable[[Reader], R],
        *,
        short: Callable[[R, int], bool] | None = None,
    ) -> list[R]:
        """One request of ``items``, in as many chunks as its size needs: each chunk's
        reply as ``read`` reads it, in order. Raises what a failed chunk failed with.
        ``short(reply, asked)``: True when the chunks after this one are not needed."""
        if len(items) <= CHUNK_KEYS and len(items) * item_bytes <= CHUNK_BYTES:
            timeout = allowance(len(items), self.client.timeout)
            r = self.client.call(msg_type, write(items), timeout=timeout)
            value = read(r)
            r.end()
            return [value]
        ranges = chunks(len(items), item_bytes)
        values: dict[int, R] = {}

        def take(position: int, r: Reader) -> bool:
            values[position] = value = read(r)
            r.end()
            return short is not None and short(value, len(ranges[position]))

        bodies = [write(items[c.start : c.stop]) for c in ranges]
        with self.client.session() as session:
            replies = session.exchange(msg_type, bodies, items=len(items), enough=take)
        out: list[R] = []
        for position, reply in enumerate(replies):
            if isinstance(reply, Exception):
                raise reply
            if reply is None:
                raise ControllerUnavailableError(
                    f"controller {self.client.endpoint} did not answer a {msg_type.name} in time"
                )
            out.append(values[position])
            if short is not None and short(out[-1], len(ranges[position])):
                break  # chunks after the end of the run are not part of it
        return out


def _nothing(r: Reader) -> None:
    """A reply with an empty body."""


def fetch_stats(client: ControlClient) -> dict[str, dict[str, int]]:
    """Every scope of counters the controller reports: "controller", "index", "node N ..."."""
    r = client.call(MsgType.STATS)
    scopes = {}
    for _ in range(r.count(8, 1 << 16)):
        scope = r.text()
        scopes[scope] = p.read_counters(r)
    r.end()
    return scopes
