"""The control protocol between clients, data nodes and the controller.

Every message is one ZeroMQ frame: a fixed 32-byte header, then a type-specific body in
fixed-layout fields (``struct``; never pickle)::

    header  magic "KVFC" | version u16 | type u16 | request id u64 | epoch u64
            | membership u64
    keys    count u32 | count x 32-byte key
    descs   count u32 | count x 76-byte descriptor

A reply carries the request's type with :data:`REPLY_BIT` set, the request's id, the
controller's *epoch* — a random number drawn when the controller starts, so a client can
tell that the controller restarted (its node ids and descriptors are then stale) — and its
*membership* generation, which grows whenever a data node registers or leaves, so every
client learns within one reply that a node restarted (a new incarnation) or was replaced. A request
the controller cannot serve gets an ``ERROR`` reply with an :class:`ErrorCode` and a message;
the controller never drops a well-addressed frame silently and never stops serving because
of one. Codes travel as fields: a decoding failure is a :class:`FrameError` carrying its
code, and the reply's code is what clients branch on, never the message text.

A data node registers (``REGISTER_NODE``), reports the records it already holds when it
registers with ``restoring`` set (``RESTORE`` batches, then ``RESTORE_DONE``), heartbeats
(``HEARTBEAT``) and, when it stops, deregisters (``DEREGISTER_NODE``). Each of these after
the registration names the node's id and the incarnation its registration was given, so a
stale request never acts on a newer registration of the same node. A client that found a
published record invalid reports it (``REPORT_INVALID``) so the index unpublishes it.

With replicas (``kvfabric controller --replicas K``) a value has copies on several nodes.
Their wire forms are additions that a store without replicas never sends, so its frames
stay byte for byte what they were: an allocation whose kind byte has :data:`WITH_REPLICAS`
set is followed by a count (u8) and the further grants; a ``LOOKUP_PREFIX`` or ``RESOLVE``
reply may end with an *alternates* section — count u32, then per key that has other copies
its position u32, a count u8 and their descriptors. A publish names each copy that landed
as its own grant.

A client asks once where the index's lookup image is (``IMAGE``: the transports that serve
it, and for a client on the controller's host the file to map) and answers lookups from it;
the keys it hit there it reports in the background, batched (``TOUCH``), so eviction still
sees their use. What it counted (keys looked up, read and written, by outcome, and its calls'
durations) it reports every few seconds as the difference since its last report
(``USAGE``, :mod:`kvfabric._wire.usage`), so the controller can show the fleet's hit rate;
a controller that predates it answers ``UNKNOWN_TYPE`` and the client stops reporting.

The requests that reserve space (``ALLOCATE``, ``LEASE_EXTENTS``) begin with the client's
id (u64), a random number each client draws when it connects: the controller bounds what
one client holds reserved (:mod:`kvfabric._control.reservations`). ``ABORT`` answers with
a flag per grant: set where the grant's key is published with that grant's version (the
publish was served before the abort), clear where it is not (the grant, if it was still
pending, is now released): a writer that got no reply to its publish asks this way what
became of it.

A writer may say what the KV events should say of the keys it publishes, in the engine's
own terms (:class:`~kvfabric.spi.EngineBlock`): a ``PUBLISH`` or ``PUBLISH_CARVED`` then
ends with a *blocks* section — count u32, then per block its key and the block
(:func:`write_blocks`). Like the replicas' additions, a writer that attaches none never
sends it, so its frames stay byte for byte what they were; a controller that publishes no
events skips the section unread.

A large request is sent as several frames of bounded size (:mod:`kvfabric._control.session`);
each is a request of its own, served whole or not at all.

A writer may instead lease *extents* (``LEASE_EXTENTS``: runs of regions, one per data node,
with versions set aside for each) and lay records into them itself; one ``PUBLISH_CARVED``
then publishes a batch of them (extent, key, offset, length, version, CRC each), so a put
costs one control round trip. The lease request gives back the extents the writer is done
with; its reply holds the extents leased, none when the index leases none or has no room.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import attrs
import numpy as np

from kvfabric._runtime.codec import Reader, Writer
from kvfabric._runtime.frozen import field_setters
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.errors import ProtocolError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.events import MAX_BLOCK_TOKENS, MAX_HASH_BYTES, EngineBlock, EngineHash
from kvfabric.spi.index import (
    MAX_ENDPOINTS,
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
    NodeInfo,
)
from kvfabric.spi.transport import NodeEndpoint

_KEY_DTYPE = np.dtype(f"V{KEY_SIZE}")
"""A key as numpy sees raw bytes: ``tolist()`` gives ``bytes`` (``S`` would strip NULs)."""

__all__ = [
    "ALLOCATION_REQUEST_SIZE",
    "CARVED_SIZE",
    "GRANT_SIZE",
    "HEADER",
    "MAGIC",
    "MAX_BATCH",
    "PROTOCOL_VERSION",
    "REPLY_BIT",
    "WITH_REPLICAS",
    "ErrorCode",
    "FrameError",
    "Header",
    "ImageLocation",
    "MsgType",
    "decode_header",
    "encode",
    "encode_block",
    "read_blocks",
    "read_client",
    "read_copies",
    "read_deregister",
    "read_heartbeat",
    "read_image_location",
    "read_node_ref",
    "read_restore",
    "write_blocks",
    "write_client",
    "write_copies",
    "write_deregister",
    "write_descriptor_bytes",
    "write_heartbeat",
    "write_image_location",
    "write_node_ref",
    "write_restore",
]

MAGIC = b"KVFC"
# 3: extents (LEASE_EXTENTS, PUBLISH_CARVED; the image location says whether the index
# leases them). 4: ALLOCATE and LEASE_EXTENTS name the client reserving; ABORT's reply says
# per grant whether it is published. A frame of another version is refused with
# BAD_VERSION, naming both.
PROTOCOL_VERSION = 4
REPLY_BIT = 0x8000
MAX_BATCH = 1 << 20
HEADER = struct.Struct("<4sHHQQQ")


class MsgType(enum.IntEnum):
    NODES = 1
    LOOKUP_PREFIX = 2
    RESOLVE = 3
    EXISTS = 4
    ALLOCATE = 5
    PUBLISH = 6
    ABORT = 7
    UNPUBLISH = 8
    STATS = 9
    REGISTER_NODE = 10
    HEARTBEAT = 11
    DEREGISTER_NODE = 12
    RESTORE = 13
    RESTORE_DONE = 14
    REPORT_INVALID = 15
    IMAGE = 16
    TOUCH = 17
    LEASE_EXTENTS = 18
    PUBLISH_CARVED = 19
    USAGE = 20
    ERROR = 0x7FFF


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    UNKNOWN_TYPE = 2
    BAD_VERSION = 3
    UNKNOWN_NODE = 4
    INTERNAL = 5
    NAME_IN_USE = 6
    FORBIDDEN = 7
    """Not a request this connection's credential may make (a tenant's client sent a data
    node's request, asked for stats or for extents)."""


class FrameError(ProtocolError):
    """A frame this side cannot decode; ``code`` is what an ``ERROR`` reply to it carries."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@attrs.frozen
class Header:
    type: int
    request_id: int
    epoch: int = 0
    membership: int = 0


def encode(
    msg_type: int, request_id: int, body: bytes = b"", epoch: int = 0, membership: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, request_id, epoch, membership) + body


def decode_header(frame: bytes) -> tuple[Header, Reader]:
    """Parse the header; raise ProtocolError for anything that is not a kvfabric frame."""
    if len(frame) < HEADER.size:
        raise FrameError(
            ErrorCode.BAD_FRAME, f"frame of {len(frame)} bytes is shorter than the header"
        )
    magic, version, msg_type, request_id, epoch, membership = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_FRAME, "bad magic: not a kvfabric control frame")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.BAD_VERSION,
            f"protocol version {version}; this side speaks {PROTOCOL_VERSION}",
        )
    return Header(msg_type, request_id, epoch, membership), Reader(frame, HEADER.size)


# -- bodies --------------------------------------------------------------------------------


def write_client(client: int) -> bytes:
    """The id of the client that reserves (the head of ``ALLOCATE`` and ``LEASE_EXTENTS``)."""
    return struct.pack("<Q", client)


def read_client(r: Reader) -> int:
    return r.u64()


def write_keys(keys: Sequence[bytes]) -> bytes:
    return struct.pack("<I", len(keys)) + b"".join(keys)


def read_keys(r: Reader) -> list[bytes]:
    n = r.count(KEY_SIZE, MAX_BATCH)
    # numpy splits the run into bytes objects in C, not a Python loop: this runs on the
    # controller's thread in every lookup by RPC.
    keys: list[bytes] = np.frombuffer(r.raw(n * KEY_SIZE), dtype=_KEY_DTYPE).tolist()
    return keys


def write_descriptors(descriptors: Sequence[Descriptor]) -> bytes:
    return struct.pack("<I", len(descriptors)) + b"".join(map(Descriptor.to_bytes, descriptors))


def write_descriptor_bytes(count: int, raw: bytes) -> bytes:
    """``count`` descriptors already in wire form, back to back (built without objects)."""
    assert len(raw) == count * DESCRIPTOR_SIZE
    return struct.pack("<I", count) + raw


def read_descriptors(r: Reader) -> list[Descriptor]:
    n = r.count(DESCRIPTOR_SIZE, MAX_BATCH)
    return Descriptor.many_from_bytes(r.raw(n * DESCRIPTOR_SIZE))


def write_optional_descriptors(descriptors: Sequence[Descriptor | None]) -> bytes:
    w = Writer().u32(len(descriptors))
    for d in descriptors:
        if d is None:
            w.u8(0)
        else:
            w.u8(1).raw(d.to_bytes())
    return w.getvalue()


def read_optional_descriptors(r: Reader) -> list[Descriptor | None]:
    n = r.count(1, MAX_BATCH)
    out: list[Descriptor | None] = []
    for _ in range(n):
        out.append(Descriptor.from_bytes(r.raw(DESCRIPTOR_SIZE)) if r.u8() else None)
    return out


MAX_ALTERNATES = 255
"""Other copies one key may list (a u8 count)."""


def write_copies(copies: Copies, *, optional: bool) -> bytes:
    """A lookup's answer: the descriptors (``optional``: one per key, None for a miss, as
    ``RESOLVE`` answers; else the leading run, as ``LOOKUP_PREFIX`` does), then the
    alternates section when any key has other copies (absent otherwise)."""
    descriptors = copies.descriptors
    if optional:
        head = write_optional_descriptors(descriptors)
    elif isinstance(descriptors, PackedDescriptors):
        head = write_descriptor_bytes(len(descriptors), descriptors.wires)
    else:
        head = write_descriptors([d for d in descriptors if d is not None])
    if not copies.alternates:
        return head
    w = Writer().raw(head).u32(len(copies.alternates))
    for position, others in copies.alternates.items():
        others = others[:MAX_ALTERNATES]
        w.u32(position).u8(len(others))
        for d in others:
            w.raw(d.to_bytes())
    return w.getvalue()


def read_copies(r: Reader, *, optional: bool) -> Copies:
    """What :func:`write_copies` wrote (the reader then ends at the frame's end). A leading
    run (not ``optional``) stays in wire form until used (:class:`PackedDescriptors`)."""
    descriptors: Sequence[Descriptor | None]
    if optional:
        descriptors = read_optional_descriptors(r)
    else:
        n = r.count(DESCRIPTOR_SIZE, MAX_BATCH)
        descriptors = PackedDescriptors(r.raw(n * DESCRIPTOR_SIZE))
    if not r.remaining:
        return Copies(descriptors=descriptors)
    alternates: dict[int, tuple[Descriptor, ...]] = {}
    for _ in range(r.count(5, MAX_BATCH)):
        position, n = r.u32(), r.u8()
        if position >= len(descriptors) or (optional and descriptors[position] is None):
            raise ProtocolError(f"alternates for position {position}, which holds no copy")
        alternates[position] = tuple(Descriptor.many_from_bytes(r.raw(n * DESCRIPTOR_SIZE)))
    return Copies(descriptors=descriptors, alternates=alternates)


def write_flags(flags: Sequence[bool]) -> bytes:
    return struct.pack("<I", len(flags)) + bytes(1 if f else 0 for f in flags)


def read_flags(r: Reader) -> list[bool]:
    n = r.count(1, MAX_BATCH)
    return [b != 0 for b in r.raw(n)]


_ALLOC_REQUEST = struct.Struct("<32sQ")
ALLOCATION_REQUEST_SIZE = _ALLOC_REQUEST.size


def write_allocation_requests(requests: Sequence[AllocationRequest]) -> bytes:
    return struct.pack("<I", len(requests)) + b"".join(
        _ALLOC_REQUEST.pack(q.key, q.length) for q in requests
    )


def read_allocation_requests(r: Reader) -> list[AllocationRequest]:
    n = r.count(_ALLOC_REQUEST.size, MAX_BATCH)
    raw = r.raw(n * _ALLOC_REQUEST.size)
    out = []
    for key, length in _ALLOC_REQUEST.iter_unpack(raw):
        out.append(AllocationRequest(key=key, length=length))
    return out


WITH_REPLICAS = 0x80
"""Set in an allocation's kind byte when grants of further copies follow it."""


def write_allocate_result(result: AllocateResult) -> bytes:
    lease_ms = min(int(result.lease * 1000), (1 << 32) - 1)
    w = Writer().u32(result.evictions).u32(lease_ms).u32(len(result.allocations))
    for a in result.allocations:
        replicas = a.replicas[:MAX_ALTERNATES] if a.descriptor is not None else ()
        w.u8(a.kind.value | (WITH_REPLICAS if replicas else 0))
        if a.descriptor is not None:
            w.raw(a.descriptor.to_bytes())
        if replicas:
            w.u8(len(replicas))
            for d in replicas:
                w.raw(d.to_bytes())
    return w.getvalue()


_WITH_DESCRIPTOR = (AllocationKind.GRANTED, AllocationKind.EXISTS)
# By wire value: a dict lookup, cheaper than calling the enum for every key.
_KINDS = {kind.value: kind for kind in AllocationKind}


def read_allocate_result(r: Reader) -> AllocateResult:
    evictions = r.u32()
    lease = r.u32() / 1000
    n = r.count(1, MAX_BATCH)
    # Every put decodes its grants here: in place (the frame is not sliced per field) and
    # without attrs' keyword constructor, whose validators would cost more than the decode.
    data = r.data
    allocations = []
    for _ in range(n):
        byte = data[r.skip(1)]
        kind = _KINDS.get(byte & ~WITH_REPLICAS)
        if kind is None:
            raise ProtocolError(f"unknown allocation kind: {byte & ~WITH_REPLICAS}")
        if kind not in _WITH_DESCRIPTOR:
            if byte & WITH_REPLICAS:
                raise ProtocolError(f"an allocation of kind {kind.name} cannot carry replicas")
            allocations.append(_BARE[kind])
            continue
        descriptor = Descriptor.from_bytes(data, r.skip(DESCRIPTOR_SIZE))
        replicas: tuple[Descriptor, ...] = ()
        if byte & WITH_REPLICAS:
            replicas = tuple(Descriptor.many_from_bytes(r.raw(r.u8() * DESCRIPTOR_SIZE)))
        allocations.append(_allocation(kind, descriptor, replicas))
    return AllocateResult(allocations=tuple(allocations), evictions=evictions, lease=lease)


# Allocations without a descriptor carry nothing else: frozen, so one of each serves all.
_BARE = {kind: Allocation(kind=kind) for kind in AllocationKind if kind not in _WITH_DESCRIPTOR}
_SET_KIND, _SET_DESCRIPTOR, _SET_REPLICAS = field_setters(
    Allocation, "kind", "descriptor", "replicas"
)


def _allocation(
    kind: AllocationKind, descriptor: Descriptor, replicas: tuple[Descriptor, ...]
) -> Allocation:
    """An allocation decoded from the wire, every field checked already: set through its
    slots, as attrs' frozen constructor would, less its keyword handling."""
    allocation: Allocation = object.__new__(Allocation)
    _SET_KIND(allocation, kind)
    _SET_DESCRIPTOR(allocation, descriptor)
    _SET_REPLICAS(allocation, replicas)
    return allocation


_LEASE_REQUEST = struct.Struct("<QQI")
_EXTENT = struct.Struct("<QIIQQQQQIII")
_CARVED = struct.Struct("<Q32sQQQI")
CARVED_SIZE = _CARVED.size
MAX_LEASE_LIST = 1 << 10
"""Extents one lease request may ask for or give back, and nodes it may exclude."""


def write_lease_request(
    need: int, want: int, count: int, exclude: Sequence[int], returned: Sequence[int]
) -> bytes:
    return b"".join(
        (
            _LEASE_REQUEST.pack(need, want, count),
            struct.pack(f"<I{len(exclude)}I", len(exclude), *exclude),
            struct.pack(f"<I{len(returned)}Q", len(returned), *returned),
        )
    )


def read_lease_request(r: Reader) -> tuple[int, int, int, list[int], list[int]]:
    need, want, count = _LEASE_REQUEST.unpack(r.raw(_LEASE_REQUEST.size))
    if count > MAX_LEASE_LIST:
        raise ProtocolError(f"{count} extents asked for at once")
    n = r.count(4, MAX_LEASE_LIST)
    exclude = list(struct.unpack(f"<{n}I", r.raw(4 * n)))
    n = r.count(8, MAX_LEASE_LIST)
    returned = list(struct.unpack(f"<{n}Q", r.raw(8 * n)))
    return need, want, count, exclude, returned


def write_extents(extents: Sequence[Extent]) -> bytes:
    w = Writer().u32(len(extents))
    for e in extents:
        lease_ms = min(int(e.lease * 1000), (1 << 32) - 1)
        fields = (e.id, e.node, e.region, e.rkey, e.offset, e.size, e.first_version, e.versions)
        evictions = min(e.evictions, (1 << 32) - 1)
        w.raw(_EXTENT.pack(*fields, lease_ms, evictions, e.nodes_generation))
    return w.getvalue()


def read_extents(r: Reader) -> list[Extent]:
    out = []
    for _ in range(r.count(_EXTENT.size, MAX_LEASE_LIST)):
        fields = _EXTENT.unpack(r.raw(_EXTENT.size))
        extent_id, node, region, rkey, offset, size, first, versions, lease_ms, evicted, gen = (
            fields
        )
        if size <= 0 or offset + size >= 1 << 64 or first + versions >= 1 << 64:
            raise ProtocolError(f"extent of {size} bytes at {offset}, versions from {first}")
        out.append(
            Extent(
                id=extent_id,
                node=node,
                region=region,
                rkey=rkey,
                offset=offset,
                size=size,
                first_version=first,
                versions=versions,
                lease=lease_ms / 1000,
                evictions=evicted,
                nodes_generation=gen,
            )
        )
    return out


def write_carved(records: Sequence[CarvedRecord], again: Sequence[bytes]) -> bytes:
    """``PUBLISH_CARVED``: the records (each naming its extent), then the keys found
    stored again."""
    carved = b"".join(
        _CARVED.pack(c.extent, c.key, c.offset, c.length, c.version, c.crc) for c in records
    )
    return struct.pack("<I", len(records)) + carved + write_keys(again)


def read_carved(r: Reader) -> tuple[list[CarvedRecord], list[bytes]]:
    n = r.count(_CARVED.size, MAX_BATCH)
    records = [
        CarvedRecord(extent=e, key=key, offset=offset, length=length, version=version, crc=crc)
        for e, key, offset, length, version, crc in _CARVED.iter_unpack(r.raw(n * _CARVED.size))
    ]
    return records, read_keys(r)


_CARVE_OUTCOMES = {outcome.value: outcome for outcome in CarveOutcome}


def write_carve_outcomes(outcomes: Sequence[CarveOutcome]) -> bytes:
    return struct.pack("<I", len(outcomes)) + bytes(o.value for o in outcomes)


def read_carve_outcomes(r: Reader) -> list[CarveOutcome]:
    out = []
    for value in r.raw(r.count(1, MAX_BATCH)):
        outcome = _CARVE_OUTCOMES.get(value)
        if outcome is None:
            raise ProtocolError(f"unknown carve outcome {value}")
        out.append(outcome)
    return out


_GRANT = struct.Struct("<32sQI")
GRANT_SIZE = _GRANT.size


def write_grants(grants: Sequence[GrantRef]) -> bytes:
    return struct.pack("<I", len(grants)) + b"".join(
        _GRANT.pack(g.key, g.version, g.crc) for g in grants
    )


def read_grants(r: Reader) -> list[GrantRef]:
    n = r.count(_GRANT.size, MAX_BATCH)
    raw = r.raw(n * _GRANT.size)
    return [GrantRef(key=k, version=v, crc=c) for k, v, c in _GRANT.iter_unpack(raw)]


_HASH_NONE, _HASH_BYTES, _HASH_INT = 0, 1, 2
_LORA_ID, _LORA_NAME = 1, 2


def _write_hash(w: Writer, value: EngineHash | None) -> None:
    if value is None:
        w.u8(_HASH_NONE)
    elif isinstance(value, bytes):
        w.u8(_HASH_BYTES).u8(len(value)).raw(value)
    else:
        w.u8(_HASH_INT).u64(value)


def _read_hash(r: Reader) -> EngineHash | None:
    kind = r.u8()
    if kind == _HASH_NONE:
        return None
    if kind == _HASH_BYTES:
        n = r.u8()
        if not 0 < n <= MAX_HASH_BYTES:
            raise ProtocolError(f"an engine hash of {n} bytes")
        return r.raw(n)
    if kind == _HASH_INT:
        return r.u64()
    raise ProtocolError(f"unknown engine hash kind {kind}")


def encode_block(key: bytes, block: EngineBlock) -> bytes:
    """One entry of a blocks section: the key, then what the events say of it."""
    w = Writer().raw(key)
    _write_hash(w, block.hash)
    _write_hash(w, block.parent)
    tokens = np.asarray(block.token_ids, dtype="<u4")
    w.u32(block.block_size).u32(len(tokens)).raw(tokens.tobytes())
    flags = (_LORA_ID if block.lora_id is not None else 0) | (
        _LORA_NAME if block.lora_name is not None else 0
    )
    w.u8(flags)
    if block.lora_id is not None:
        w.u64(block.lora_id)
    if block.lora_name is not None:
        w.text(block.lora_name)
    return w.getvalue()


def write_blocks(encoded: Sequence[bytes]) -> bytes:
    """A blocks section of entries made by :func:`encode_block`."""
    return struct.pack("<I", len(encoded)) + b"".join(encoded)


def read_blocks(r: Reader) -> dict[bytes, EngineBlock]:
    """A blocks section, each block checked as a writer's would be."""
    out: dict[bytes, EngineBlock] = {}
    for _ in range(r.count(KEY_SIZE + 11, MAX_BATCH)):
        key = r.raw(KEY_SIZE)
        block_hash, parent = _read_hash(r), _read_hash(r)
        block_size, n = r.u32(), r.count(4, MAX_BLOCK_TOKENS)
        tokens = np.frombuffer(r.raw(4 * n), dtype="<u4").tolist()
        flags = r.u8()
        lora_id = r.u64() if flags & _LORA_ID else None
        lora_name = r.text(256) if flags & _LORA_NAME else None
        if block_hash is None:
            raise ProtocolError("a block without its engine hash")
        try:
            out[key] = EngineBlock(
                hash=block_hash,
                parent=parent,
                token_ids=tokens,
                block_size=block_size,
                lora_id=lora_id,
                lora_name=lora_name,
            )
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed block: {exc}") from None
    return out


def write_nodes(nodes: Sequence[NodeInfo]) -> bytes:
    w = Writer().u32(len(nodes))
    for node in nodes:
        node.write_to(w)
    return w.getvalue()


def read_nodes(r: Reader) -> list[NodeInfo]:
    return [NodeInfo.read_from(r) for _ in range(r.count(16, 1 << 16))]


_U64_MAX = (1 << 64) - 1


def write_counters(counters: dict[str, int]) -> Writer:
    w = Writer().u32(len(counters))
    for name, value in counters.items():
        # Clamped to the wire form: a counter can saturate, never break the stats reply.
        w.text(name).u64(min(max(int(value), 0), _U64_MAX))
    return w


def read_counters(r: Reader) -> dict[str, int]:
    return {r.text(256): r.u64() for _ in range(r.count(12, 4096))}


def write_deregister(node: int, incarnation: int) -> bytes:
    return write_node_ref(node, incarnation)


def read_deregister(r: Reader) -> tuple[int, int]:
    """(node id, incarnation) of a ``DEREGISTER_NODE`` request."""
    return read_node_ref(r)


def write_node_ref(node: int, incarnation: int) -> bytes:
    """A registration of a node: its id and the incarnation that registration was given."""
    return Writer().u32(node).u64(incarnation).getvalue()


def read_node_ref(r: Reader) -> tuple[int, int]:
    return r.u32(), r.u64()


def write_heartbeat(node: int, incarnation: int, counters: dict[str, int]) -> bytes:
    return write_node_ref(node, incarnation) + write_counters(counters).getvalue()


def read_heartbeat(r: Reader) -> tuple[int, int, dict[str, int]]:
    node, incarnation = read_node_ref(r)
    return node, incarnation, read_counters(r)


def write_restore(node: int, incarnation: int, records: Sequence[Descriptor]) -> bytes:
    return write_node_ref(node, incarnation) + write_descriptors(records)


def read_restore(r: Reader) -> tuple[int, int, list[Descriptor]]:
    node, incarnation = read_node_ref(r)
    return node, incarnation, read_descriptors(r)


def write_error(code: ErrorCode, message: str) -> bytes:
    return Writer().u32(code).text(message[:1000]).getvalue()


def read_error(r: Reader) -> tuple[int, str]:
    return r.u32(), r.text()


@attrs.frozen(kw_only=True)
class ImageLocation:
    """Where the index's lookup image is (:mod:`kvfabric._runtime.image`), as ``IMAGE`` answers."""

    image_id: int
    size: int
    endpoints: tuple[NodeEndpoint, ...]
    """The image as a region on each transport that serves it (node ``IMAGE_NODE``)."""
    host: bytes = b""
    """The controller's host (its boot id), when a client there may map the image itself."""
    path: str = ""
    """The file to map read-only (``/proc/<pid>/fd/<n>`` of a memfd)."""
    device: int = 0
    inode: int = 0
    """What the opened ``path`` must be: the very file, not one at a same-named path."""
    extents: bool = False
    """Whether the index leases extents (a client reading the image writes through them)."""


def write_image_location(location: ImageLocation | None) -> bytes:
    w = Writer()
    if location is None:
        return w.u8(0).getvalue()
    w.u8(1).u64(location.image_id).u64(location.size)
    w.blob(location.host).text(location.path).u64(location.device).u64(location.inode)
    w.u32(len(location.endpoints))
    for endpoint in location.endpoints:
        endpoint.write_to(w)
    return w.u8(int(location.extents)).getvalue()


def read_image_location(r: Reader) -> ImageLocation | None:
    if not r.u8():
        return None
    image_id, size = r.u64(), r.u64()
    host, path, device, inode = r.blob(256), r.text(4096), r.u64(), r.u64()
    endpoints = tuple(NodeEndpoint.read_from(r) for _ in range(r.count(12, MAX_ENDPOINTS)))
    extents = r.u8()
    if extents > 1:
        raise ProtocolError(f"extents flag {extents}")
    return ImageLocation(
        image_id=image_id,
        size=size,
        endpoints=endpoints,
        host=host,
        path=path,
        device=device,
        inode=inode,
        extents=bool(extents),
    )
