"""Little helpers for explicit binary wire forms (never pickle).

``Writer`` appends fixed-width integers and length-prefixed byte strings; ``Reader`` takes
them back and raises :class:`~kvfabric.errors.ProtocolError` on any short or malformed input,
so a bad frame is a clear error, never an IndexError deep inside a handler.
"""

from __future__ import annotations

import struct

from kvfabric.errors import ProtocolError

__all__ = ["Reader", "Writer"]

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


class Writer:
    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, value: int) -> Writer:
        self._parts.append(_U8.pack(value))
        return self

    def u32(self, value: int) -> Writer:
        self._parts.append(_U32.pack(value))
        return self

    def u64(self, value: int) -> Writer:
        self._parts.append(_U64.pack(value))
        return self

    def f64(self, value: float) -> Writer:
        self._parts.append(_F64.pack(value))
        return self

    def raw(self, value: bytes) -> Writer:
        self._parts.append(value)
        return self

    def blob(self, value: bytes) -> Writer:
        self._parts.append(_U32.pack(len(value)))
        self._parts.append(value)
        return self

    def text(self, value: str) -> Writer:
        return self.blob(value.encode())

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes | memoryview, offset: int = 0) -> None:
        self._data = data
        self._pos = offset

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def _take(self, n: int) -> int:
        if n < 0 or self._pos + n > len(self._data):
            raise ProtocolError(f"frame too short: wanted {n} more bytes, {self.remaining} left")
        start = self._pos
        self._pos += n
        return start

    def u8(self) -> int:
        return int(_U8.unpack_from(self._data, self._take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack_from(self._data, self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self._data, self._take(8))[0])

    def f64(self) -> float:
        return float(_F64.unpack_from(self._data, self._take(8))[0])

    def skip(self, n: int) -> int:
        """Step over ``n`` bytes; where they start in :attr:`data` (read them there, no
        copy made)."""
        return self._take(n)

    @property
    def data(self) -> bytes | memoryview:
        """The whole buffer read from (offsets as :meth:`skip` returns them)."""
        return self._data

    def raw(self, n: int) -> bytes:
        start = self._take(n)
        return bytes(self._data[start : start + n])

    def blob(self, limit: int = 1 << 24) -> bytes:
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"field of {n} bytes exceeds the limit of {limit}")
        return self.raw(n)

    def text(self, limit: int = 4096) -> str:
        try:
            return self.blob(limit).decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError("text field is not UTF-8") from exc

    def count(self, item_size: int = 1, limit: int = 1 << 20) -> int:
        """A u32 item count, checked against what is left so a lie cannot allocate much."""
        n = self.u32()
        if n > limit or n * item_size > self.remaining:
            raise ProtocolError(f"count {n} does not fit the frame")
        return n

    def end(self) -> None:
        if self.remaining:
            raise ProtocolError(f"{self.remaining} unexpected bytes at the end of the frame")
