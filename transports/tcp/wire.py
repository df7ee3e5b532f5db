"""The ``tcp`` transport's wire format: frames, their limits and their error codes.

Version 2, little-endian ``struct`` (never pickle). Every frame starts with one header::

    header   magic b"KVFT" | version u8 | op u8 | code u16 | count u32 | request id u64

A connection opens with a handshake (``kvfabric.transports.tcp.auth``): the node's
GREETING, then, inside TLS when the node offers it, the client's HELLO and the node's
HELLO reply. After that it carries one request and its reply at a time::

    request  READ:  header, count x entry
             WRITE: header, count x entry, then every segment's bytes in entry order
    entry    region u32 | rkey u64 | offset u64 | length u64
    reply    header (the request's op and id, code 0), then count x status u8
             (``kvfabric.spi.SegmentStatus``: 0 accepted, 1 unknown region, 2 bad rkey,
             3 out of bounds, 4 a write to a read-only region), then for READ the bytes
             of every accepted segment in order

A request's ``code`` is 0. A frame the node will not serve gets an error reply (a header
with count 0 and a nonzero :class:`Code`) and the connection is closed; other connections
are not affected. Version 1 (a token sent in clear in the first frame) is gone: a version 1
peer's first frame is answered BAD_FRAME.
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "ENTRY",
    "HEADER",
    "MAGIC",
    "MAX_BATCH_BYTES",
    "MAX_COUNT",
    "VERSION",
    "Code",
    "Op",
    "code_text",
    "pack_header",
]

MAGIC = b"KVFT"
VERSION = 2
HEADER = struct.Struct("<4sBBHIQ")
ENTRY = struct.Struct("<IQQQ")
MAX_COUNT = 65536
"""Entries per frame; a client splits a larger batch into several frames."""
MAX_BATCH_BYTES = 1 << 40
"""Bytes one frame's entries may add up to."""


class Op(enum.IntEnum):
    READ = 1
    WRITE = 2
    HELLO = 3
    """The client's proof (and the node's reply with its own)."""
    GREETING = 4
    """The node's first bytes on every connection: its flags and a fresh nonce."""


class Code(enum.IntEnum):
    """Per frame, in a reply header; anything but OK is followed by the node closing."""

    OK = 0
    BAD_FRAME = 1
    TOO_LARGE = 2
    AUTH_REQUIRED = 3
    """A READ or WRITE before the handshake completed."""
    AUTH_FAILED = 4
    """The client's proof does not match: it does not hold the node's secret."""
    BUSY = 5
    """The node serves ``max_connections`` busy connections already."""


_CODE_TEXT = {
    Code.BAD_FRAME: "malformed frame",
    Code.TOO_LARGE: "batch too large",
    Code.AUTH_REQUIRED: "the handshake must come first",
    Code.AUTH_FAILED: "this client does not hold the node's secret",
    Code.BUSY: "the node is at its connection limit (tcp.max_connections)",
}


def code_text(code: int) -> str:
    try:
        return _CODE_TEXT[Code(code)]
    except (ValueError, KeyError):
        return f"error code {code}"


def pack_header(op: int, code: int, count: int, rid: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, code, count, rid)
