"""The record a slot holds: a fixed 64-byte header, then the payload.

The header is self-describing (magic, format version, key, version, payload length, CRC32C
of the payload, CRC32C of the header itself), so a node's memory can be scanned to rebuild
the index, and a reader can tell a landed record from stale or foreign bytes.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

from kvfabric._runtime import native
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ValidationError

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "SLOT_ALIGN",
    "Failure",
    "RecordHeader",
    "checksum",
    "checksum_pieces",
    "pack_header",
    "pack_headers",
    "parse_header",
    "record_size",
    "validate_record",
]

MAGIC = b"KVFR"
FORMAT_VERSION = 1
SLOT_ALIGN = 64
# magic, format version, flags, key, version, payload length, payload crc, header crc
_HEADER = struct.Struct("<4sHH32sQQII")
HEADER_SIZE = _HEADER.size
_HEADER_CRC_SPAN = HEADER_SIZE - 4
assert HEADER_SIZE == 64


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C in hardware (``kvfabric._runtime.native``; GIL released from 256 KiB).

    ``value`` continues a checksum: ``checksum(b, checksum(a)) == checksum(a + b)``.
    """
    return native.crc32c(data, value)


def checksum_pieces(pieces: Sequence[bytes | bytearray | memoryview]) -> int:
    """CRC32C of the concatenation of ``pieces``, without concatenating them (one native
    call: the GIL is released at most once, however many pieces)."""
    return native.crc32c_many([pieces])[0]


def record_size(length: int) -> int:
    """Bytes a record with a payload of ``length`` bytes occupies in a slot (aligned)."""
    raw = HEADER_SIZE + length
    return (raw + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class Failure(enum.Enum):
    """Why a landed record was refused."""

    MAGIC = "bad magic or format version"
    HEADER_CRC = "header checksum mismatch"
    KEY = "key in header differs from key asked"
    VERSION = "version differs from descriptor"
    LENGTH = "payload length differs from descriptor"
    CRC = "payload checksum mismatch"
    SHORT = "destination buffer too small"


class RecordHeader:
    """A parsed header (plain slots class: this is on the read path)."""

    __slots__ = ("crc", "key", "length", "version")

    def __init__(self, key: bytes, version: int, length: int, crc: int) -> None:
        self.key = key
        self.version = version
        self.length = length
        self.crc = crc


def pack_header(key: bytes, version: int, length: int, crc: int) -> bytes:
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, key, version, length, crc, 0)
    return head[:_HEADER_CRC_SPAN] + struct.pack("<I", checksum(head[:_HEADER_CRC_SPAN]))


def pack_headers(
    keys: Sequence[bytes], versions: Sequence[int], lengths: Sequence[int], crcs: Sequence[int]
) -> bytes:
    """:func:`pack_header` of each (key, version, length, crc), back to back, in one native
    call rather than a struct pack and a CRC per header in Python (a write packs every
    record's header)."""
    return native.pack_headers(keys, versions, lengths, crcs)


def parse_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and check a header on its own (used when scanning a region)."""
    if len(data) < HEADER_SIZE:
        raise ValidationError(Failure.MAGIC.value)
    magic, fmt, _flags, key, version, length, crc, head_crc = _HEADER.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise ValidationError(Failure.MAGIC.value)
    if checksum(memoryview(data)[:_HEADER_CRC_SPAN]) != head_crc:
        raise ValidationError(Failure.HEADER_CRC.value)
    return RecordHeader(key, version, length, crc)


def validate_record(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview | Sequence[memoryview],
    descriptor: Descriptor,
    key: bytes,
    *,
    payload_crc: int | None = None,
) -> None:
    """Check a landed record against its descriptor and the key asked for.

    ``payload`` is exactly the landed payload (``descriptor.length`` bytes), or the pieces
    it landed in, in order. ``payload_crc``: the CRC32C of those bytes as they landed, when
    the transport took it while landing them (``read_checksummed``); the payload is then not
    read again. Raises :class:`ValidationError` naming the first check that failed; returns
    nothing on success.
    """
    pieces = payload if isinstance(payload, list | tuple) else (payload,)
    parsed = parse_header(header)
    if parsed.key != key or descriptor.key != key:
        raise ValidationError(Failure.KEY.value)
    if parsed.version != descriptor.version:
        raise ValidationError(Failure.VERSION.value)
    if parsed.length != descriptor.length or sum(len(p) for p in pieces) != descriptor.length:
        raise ValidationError(Failure.LENGTH.value)
    if payload_crc is None:
        payload_crc = checksum_pieces(pieces)
    if parsed.crc != descriptor.crc or payload_crc != parsed.crc:
        raise ValidationError(Failure.CRC.value)
