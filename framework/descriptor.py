"""The descriptor: everything a client needs to read one record without asking anyone."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, overload

import attrs
import numpy as np

from kvfabric._runtime.frozen import field_setters
from kvfabric.errors import ProtocolError
from kvfabric.keys import KEY_SIZE

__all__ = ["DESCRIPTOR_DTYPE", "DESCRIPTOR_SIZE", "Descriptor", "PackedDescriptors"]

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
# key, node, region, offset, length, rkey, version, crc
_WIRE = struct.Struct("<32sIIQQQQI")
DESCRIPTOR_SIZE = _WIRE.size
DESCRIPTOR_DTYPE = np.dtype(
    [
        ("key", "S32"),
        ("node", "<u4"),
        ("region", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("rkey", "<u8"),
        ("version", "<u8"),
        ("crc", "<u4"),
    ]
)
"""The wire form as a numpy record, for building many descriptors' bytes without objects."""
assert DESCRIPTOR_DTYPE.itemsize == DESCRIPTOR_SIZE


def _key(_: Any, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != KEY_SIZE:
        raise ValueError(f"{attribute.name} must be {KEY_SIZE} bytes")


def _u32(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{attribute.name} must fit in 32 bits unsigned, got {value}")


def _u64(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{attribute.name} must fit in 64 bits unsigned, got {value}")


@attrs.frozen(kw_only=True)
class Descriptor:
    """Where one record lives and what it must contain.

    ``offset`` is where the record (header, then payload) starts in the region; ``length``
    is the payload's length; ``version`` and ``crc`` must match the record's header.
    """

    key: bytes = attrs.field(validator=_key)
    node: int = attrs.field(validator=_u32)
    region: int = attrs.field(validator=_u32)
    offset: int = attrs.field(validator=_u64)
    length: int = attrs.field(validator=_u64)
    rkey: int = attrs.field(validator=_u64)
    version: int = attrs.field(validator=_u64)
    crc: int = attrs.field(validator=_u32)
    # The wire form, packed once: a published descriptor is sent in many lookup replies.
    _wire: bytes | None = attrs.field(default=None, init=False, eq=False, hash=False, repr=False)

    def to_bytes(self) -> bytes:
        wire = self._wire
        if wire is None:
            wire = _WIRE.pack(*self._fields_but_crc(), self.crc)
            object.__setattr__(self, "_wire", wire)
        return wire

    def _fields_but_crc(self) -> tuple[bytes, int, int, int, int, int, int]:
        """Every field in wire order, up to (not with) the CRC, the last."""
        return (self.key, self.node, self.region, self.offset, self.length, self.rkey, self.version)

    @classmethod
    def trusted(
        cls,
        *,
        key: bytes,
        node: int,
        region: int,
        offset: int,
        length: int,
        rkey: int,
        version: int,
        crc: int,
    ) -> Descriptor:
        """A descriptor whose fields are in range by construction (an index granting slots
        of its own regions): the validators are skipped, since an index builds one per grant
        in every allocate and publish. Anything from a peer or a caller goes through the
        checked constructor."""
        return _unchecked(None, key, node, region, offset, length, rkey, version, crc)

    def with_crc(self, crc: int) -> Descriptor:
        """This descriptor with ``crc`` (checked) set: a grant as it is published."""
        _u32(None, _CRC_FIELD, crc)
        return _unchecked(None, *self._fields_but_crc(), crc)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, offset: int = 0) -> Descriptor:
        if len(data) - offset < DESCRIPTOR_SIZE:
            raise ProtocolError(f"descriptor needs {DESCRIPTOR_SIZE} bytes")
        wire = bytes(data[offset : offset + DESCRIPTOR_SIZE])
        return _unchecked(wire, *_WIRE.unpack(wire))

    @classmethod
    def many_from_bytes(cls, data: bytes | memoryview) -> list[Descriptor]:
        """Decode back-to-back wire forms (``len(data)`` a multiple of the size)."""
        if len(data) % DESCRIPTOR_SIZE:
            raise ProtocolError(f"descriptors come in {DESCRIPTOR_SIZE}-byte units")
        size = DESCRIPTOR_SIZE
        return [
            _unchecked(data[i * size : (i + 1) * size], *fields)
            for i, fields in enumerate(_WIRE.iter_unpack(data))
        ]


_new = object.__new__


_SETTERS = field_setters(
    Descriptor, "key", "node", "region", "offset", "length", "rkey", "version", "crc", "_wire"
)


def _unchecked(
    wire: bytes | memoryview | None,
    key: bytes,
    node: int,
    region: int,
    offset: int,
    length: int,
    rkey: int,
    version: int,
    crc: int,
) -> Descriptor:
    # Fields unpacked from the fixed wire form are in range by construction, so the
    # validators (a few microseconds per descriptor, on every lookup reply) are skipped.
    d = _new(Descriptor)
    (
        set_key,
        set_node,
        set_region,
        set_offset,
        set_length,
        set_rkey,
        set_version,
        set_crc,
        set_wire,
    ) = _SETTERS
    set_key(d, key)
    set_node(d, node)
    set_region(d, region)
    set_offset(d, offset)
    set_length(d, length)
    set_rkey(d, rkey)
    set_version(d, version)
    set_crc(d, crc)
    set_wire(d, None if wire is None else bytes(wire))
    return d


_CRC_FIELD = attrs.fields(Descriptor).crc


class PackedDescriptors(Sequence[Descriptor]):
    """Descriptors kept in their wire forms, back to back, each decoded when it is asked
    for: a lookup needs only their count and the prefetch cache keeps the wire forms (a read
    decodes the few it takes), so a long reply is never decoded whole in the client's
    Python."""

    __slots__ = ("_count", "wires")

    def __init__(self, wires: bytes) -> None:
        if len(wires) % DESCRIPTOR_SIZE:
            raise ProtocolError(f"descriptors come in {DESCRIPTOR_SIZE}-byte units")
        self.wires = wires
        self._count = len(wires) // DESCRIPTOR_SIZE

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Descriptor: ...
    @overload
    def __getitem__(self, index: slice) -> list[Descriptor]: ...
    def __getitem__(self, index: int | slice) -> Descriptor | list[Descriptor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("descriptor index out of range")
        return Descriptor.from_bytes(self.wires, index * DESCRIPTOR_SIZE)

    def __iter__(self) -> Iterator[Descriptor]:
        return iter(Descriptor.many_from_bytes(self.wires))

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same descriptors, in order (a list included)."""
        if isinstance(other, PackedDescriptors):
            return self.wires == other.wires
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
