"""What a tenant's connection may read: whole records of its own, checked and copied.

A node shared by tenants holds their records side by side in the same regions, under the
same rkeys, so an rkey proves nothing about whose bytes a segment covers. A connection
proved with a tenant's data key (``TransportConfig.tenant_tokens``) is therefore served
reads only record by record, in the order a client reads one: a 64-byte header segment
whose record is well formed and whose key carries the tenant's tag (bytes 8 to 12), then
the payload's pieces, contiguous, up to its end. The bytes are copied out of the region,
the payload's CRC32C over the copy must equal the header's, and the header must still be what it was
once the copy is done; only then are the copies sent. A slot being overwritten by another
writer while it is read fails those checks (writers land the payload before the header),
so a tenant cannot catch another's bytes in a slot it once held, up to a CRC32C collision.

Everything else — another tenant's record, a bare payload, a read cut short before a
record's end, the lookup image — is refused as an unknown region would be (the client
counts a refused read, and misses). The native serving loop is not used for these
connections: each read costs the node a copy and a checksum of what it sends.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from kvfabric._runtime import native
from kvfabric._runtime.image import IMAGE_REGION
from kvfabric._runtime.record import FORMAT_VERSION, HEADER_SIZE, MAGIC
from kvfabric.spi import RegionTable, SegmentStatus

__all__ = ["tenant_reads"]

# magic, format version, flags, key, version, payload length, payload crc, header crc
_HEADER = struct.Struct("<4sHH32sQQII")
_REFUSED = SegmentStatus.UNKNOWN_REGION
_OK = SegmentStatus.OK


class _Record:
    __slots__ = ("crc", "end", "first", "header", "memory", "next", "offset", "pieces", "region")

    def __init__(self, region: int, memory: memoryview, offset: int, first: int) -> None:
        self.region = region
        self.memory = memory
        self.offset = offset
        self.header = bytes(memory[offset : offset + HEADER_SIZE])
        _, _, _, _, _, length, crc, _ = _HEADER.unpack(self.header)
        self.crc = crc
        self.next = offset + HEADER_SIZE
        self.end = self.next + length
        self.first = first
        """The position of its header segment in the frame."""
        self.pieces: list[bytes] = []


def tenant_reads(
    regions: RegionTable,
    memories: dict[int, memoryview],
    entries: Iterable[tuple[int, int, int, int]],
    tag: bytes,
) -> tuple[bytearray, list[bytes]]:
    """A status per ``(region, rkey, offset, length)`` entry and the bytes of those accepted,
    in order, for a connection of the tenant whose keys carry ``tag``."""
    statuses = bytearray()
    out: list[bytes | None] = []
    record: _Record | None = None
    for position, (region, rkey, offset, length) in enumerate(entries):
        status, _ = regions.check(region, rkey, offset, length)
        memory = memories.get(region)
        if status != _OK or memory is None or region == IMAGE_REGION:
            statuses.append(status if status != _OK else _REFUSED)
            out.append(None)
            continue
        if (
            record is not None
            and record.region == region
            and offset == record.next
            and offset + length <= record.end
            and length > 0
        ):
            record.pieces.append(bytes(memory[offset : offset + length]))
            record.next += length
            statuses.append(_OK)
            out.append(record.pieces[-1])
            if record.next == record.end:
                _finish(record, statuses, out)
                record = None
            continue
        if record is not None:  # the previous record was not read to its end
            _refuse_from(record.first, statuses, out)
            record = None
        if length == HEADER_SIZE and _is_own_header(memory, offset, tag):
            record = _Record(region, memory, offset, position)
            statuses.append(_OK)
            out.append(record.header)
            if record.next == record.end:  # an empty payload
                _finish(record, statuses, out)
                record = None
            continue
        statuses.append(_REFUSED)
        out.append(None)
    if record is not None:
        _refuse_from(record.first, statuses, out)
    return statuses, [piece for piece in out if piece is not None]


def _is_own_header(memory: memoryview, offset: int, tag: bytes) -> bool:
    header = memory[offset : offset + HEADER_SIZE]
    magic, fmt, _, key, _, _, _, head_crc = _HEADER.unpack(header)
    return bool(
        magic == MAGIC
        and fmt == FORMAT_VERSION
        and key[8:12] == tag
        and native.crc32c(header[: HEADER_SIZE - 4]) == head_crc
    )


def _finish(record: _Record, statuses: bytearray, out: list[bytes | None]) -> None:
    """The record is read to its end: send it only if what was copied is whole."""
    start = record.offset
    crc = 0
    for piece in record.pieces:
        crc = native.crc32c(piece, crc)
    unchanged = bytes(record.memory[start : start + HEADER_SIZE]) == record.header
    if crc != record.crc or not unchanged:
        _refuse_from(record.first, statuses, out)


def _refuse_from(first: int, statuses: bytearray, out: list[bytes | None]) -> None:
    for position in range(first, len(statuses)):
        if statuses[position] == _OK:
            statuses[position] = _REFUSED
            out[position] = None
