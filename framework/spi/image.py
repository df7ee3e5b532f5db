"""The lookup image: an index's key → descriptor hash table, read one-sided by clients.

An index that owns its entries in one process (the ``memory`` index) can publish them as an
*image*: shareable memory, written only by the index (under its lock), that the controller
registers with its transports like a data node's region. A client then answers
``batched_contains`` by reading the buckets of its keys itself — a mapped read on the same
host, one data-plane round trip over ``tcp`` or ``ucx`` — and the controller's CPU does no
work per lookup. The image is a shortcut, like the prefetch cache: a bucket that is torn,
stale or unreadable is *unknown* and the client asks the controller; a stale hit is read and
validated like every descriptor, so it can only cost a miss.

Layout (little-endian). A 64-byte header::

     0  4s  magic "KVFI"
     4  u16 format (1)
     6  u16 bucket size (64)
     8  u32 window W: buckets a key may occupy, from its home on
    12  u32 log2 of the bucket count N
    16  u64 image id (random per image: a client checks it is reading the image it was told of)
    24  u64 heartbeat: the owner's CLOCK_MONOTONIC in ns, restamped every ~0.25 s (0: closed)
    32  28  zero
    60  u32 CRC32C of bytes 0..24 and 32..60

then ``N + W - 1`` buckets of 64 bytes (so no window wraps)::

     0  u32 seq       0: never written; odd while the owner rewrites the bucket; else even
     4  u16 overflow  keys whose home is this bucket that found no room in their window
     6  u16 flags     bit 0: occupied
     8  8B  tag       key[8:16]
    16  44B fields    node, region, offset, length, rkey, version, crc: the descriptor's wire
                      form after its key, byte for byte
    60  u32 check     CRC32C of bytes 0..60, the sequence number included

A key's *home* is ``key[0:8]`` (little-endian) mod N; it lives in the first free bucket of
buckets home..home+W-1, or, if none is free, not in the image (its home's overflow count
says so). Keys are uniform hashes, so the home and the 64-bit tag together tell keys apart
with ~80 bits; two keys matching both is as likely as a random 80-bit collision, and even
then the record read would fail validation (its header carries the whole key).

A probe of one key reads its window and answers *hit* (a whole bucket holding the key),
*miss* (every bucket whole, none holding the key, overflow 0) or *unknown* (anything else).
The owner rewrites a bucket as a seqlock (odd number, the bytes, the next even number,
ordered by release fences): a reader of live memory compares the number before and after its
copy; a reader of a landed copy relies on the even number and the check. Keys never move
between buckets while they are published, so a reader that sees a window over some
microseconds sees each key that stayed published meanwhile.

The probes and the writer are C (``kvfabric.spi._image``): a probe of 64 keys is a few
microseconds and takes the GIL once.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvfabric.errors import ProtocolError
from kvfabric.spi import _image
from kvfabric.spi.native import crc32c

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "IMAGE_BUCKET_SIZE",
    "IMAGE_HEADER_SIZE",
    "IMAGE_NODE",
    "IMAGE_REGION",
    "IMAGE_WINDOW",
    "ImageGeometry",
    "ImageStop",
    "host_identity",
    "image_beat",
    "image_exists",
    "image_prefix",
    "image_store",
    "image_windows",
]

IMAGE_MAGIC = b"KVFI"
IMAGE_FORMAT = 1
IMAGE_HEADER_SIZE = 64
IMAGE_BUCKET_SIZE = 64
IMAGE_WINDOW = 8
"""Buckets a key may occupy. At a quarter full, about 1 key in 2,000 finds no room (and is
looked up by a control RPC); a window is 512 bytes, one segment of a remote read."""
IMAGE_NODE = 0xFFFFFFFF
"""The node id clients give the image when they reach it through a transport client (no
data node gets it: ids count up from 1)."""
IMAGE_REGION = 0xFFFFFFFF
"""The image's region id on the transport servers that serve it (apart from node regions)."""

_HEADER = struct.Struct("<4sHHIIQQ28x")


class ImageStop:
    """Why a prefix probe stopped (:func:`image_prefix`); also each key's state in
    :func:`image_exists` (MISS, HIT or UNKNOWN)."""

    MISS = 0
    """The key is not published (its window is whole and does not hold it)."""
    HIT = 1
    """Every key was found."""
    UNKNOWN = 2
    """A torn bucket or an overflowed home: the image cannot tell; ask the index."""
    UNUSABLE = 3
    """Not this image, a bad header, or its owner stopped beating: ask the index."""


@attrs.frozen(kw_only=True)
class ImageGeometry:
    """What the header says: which image, and how its buckets are laid out."""

    image_id: int
    log2_buckets: int
    window: int = IMAGE_WINDOW

    @property
    def buckets(self) -> int:
        """N: the bucket count homes are taken modulo."""
        return 1 << self.log2_buckets

    @property
    def size(self) -> int:
        """Bytes of the whole image: the header and ``N + window - 1`` buckets."""
        return IMAGE_HEADER_SIZE + (self.buckets + self.window - 1) * IMAGE_BUCKET_SIZE

    @classmethod
    def fitting(cls, image_id: int, size: int, window: int = IMAGE_WINDOW) -> ImageGeometry:
        """The most buckets (a power of two, at least 2 ** 10) whose bytes fit in ``size``;
        the header and the window's tail add ~0.5 KiB."""
        log2 = 10
        while (IMAGE_BUCKET_SIZE << (log2 + 1)) <= size:
            log2 += 1
        return cls(image_id=image_id, log2_buckets=log2, window=window)

    def home(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") & (self.buckets - 1)

    def header(self) -> bytes:
        """The header, heartbeat 0 (closed until the owner first beats)."""
        raw = bytearray(
            _HEADER.pack(
                IMAGE_MAGIC,
                IMAGE_FORMAT,
                IMAGE_BUCKET_SIZE,
                self.window,
                self.log2_buckets,
                self.image_id,
                0,
            )
        )
        check = crc32c(raw[32:60], crc32c(raw[:24]))
        return bytes(raw[:60]) + check.to_bytes(4, "little")

    @classmethod
    def from_header(cls, data: ReadableBuffer) -> ImageGeometry:
        """Parse and check a header; :class:`ProtocolError` if it is not an image's."""
        raw = bytes(memoryview(data)[:IMAGE_HEADER_SIZE])
        if len(raw) < IMAGE_HEADER_SIZE:
            raise ProtocolError("an image header is 64 bytes")
        magic, fmt, bucket, window, log2, image_id, _ = _HEADER.unpack(raw[:60])
        if (magic, fmt, bucket) != (IMAGE_MAGIC, IMAGE_FORMAT, IMAGE_BUCKET_SIZE):
            raise ProtocolError("not a kvfabric lookup image of format 1")
        if int.from_bytes(raw[60:], "little") != crc32c(raw[32:60], crc32c(raw[:24])):
            raise ProtocolError("the image header fails its checksum")
        if not 1 <= window <= 64 or log2 > 40:
            raise ProtocolError(f"implausible image geometry: window {window}, 2**{log2}")
        return cls(image_id=image_id, log2_buckets=log2, window=window)


def image_store(image: WriteableBuffer, bucket: int, wire: bytes | None, overflow: int) -> None:
    """Rewrite one bucket under its seqlock (the owner only, one writer at a time).

    ``wire``: a descriptor's 76-byte wire form (the bucket then holds it), ``b""`` (empty)
    or ``None`` (keep what it holds). ``overflow``: the home's overflow count, -1 to keep it.
    """
    _image.image_store(image, bucket, wire, overflow)


def image_beat(image: WriteableBuffer, alive: bool = True) -> None:
    """Stamp the heartbeat now (``alive=False``: 0, closed: readers stop trusting it)."""
    _image.image_beat(image, alive)


def image_prefix(
    image: ReadableBuffer,
    keys: Sequence[bytes],
    image_id: int,
    positions: ReadableBuffer | None = None,
    max_age: float = 0.0,
) -> tuple[int, int, bytes]:
    """Walk ``keys`` in order until one is not a hit: ``(hits, stop, wires)``.

    ``stop`` is an :class:`ImageStop`; ``wires`` holds the ``hits`` descriptors' wire forms.
    ``image``: the whole image (live memory, read under the seqlock), or with ``positions``
    (a u64 per key) a landed copy: its header at 0 and key i's window at ``positions[i]``.
    ``max_age``: seconds the heartbeat may lag this host's clock (0: not checked). A key
    that is not 32 ``bytes`` raises ``TypeError``.
    """
    return _image.image_prefix(image, keys, image_id, positions, max_age)


def image_exists(
    image: ReadableBuffer,
    keys: Sequence[bytes],
    image_id: int,
    positions: ReadableBuffer | None = None,
    max_age: float = 0.0,
) -> tuple[bool, bytes]:
    """Every key's state, one :class:`ImageStop` byte each; ``(usable, states)``."""
    return _image.image_exists(image, keys, image_id, positions, max_age)


def image_windows(keys: Sequence[bytes], geometry: ImageGeometry) -> tuple[bytes, bytes]:
    """What a remote probe lands: ``(ranges, positions)``.

    ``ranges``: (image offset, length) u64 pairs, the header first, then the keys' windows
    sorted and merged where they overlap or nearly touch; laid end to end they make the
    landing buffer. ``positions``: each key's window in that buffer (u64 each), as
    :func:`image_prefix` takes them.
    """
    return _image.image_windows(keys, geometry.log2_buckets, geometry.window)


def landing_size(ranges: bytes) -> int:
    """Bytes of the landing buffer for ``ranges``."""
    return sum(length for _, length in struct.iter_unpack("<QQ", ranges))


def host_identity() -> bytes:
    """This kernel's boot id: equal on two processes means "same host" (the image's owner
    offers a client there its file to map)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename.encode()
