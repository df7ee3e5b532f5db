"""The transport plug point: moving bytes between a client buffer and a remote region.

A transport has a server side (on the data node: ``register(region) -> RegionHandle``) and a
client side (batched: ``read(node, segments)`` / ``write(node, segments)``). It declares
what it can do as data on the class, before any instance exists, so the framework can refuse
an impossible configuration up front with :class:`~kvfabric.errors.NotSupportedError`.

The client API is synchronous and batched: one call moves a whole batch for one node and
must release the GIL while bytes move (sockets, ``ctypes.memmove``, native completion
waits). The store issues the calls for different nodes concurrently and the async API runs
them off the event loop, so a transport never needs its own event loop.

:class:`TransportClient` is that API as the framework sees it. A transport implements it by
subclassing :class:`~kvfabric.spi.PeerClient`, which does the shared work (peer table,
segment checks, error mapping) and leaves the transport its primitives.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvfabric._runtime.codec import Reader, Writer
from kvfabric._runtime.native import crc32c_many
from kvfabric.errors import TransportError
from kvfabric.spi.backend import MemoryKind, Region
from kvfabric.spi.options import Plugin

__all__ = [
    "Capabilities",
    "NodeEndpoint",
    "RegionHandle",
    "Segment",
    "Transport",
    "TransportClient",
    "TransportConfig",
    "TransportServer",
]


@attrs.frozen(kw_only=True)
class Capabilities:
    one_sided: bool
    """Reads and writes complete without the data node's CPU (False: the node emulates them)."""
    local_only: bool
    """Only a client on the data node's host can use it."""
    memory_kinds: frozenset[MemoryKind]
    """Kinds of memory the server side can register."""


@attrs.frozen(kw_only=True)
class RegionHandle:
    """A region as registered with one transport: what a client needs to address it."""

    region: int
    rkey: int
    size: int
    info: bytes = b""
    """Transport-specific (a path to map, a packed remote key, ...)."""

    def write_to(self, w: Writer) -> None:
        w.u32(self.region).u64(self.rkey).u64(self.size).blob(self.info)

    @classmethod
    def read_from(cls, r: Reader) -> RegionHandle:
        return cls(region=r.u32(), rkey=r.u64(), size=r.u64(), info=r.blob(1 << 16))


@attrs.frozen(kw_only=True)
class NodeEndpoint:
    """How a client reaches one data node over one transport."""

    node: int
    transport: str
    address: bytes
    regions: tuple[RegionHandle, ...]

    def write_to(self, w: Writer) -> None:
        w.u32(self.node).text(self.transport).blob(self.address).u32(len(self.regions))
        for handle in self.regions:
            handle.write_to(w)

    @classmethod
    def read_from(cls, r: Reader) -> NodeEndpoint:
        node, transport, address = r.u32(), r.text(64), r.blob(1 << 16)
        regions = tuple(RegionHandle.read_from(r) for _ in range(r.count(24, 4096)))
        return cls(node=node, transport=transport, address=address, regions=regions)


class Segment:
    """One contiguous transfer: ``len(buffer)`` bytes at ``offset`` in a region.

    For a read, ``buffer`` is the writable destination; for a write, the source.
    """

    __slots__ = ("buffer", "offset", "region", "rkey")

    def __init__(self, region: int, rkey: int, offset: int, buffer: memoryview) -> None:
        self.region = region
        self.rkey = rkey
        self.offset = offset
        self.buffer = buffer

    def __repr__(self) -> str:
        return f"Segment(region={self.region}, offset={self.offset}, length={self.buffer.nbytes})"


@attrs.frozen(kw_only=True)
class TransportConfig:
    host: str = "127.0.0.1"
    """Address the server side binds (and advertises, unless ``advertise`` is set)."""
    advertise: str | None = None
    """Host clients should use to reach this server, when it differs from ``host``."""
    port: int = 0
    timeout: float = 2.0
    """Bound on one batched call; a node that does not answer in time is a miss."""
    token: bytes = b""
    """Shared secret a server may require of its clients."""
    tenant_tokens: tuple[tuple[bytes, bytes], ...] = ()
    """``(key, tag)`` per tenant: further keys a server admits clients by, each a tenant's
    data-plane key, with the tag its index keys carry (bytes 8 to 12). A server that serves
    reads itself (``tcp``) then serves such a client only whole records whose key carries
    its tag (a server without ``token`` admits anyone, and ignores these)."""
    options: Mapping[str, Any] = attrs.field(factory=dict)
    """The transport's declared options, parsed (every one present, defaulted if not given)."""


class TransportServer(abc.ABC):
    """The data-node side of a transport."""

    @property
    @abc.abstractmethod
    def address(self) -> bytes:
        """What clients need to reach this server (opaque to the framework)."""

    @abc.abstractmethod
    def register(self, region: Region) -> RegionHandle:
        """Expose a region; only requests carrying its rkey may touch it."""

    def stats(self) -> dict[str, int]:
        """Counters of work this server did (requests served, bytes, refusals)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None: ...


class TransportClient(abc.ABC):
    """The client side of a transport as the framework calls it; thread-safe.

    Transports subclass :class:`~kvfabric.spi.PeerClient`, which implements all of this.
    """

    write_lanes: ClassVar[int] = 1
    """How many calls a large write to one node is split into, run at once (records'
    payloads and headers stay together: each call writes whole records). ``tcp`` uses 2:
    one connection's sender is the bottleneck of a loopback or single-stream transfer while
    the node's receiver has slack, and two connections use both."""

    @abc.abstractmethod
    def connect(self, endpoint: NodeEndpoint) -> None:
        """Prepare to talk to a node (idempotent; called again when a node re-registers)."""

    def reachable(self, endpoint: NodeEndpoint) -> bool:
        """Whether this client could use ``endpoint`` (e.g. same host for local transports)."""
        return True

    @abc.abstractmethod
    def read(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        """Land every segment in its buffer; one entry per segment, ``None`` when it landed.

        Raises :class:`TransportError` (or :class:`TransportTimeoutError`) when the node as a
        whole cannot be used; returns an error per segment refused (by the checks every
        segment passes first, or by the node). A refused segment's buffer is left untouched.
        """

    @abc.abstractmethod
    def write(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        """Store every segment's buffer; same contract as :meth:`read`."""

    def read_small(self, node: int, segments: Sequence[Segment]) -> bool:
        """Land a few small segments with the least work the transport can do per call;
        whether every one landed (a refused one's buffer may hold anything then).

        For reads that are all round trip and no payload, made again and again (the lookup
        image's header and log: a few KiB in two or three segments, into writable byte
        buffers). No CRCs are taken. Raises as :meth:`read` when the node
        cannot be used. This default is :meth:`read`; a transport whose read plans and
        frames each batch in Python (``tcp``), work that is most of a small read's time,
        sends these as one prepared frame instead.
        """
        return not any(self.read(node, segments))

    def read_checksummed(
        self, node: int, segments: Sequence[Segment], crc_spans: Sequence[tuple[int, int]]
    ) -> tuple[list[TransportError | None], list[int]]:
        """:meth:`read`, and the CRC32C of what landed in each ``(start, stop)`` span.

        Spans are ranges of ``segments`` (in order, not overlapping); a reader asks for one
        per record's payload and checks it against the record's header instead of reading
        the payload again. A span holding a refused segment has a CRC to ignore. This
        default reads, then checksums every span in one native call (one return of the GIL
        for the batch); :class:`~kvfabric.spi.PeerClient` lets a transport checksum while
        bytes land.
        """
        errors = self.read(node, segments)
        return errors, crc32c_many(_span_buffers(segments, crc_spans, errors))

    def write_checksummed(
        self,
        node: int,
        segments: Sequence[Segment],
        crc_spans: Sequence[tuple[int, int]],
        trailer: Callable[[list[int]], Sequence[Segment]],
    ) -> tuple[list[TransportError | None], list[int]]:
        """Store ``segments``, then the segments ``trailer`` makes from their CRC32Cs.

        For records: each span of ``segments`` is one record's payload, and ``trailer``
        gets the CRC32C of each span's source bytes and returns the records' headers, which
        carry them. Every trailer segment is stored after every payload segment is (a reader
        never sees a header before its payload). The trailer's places and sizes must not
        depend on the CRCs: a transport may call ``trailer`` first with placeholders (zeros)
        to plan the request, and again with the real CRCs while it sends. Returns an error
        per segment, then per trailer segment (as :meth:`write`), and the CRCs. This
        default checksums the spans in one native call, then writes payloads and trailer in
        one :meth:`write`; :class:`~kvfabric.spi.PeerClient` lets a transport checksum
        while it writes.
        """
        crcs = crc32c_many(_span_buffers(segments, crc_spans, None))
        tail = trailer(crcs)
        return self.write(node, [*segments, *tail]), crcs

    def disconnect(self, node: int) -> None:
        """Forget a node (it left or died)."""

    @abc.abstractmethod
    def close(self) -> None: ...


def _span_buffers(
    segments: Sequence[Segment],
    spans: Sequence[tuple[int, int]],
    errors: Sequence[TransportError | None] | None,
) -> list[list[memoryview]]:
    """Each span's buffers; none for a span holding a refused (or non-contiguous) segment."""
    out: list[list[memoryview]] = []
    for start, stop in spans:
        buffers = [segments[i].buffer for i in range(start, stop)]
        refused = errors is not None and any(errors[i] is not None for i in range(start, stop))
        out.append([] if refused or not all(b.c_contiguous for b in buffers) else buffers)
    return out


class Transport(Plugin, abc.ABC):
    """A transport plugin: capabilities, preference and options as data; factories for both sides.

    ``preference`` ranks transports a client could use for one node: the highest one both
    sides have and that can reach the node wins (``?transport=NAME`` forces one instead).
    """

    capabilities: ClassVar[Capabilities]
    preference: ClassVar[int] = 0

    @classmethod
    @abc.abstractmethod
    def create_server(cls, config: TransportConfig) -> TransportServer: ...

    @classmethod
    @abc.abstractmethod
    def create_client(cls, config: TransportConfig) -> TransportClient: ...
