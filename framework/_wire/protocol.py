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
(:func:`kvfabric._wire.write_bodies.write_blocks`). Like the replicas' additions, a
writer that attaches none never sends it, so its frames stay byte for byte what they were;
a controller that publishes no events skips the section unread.

A large request is sent as several frames of bounded size (:mod:`kvfabric._control.session`);
each is a request of its own, served whole or not at all.

This module holds the frame, its header, the codes and the bodies every request shares
(keys, descriptors, copies, flags, counters, errors); the bodies of writes are in
:mod:`kvfabric._wire.write_bodies`, those of node membership and the image's location in
:mod:`kvfabric._wire.member_bodies`.

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
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.errors import ProtocolError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.index import (
    Copies,
)

_KEY_DTYPE = np.dtype(f"V{KEY_SIZE}")
"""A key as numpy sees raw bytes: ``tolist()`` gives ``bytes`` (``S`` would strip NULs)."""

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_BATCH",
    "PROTOCOL_VERSION",
    "REPLY_BIT",
    "ErrorCode",
    "FrameError",
    "Header",
    "MsgType",
    "decode_header",
    "encode",
    "read_client",
    "read_copies",
    "write_client",
    "write_copies",
    "write_descriptor_bytes",
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


_U64_MAX = (1 << 64) - 1


def write_counters(counters: dict[str, int]) -> Writer:
    w = Writer().u32(len(counters))
    for name, value in counters.items():
        # Clamped to the wire form: a counter can saturate, never break the stats reply.
        w.text(name).u64(min(max(int(value), 0), _U64_MAX))
    return w


def read_counters(r: Reader) -> dict[str, int]:
    return {r.text(256): r.u64() for _ in range(r.count(12, 4096))}


def write_error(code: ErrorCode, message: str) -> bytes:
    return Writer().u32(code).text(message[:1000]).getvalue()


def read_error(r: Reader) -> tuple[int, str]:
    return r.u32(), r.text()
