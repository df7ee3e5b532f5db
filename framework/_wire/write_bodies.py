"""The bodies of the control requests that write: allocations, extents, carved records,
grants and the KV-event blocks a publish may carry (formats: :mod:`kvfabric._wire.protocol`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from kvfabric._runtime.codec import Reader, Writer
from kvfabric._runtime.frozen import field_setters
from kvfabric._wire.protocol import (
    MAX_ALTERNATES,
    MAX_BATCH,
    read_keys,
    write_keys,
)
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import ProtocolError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.events import MAX_BLOCK_TOKENS, MAX_HASH_BYTES, EngineBlock, EngineHash
from kvfabric.spi.index import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Extent,
    GrantRef,
)

__all__ = [
    "ALLOCATION_REQUEST_SIZE",
    "CARVED_SIZE",
    "GRANT_SIZE",
    "MAX_LEASE_LIST",
    "WITH_REPLICAS",
    "encode_block",
    "read_allocate_result",
    "read_allocation_requests",
    "read_blocks",
    "read_carve_outcomes",
    "read_carved",
    "read_extents",
    "read_grants",
    "read_lease_request",
    "write_allocate_result",
    "write_allocation_requests",
    "write_blocks",
    "write_carve_outcomes",
    "write_carved",
    "write_extents",
    "write_grants",
    "write_lease_request",
]

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
