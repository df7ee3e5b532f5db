"""The lookup image: an index's key → descriptor hash table, read one-sided by clients.

An index that owns its entries in one process (the ``memory`` index) can publish them as an
*image*: shareable memory, written only by the index (under its lock), that the controller
registers with its transports like a data node's region. A client then answers
``batched_contains`` itself — probing the mapped image in place on the same host; elsewhere
keeping a mirror of its buckets that one data-plane read per lookup brings up to date (the
ring below) — and the controller's CPU does no work per lookup. The image is a shortcut,
like the prefetch cache: a bucket that is torn, stale or unreadable is *unknown* and the
client asks the controller; a stale hit is read and validated like every descriptor, so it
can only cost a miss.

Layout (little-endian). A 64-byte header::

     0  4s  magic "KVFI"
     4  u16 format (1)
     6  u16 bucket size (64)
     8  u32 window W: buckets a key may occupy, from its home on
    12  u32 log2 of the bucket count N
    16  u64 image id (random per image: a client checks it is reading the image it was told of)
    24  u64 heartbeat: the owner's CLOCK_MONOTONIC in ns, restamped every ~0.25 s (0: closed)
    32  u64 ring head: bucket rewrites logged so far
    40  u32 log2 of the ring's length R (0: no ring)
    44  u32 ring entry size (96)
    48  u64 where the ring starts
    56  u32 nodes generation: grows whenever a data node registers or leaves the index
        (writers holding extents check it: see :class:`~kvfabric.spi.Extent`)
    60  u32 CRC32C of bytes 0..24 and 40..60

then ``N + W - 1`` buckets of 64 bytes (so no window wraps)::

     0  u32 seq       0: never written; odd while the owner rewrites the bucket; else even
     4  u16 overflow  keys whose home is this bucket that found no room in their window
     6  u16 flags     bit 0: occupied
     8  8B  tag       key[8:16]
    16  44B fields    node, region, offset, length, rkey, version, crc: the descriptor's wire
                      form after its key, byte for byte
    60  u32 check     CRC32C of bytes 0..60, the sequence number included

then the ring: R entries of 96 bytes, rewrite number h in slot h mod R::

     0  u64 h       88  u32 CRC32C of bytes 0..88
     8  u64 bucket  92  u32 zero
    16  64B the bucket's bytes after rewrite h
    80  u64 h again

A key's *home* is ``key[0:8]`` (little-endian) mod N; it lives in the first free bucket of
buckets home..home+W-1, or, if none is free, not in the image (its home's overflow count
says so). Keys are uniform hashes, so the home and the 64-bit tag together tell keys apart
with ~80 bits; two keys matching both is as likely as a random 80-bit collision, and even
then the record read would fail validation (its header carries the whole key).

A probe of one key reads its window and answers *hit* (a whole bucket holding the key),
*miss* (every bucket whole, none holding the key, overflow 0) or *unknown* (anything else).
The owner rewrites a bucket as a seqlock (odd number, the bytes, the next even number,
ordered by release fences), logs the new bytes in the ring, and then advances the head. A
probe compares a bucket's number before and after its copy and, in a mirror, checks the
bucket's CRC (``checksums``; the owner's memory read in place needs only the numbers). Keys
never move between buckets while they are published, so a probe that sees a window over some
microseconds sees each key that stayed published meanwhile.

A client elsewhere copies the buckets once (:func:`ring_pieces` says where the entries it
lacks lie), then per lookup lands the header and the entries since its cursor — one read of
two or three segments, whatever the number of keys — and applies them to its mirror
(:func:`image_apply`): its mirror is then as fresh as the head it read, as a direct read of
the buckets would be. Entries are checked (number, CRC); a client that fell more than R
rewrites behind copies the buckets again.

The probes, the writer and the mirror's update are C (``kvfabric._runtime._image``): a probe of
64 keys is a few microseconds and takes the GIL once.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvfabric._runtime import _image
from kvfabric._runtime.native import crc32c
from kvfabric.errors import ProtocolError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "IMAGE_BUCKET_SIZE",
    "IMAGE_HEADER_SIZE",
    "IMAGE_NODE",
    "IMAGE_REGION",
    "IMAGE_WINDOW",
    "RING_ENTRY_SIZE",
    "ImageGeometry",
    "ImageStop",
    "RingState",
    "alternate_key",
    "first_bad_key",
    "host_identity",
    "image_apply",
    "image_beat",
    "image_exists",
    "image_prefix",
    "image_store",
    "ring_pieces",
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

RING_ENTRY_SIZE = 96
_HEADER = struct.Struct("<4sHHIIQQQIIQ4x")


class RingState:
    """How a mirror's update went (:func:`image_apply`)."""

    CAUGHT_UP = 0
    """Every logged rewrite is applied."""
    BEHIND = 1
    """More were logged than were landed: read on from the new cursor."""
    GAP = 2
    """The landed entries start after the cursor."""
    LAPPED = 3
    """The ring moved on more than its length (or an entry was torn): copy the buckets."""
    FOREIGN = 4
    """Another image (the owner restarted)."""


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
    log2_ring: int = 0
    """log2 of the ring's length (0: no ring)."""

    @property
    def buckets(self) -> int:
        """N: the bucket count homes are taken modulo."""
        return 1 << self.log2_buckets

    @property
    def buckets_end(self) -> int:
        """Bytes of the header and the ``N + window - 1`` buckets; the ring starts here."""
        return IMAGE_HEADER_SIZE + (self.buckets + self.window - 1) * IMAGE_BUCKET_SIZE

    @property
    def ring_length(self) -> int:
        return (1 << self.log2_ring) if self.log2_ring else 0

    @property
    def size(self) -> int:
        """Bytes of the whole image: header, buckets and ring."""
        return self.buckets_end + self.ring_length * RING_ENTRY_SIZE

    @classmethod
    def fitting(cls, image_id: int, size: int, window: int = IMAGE_WINDOW) -> ImageGeometry:
        """The most buckets (a power of two, at least 2 ** 10) whose bytes fit in ``size``,
        and a ring of a quarter as many entries (96 bytes each: 0.375x ``size`` more)."""
        log2 = 10
        while (IMAGE_BUCKET_SIZE << (log2 + 1)) <= size:
            log2 += 1
        return cls(image_id=image_id, log2_buckets=log2, window=window, log2_ring=log2 - 2)

    def home(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") & (self.buckets - 1)

    def header(self) -> bytes:
        """The header, heartbeat 0 (closed until the owner first beats)."""
        raw = _HEADER.pack(
            IMAGE_MAGIC,
            IMAGE_FORMAT,
            IMAGE_BUCKET_SIZE,
            self.window,
            self.log2_buckets,
            self.image_id,
            0,
            0,
            self.log2_ring,
            RING_ENTRY_SIZE if self.log2_ring else 0,
            self.buckets_end if self.log2_ring else 0,
        )
        check = crc32c(raw[40:60], crc32c(raw[:24]))
        return raw + check.to_bytes(4, "little")

    @classmethod
    def from_header(cls, data: ReadableBuffer) -> ImageGeometry:
        """Parse and check a header; :class:`ProtocolError` if it is not an image's."""
        raw = bytes(memoryview(data)[:IMAGE_HEADER_SIZE])
        if len(raw) < IMAGE_HEADER_SIZE:
            raise ProtocolError("an image header is 64 bytes")
        magic, fmt, bucket, window, log2, image_id, _, _, ring, entry, ring_at = _HEADER.unpack(
            raw[:60]
        )
        if (magic, fmt, bucket) != (IMAGE_MAGIC, IMAGE_FORMAT, IMAGE_BUCKET_SIZE):
            raise ProtocolError("not a kvfabric lookup image of format 1")
        if int.from_bytes(raw[60:], "little") != crc32c(raw[40:60], crc32c(raw[:24])):
            raise ProtocolError("the image header fails its checksum")
        if not 1 <= window <= 64 or log2 > 40 or ring > 32:
            raise ProtocolError(f"implausible image geometry: window {window}, 2**{log2}")
        geometry = cls(image_id=image_id, log2_buckets=log2, window=window, log2_ring=ring)
        if ring and (entry != RING_ENTRY_SIZE or ring_at != geometry.buckets_end):
            raise ProtocolError("the image's ring is not where format 1 puts it")
        return geometry

    @staticmethod
    def nodes_generation_of(header: ReadableBuffer) -> int:
        """The nodes generation a header (as landed or mapped) carries."""
        return int.from_bytes(bytes(memoryview(header)[56:60]), "little")

    @staticmethod
    def with_nodes_generation(header: ReadableBuffer, generation: int) -> bytes:
        """``header`` with another nodes generation, its check made again."""
        raw = bytearray(memoryview(header)[:IMAGE_HEADER_SIZE])
        raw[56:60] = (generation & 0xFFFFFFFF).to_bytes(4, "little")
        raw[60:64] = crc32c(bytes(raw[40:60]), crc32c(bytes(raw[:24]))).to_bytes(4, "little")
        return bytes(raw)

    @staticmethod
    def head_of(header: ReadableBuffer) -> int:
        """The ring head a header (as landed or mapped) carries."""
        return int.from_bytes(memoryview(header)[32:40], "little")


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
    max_age: float = 0.0,
    *,
    checksums: bool = True,
    stamps: WriteableBuffer | None = None,
    now: float = 0.0,
) -> tuple[int, int, bytes]:
    """Walk ``keys`` in order until one is not a hit: ``(hits, stop, wires)``.

    ``stop`` is an :class:`ImageStop`; ``wires`` holds the ``hits`` descriptors' wire forms.
    ``image``: the image (its owner's memory, mapped) or a client's mirror of it, from the
    header on. ``max_age``: seconds the heartbeat may lag this host's clock (0: not checked).
    ``checksums``: check each bucket's CRC. A mirror needs it (its buckets were copied in
    bulk, and a copy may be torn); the owner's memory, read in place, does not: every
    bucket there is read between two reads of its sequence number, which the owner makes
    odd before it changes a byte and even after, so a torn read is seen without the CRC
    (about a third of a hit's cost). A key that is not 32 ``bytes`` raises ``TypeError``.

    ``stamps`` (the owner's own probes): one float64 per bucket, each hit's set to ``now``,
    so the owner learns which entries were used without a step per key in Python.
    """
    return _image.image_prefix(image, keys, image_id, max_age, checksums, stamps, now)


def first_bad_key(keys: Sequence[object]) -> int:
    """The position of the first item that is not a 32-byte ``bytes``, or -1 (in C: a
    lookup's keys are checked on the caller's thread before anything is asked)."""
    return _image.first_bad_key(keys)


def image_exists(
    image: ReadableBuffer,
    keys: Sequence[bytes],
    image_id: int,
    max_age: float = 0.0,
    *,
    checksums: bool = True,
    stamps: WriteableBuffer | None = None,
    now: float = 0.0,
) -> tuple[bool, bytes]:
    """Every key's state, one :class:`ImageStop` byte each; ``(usable, states)``
    (``checksums``, ``stamps`` and ``now`` as for :func:`image_prefix`)."""
    return _image.image_exists(image, keys, image_id, max_age, checksums, stamps, now)


def image_apply(
    mirror: WriteableBuffer,
    header: ReadableBuffer,
    entries: ReadableBuffer,
    first: int,
    cursor: int,
) -> tuple[int, int, int]:
    """Bring a mirror up to date: ``(cursor, head, state)``, ``state`` a :class:`RingState`.

    ``mirror``: header and buckets, as copied; ``header``: the image's header as just landed;
    ``entries``: ring entries landed after it, the first logging rewrite ``first``;
    ``cursor``: the first rewrite the mirror lacks. Applies what was landed of rewrites
    ``cursor .. head - 1``, each checked.
    """
    return _image.image_apply(mirror, header, entries, first, cursor)


def ring_pieces(geometry: ImageGeometry, first: int, count: int) -> list[tuple[int, int]]:
    """Where ring entries ``first .. first + count - 1`` lie: (image offset, bytes) pieces,
    two where the range wraps; laid end to end they are the entries in order."""
    length = geometry.ring_length
    count = min(count, length)
    slot = first % length
    start = geometry.buckets_end + slot * RING_ENTRY_SIZE
    if slot + count <= length:
        return [(start, count * RING_ENTRY_SIZE)]
    head = length - slot
    return [
        (start, head * RING_ENTRY_SIZE),
        (geometry.buckets_end, (count - head) * RING_ENTRY_SIZE),
    ]


def host_identity() -> bytes:
    """This kernel's boot id: equal on two processes means "same host" (the image's owner
    offers a client there its file to map)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename.encode()


def alternate_key(key: bytes, n: int) -> bytes:
    """Where an index that keeps a lookup image files the ``n``-th other copy (n >= 1) of
    ``key``'s value: a bucket of its own under this derived key, so the image keeps one
    descriptor per bucket and lookups probe exactly what they did. A reader whose copy
    failed probes it and puts ``key`` back into the descriptor it finds."""
    return hashlib.blake2b(key, digest_size=32, person=b"kvf-alt%d" % n).digest()
