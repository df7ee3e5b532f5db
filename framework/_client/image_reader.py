"""The client's side of the lookup image: lookups answered by reading the index's buckets.

The index publishes its entries as an image (:mod:`kvfabric._runtime.image`). This module reads
it, one way per deployment:

- **mapped** — on the controller's host, the image's file mapped read-only and probed in
  place by C: no system call, no copy, the controller's CPU untouched. The probe trusts the
  image only while its owner's heartbeat is fresh (``MAX_AGE``), so a controller that
  stopped or was replaced is asked instead of its stale image. ``embedded://`` stores probe
  their index's own image the same way (no heartbeat needed: it lives in this process).
- **mirrored** — elsewhere, through a transport client (the image is a region of the
  pseudo-node :data:`~kvfabric.spi.IMAGE_NODE`). The reader copies the buckets once, then
  per lookup lands the header and the ring entries logged since its cursor — one read of
  two or three segments, whatever the number of keys: as many entries as this client's own
  publishes rewrote since (:meth:`ImageReader.expect`), so a lookup right after a put
  costs one read too, plus twice what other writers wrote between its last two reads —
  applies them to its copy and probes that, so a lookup's cost on the image's server does
  not grow with its keys (reading each key's window would cost a segment per key, which a
  transport that works per segment on the server, as ``tcp`` does, pays for in the
  controller's CPU). The copy costs the image's bucket bytes of memory (16 MiB by default)
  and one bulk read at connect (and again after falling a ring's length behind).

A reader answers a probe or says it cannot (:attr:`~kvfabric.spi.ImageStop.UNUSABLE`), never
raises for a failed read: the store then asks the controller. It knows nothing of the
store's caches or counters; each probe says how many data-plane round trips it took.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np

from kvfabric._runtime.image import (
    IMAGE_HEADER_SIZE,
    IMAGE_NODE,
    IMAGE_REGION,
    ImageGeometry,
    ImageStop,
    RingState,
    host_identity,
    image_apply,
    image_exists,
    image_prefix,
    ring_pieces,
)
from kvfabric._wire.member_bodies import ImageLocation
from kvfabric.errors import KvfabricError, ProtocolError
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportClient

__all__ = [
    "MAX_AGE",
    "ImageReader",
    "ImageSlot",
    "MappedImage",
    "RemoteImage",
    "could_read",
    "open_image",
]

log = logging.getLogger("kvfabric")

MAX_AGE = 2.0
"""Seconds a mapped image's heartbeat may lag before it is not trusted. The owner beats
every ~0.25 s; a controller loop held up longer than this only costs lookups by RPC."""

_UNUSABLE = (0, ImageStop.UNUSABLE, b"", 0)
# Ring entries read per lookup: at least this many, else this client's own rewrites since
# and twice what other writers' were at the last read.
_MIN_CHUNK = 64
# Reads one lookup may make to catch its mirror up before it gives up (and asks the index).
_MAX_READS = 3
# The buckets are copied in segments of this size.
_COPY_PIECE = 1 << 20
# What a copy of the buckets returns when a read of the image failed.
_UNREADABLE = -2


class ImageReader(abc.ABC):
    """One image, read one way; thread-safe."""

    @abc.abstractmethod
    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes, int]:
        """``(hits, stop, wires, round_trips)``: as
        :func:`~kvfabric._runtime.image.image_prefix` answers, and the data-plane round trips
        the probe took. ``TypeError`` for a key that is not 32 bytes; anything else that
        goes wrong is ``UNUSABLE``.
        """

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> tuple[bytes, int]:
        """One :class:`~kvfabric.spi.ImageStop` per key (MISS, HIT or UNKNOWN; UNUSABLE for
        every key when the image could not be read at all), and the round trips taken."""

    @abc.abstractmethod
    def nodes_generation(self) -> int:
        """The index's nodes generation as of this reader's last probe (mapped: now)."""

    def expect(self, rewrites: int) -> None:
        """This client's own publish just made ``rewrites`` bucket rewrites (at least): a
        reader that catches up reads them with its next probe's one read. Mapped: nothing
        to catch up."""

    def close(self) -> None:
        """Release what the reader holds (a mapping, a connection)."""


class MappedImage(ImageReader):
    """An image in this process's address space, probed in place (under each bucket's
    seqlock, without its CRC: see :func:`~kvfabric._runtime.image.image_prefix`)."""

    def __init__(
        self,
        view: memoryview | mmap.mmap,
        image_id: int,
        *,
        max_age: float = 0.0,
        owned: mmap.mmap | None = None,
    ) -> None:
        """``max_age``: trust the image only while its heartbeat is this fresh (0: always,
        for an image this process writes). ``owned``: a mapping to unmap on close."""
        self._view = view
        self._id = image_id
        self._max_age = max_age
        self._owned = owned

    @classmethod
    def map(cls, location: ImageLocation) -> MappedImage | None:
        """Map the image the controller offers on this host; None when this is not its host
        or the file there is not the one it registered."""
        if not location.path or location.host != host_identity():
            return None
        try:
            fd = os.open(location.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (location.device, location.inode):
                return None
            mapping = mmap.mmap(fd, location.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        try:
            geometry = ImageGeometry.from_header(mapping)
        except ProtocolError:
            mapping.close()
            return None
        if geometry.image_id != location.image_id or geometry.size > location.size:
            mapping.close()
            return None
        return cls(mapping, location.image_id, max_age=MAX_AGE, owned=mapping)

    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes, int]:
        try:
            hits, stop, wires = image_prefix(
                self._view, keys, self._id, self._max_age, checksums=False
            )
        except ValueError:  # the view was released: the store is closing
            return _UNUSABLE
        return hits, stop, wires, 0

    def exists(self, keys: Sequence[bytes]) -> tuple[bytes, int]:
        try:
            return image_exists(self._view, keys, self._id, self._max_age, checksums=False)[1], 0
        except ValueError:
            return bytes([ImageStop.UNKNOWN]) * len(keys), 0

    def nodes_generation(self) -> int:
        try:
            return ImageGeometry.nodes_generation_of(self._view[:IMAGE_HEADER_SIZE])
        except ValueError:  # the view was released: the store is closing
            return -1

    def close(self) -> None:
        if self._owned is not None:
            # A probe still running on another thread keeps it: the GC unmaps it then.
            with contextlib.suppress(BufferError):
                self._owned.close()


@attrs.frozen
class _Landing:
    """Where one catch-up's read lands: the header, ring entries ``first ..`` (``count``),
    and the segments that read them."""

    first: int
    count: int
    header: bytearray
    entries: memoryview
    segments: list[Segment]


class RemoteImage(ImageReader):
    """An image read through a transport client, probed in a mirror kept up to date."""

    def __init__(
        self, client: TransportClient, endpoint: NodeEndpoint, geometry: ImageGeometry
    ) -> None:
        self._client = client
        self._rkey = endpoint.regions[0].rkey
        self._geometry = geometry
        # Header and buckets; every byte is landed by the first copy before any probe.
        self._mirror = np.empty(geometry.buckets_end, np.uint8).data
        self._lock = threading.Lock()
        """Guards the mirror and the cursor: updates and probes take it, reads do not."""
        self._cursor = 0
        """The first rewrite the mirror lacks."""
        self._others = 0
        """Other writers' rewrites the last catch-up found: the next reads twice as many."""
        self._expected = 0
        """Rewrites this client's own publishes made since the last catch-up began: the
        next one reads those too (:meth:`expect`)."""
        self._spare: _Landing | None = None
        """The last catch-up's buffers, for the next one reading the same range."""
        self._generation = -1

    @classmethod
    def connect(
        cls, client: TransportClient, endpoint: NodeEndpoint, location: ImageLocation
    ) -> RemoteImage | None:
        """Reach the image over ``client`` and copy its buckets (a few round trips)."""
        if len(endpoint.regions) != 1 or endpoint.regions[0].region != IMAGE_REGION:
            return None
        try:
            client.connect(endpoint)
            header = bytearray(IMAGE_HEADER_SIZE)
            rkey = endpoint.regions[0].rkey
            errors = client.read(IMAGE_NODE, [Segment(IMAGE_REGION, rkey, 0, memoryview(header))])
            if errors[0] is not None:
                raise errors[0]
            geometry = ImageGeometry.from_header(header)
        except KvfabricError as exc:
            log.info("kvfabric: the lookup image is not readable over %s (%s)", endpoint, exc)
            client.disconnect(IMAGE_NODE)
            return None
        if geometry.image_id != location.image_id or not geometry.log2_ring:
            client.disconnect(IMAGE_NODE)
            return None
        reader = cls(client, endpoint, geometry)
        with reader._lock:
            copied = reader._copy() > 0
        if not copied:
            client.disconnect(IMAGE_NODE)
            return None
        return reader

    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes, int]:
        fresh, trips, _ = self._catch_up()
        if not fresh:
            return (*_UNUSABLE[:3], trips)
        with self._lock:
            hits, stop, wires = image_prefix(self._mirror, keys, self._geometry.image_id, 0.0)
        return hits, stop, wires, trips

    def exists(self, keys: Sequence[bytes]) -> tuple[bytes, int]:
        fresh, trips, unreadable = self._catch_up()
        if not fresh:
            stop = ImageStop.UNUSABLE if unreadable else ImageStop.UNKNOWN
            return bytes([stop]) * len(keys), trips
        with self._lock:
            return image_exists(self._mirror, keys, self._geometry.image_id, 0.0)[1], trips

    def nodes_generation(self) -> int:
        return self._generation

    def expect(self, rewrites: int) -> None:
        # Without this, a lookup right after a put of more keys than the chunk would read
        # the first chunk, find the head further on, and read again.
        with self._lock:
            self._expected += rewrites

    def close(self) -> None:
        self._client.disconnect(IMAGE_NODE)

    # -- keeping the mirror ------------------------------------------------------------------

    def _read(self, pieces: Sequence[tuple[int, memoryview]], *, small: bool = True) -> bool:
        """Land ``(image offset, destination)`` pieces in one batch (one round trip);
        ``small``: a header and ring entries, the transport's least-work read."""
        rkey = self._rkey
        return self._move(
            [Segment(IMAGE_REGION, rkey, offset, dest) for offset, dest in pieces], small
        )

    def _move(self, segments: Sequence[Segment], small: bool) -> bool:
        try:
            if small:
                return self._client.read_small(IMAGE_NODE, segments)
            return not any(self._client.read(IMAGE_NODE, segments))
        except KvfabricError as exc:
            log.debug("kvfabric: lookup image read failed: %s", exc)
            return False

    def _entries(self, first: int, count: int) -> tuple[memoryview, list[tuple[int, memoryview]]]:
        """A buffer for ring entries ``first ..`` and the pieces that land them."""
        pieces = ring_pieces(self._geometry, first, count)
        buffer = np.empty(sum(n for _, n in pieces), np.uint8).data
        landing = []
        at = 0
        for offset, n in pieces:
            landing.append((offset, buffer[at : at + n]))
            at += n
        return buffer, landing

    def _landing(self, first: int, count: int) -> _Landing:
        """Buffers and segments for the header and ring entries ``first ..``: the last
        lookup's when it read the same range (a quiet image: every lookup does), else new.
        Taken under the lock; a lookup running meanwhile makes its own."""
        spare = self._spare
        if spare is not None and spare.first == first and spare.count == count:
            self._spare = None
            return spare
        header = bytearray(IMAGE_HEADER_SIZE)
        entries, pieces = self._entries(first, count)
        rkey = self._rkey
        segments = [
            Segment(IMAGE_REGION, rkey, offset, dest)
            for offset, dest in [(0, memoryview(header)), *pieces]
        ]
        return _Landing(first, count, header, entries, segments)

    def _catch_up(self) -> tuple[bool, int, bool]:
        """Apply every rewrite logged before the head read now: ``(fresh, round trips,
        unreadable)``; ``unreadable``: not fresh because a read of the image failed."""
        trips = 0
        ring = self._geometry.ring_length
        for _ in range(_MAX_READS):
            with self._lock:
                own = self._expected
                if own > ring:
                    # This client's own publishes lapped the ring: no entry read can
                    # catch the mirror up, a copy of the buckets does.
                    self._expected = 0
                    copied = self._copy()
                    if copied < 0:
                        return False, trips + 1, copied == _UNREADABLE
                    trips += copied
                    continue
                count = min(max(_MIN_CHUNK, own + 2 * self._others), ring)
                landing = self._landing(self._cursor, count)
            first = landing.first
            trips += 1
            if not self._move(landing.segments, True):
                return False, trips, True
            with self._lock:
                cursor, head, state = image_apply(
                    self._mirror, landing.header, landing.entries, first, self._cursor
                )
                self._generation = ImageGeometry.nodes_generation_of(landing.header)
                self._spare = landing
                self._cursor = max(self._cursor, cursor)
                self._expected = max(0, self._expected - own)
                # Next time, read this client's own rewrites (its publishes say how many)
                # and twice what others wrote since the last read: a burst of writes is
                # caught up in one more read, a quiet image costs a few KiB per lookup.
                self._others = max(0, head - first - own)
                if state == RingState.CAUGHT_UP:
                    return True, trips, False
                if state == RingState.LAPPED:
                    copied = self._copy()
                    if copied < 0:
                        return False, trips + 1, copied == _UNREADABLE
                    trips += copied
                elif state == RingState.FOREIGN:
                    return False, trips, False
        return False, trips, False

    def _copy(self) -> int:
        """Copy the buckets again (under the lock): round trips taken, or
        :data:`_UNREADABLE` if a read failed, -1 if the copy could not be applied.

        The head is read first; the header again, the buckets and the entries logged since
        that head come in one more batch, so a bucket rewritten while it was copied is put
        right by its entry (or, if logged after that header, by the next lookup's read).
        """
        geometry = self._geometry
        header = bytearray(IMAGE_HEADER_SIZE)
        if not self._read([(0, memoryview(header))]):
            return _UNREADABLE
        head = ImageGeometry.head_of(header)
        again = bytearray(IMAGE_HEADER_SIZE)
        mirror = self._mirror
        buckets = [
            (offset, mirror[offset : min(offset + _COPY_PIECE, geometry.buckets_end)])
            for offset in range(IMAGE_HEADER_SIZE, geometry.buckets_end, _COPY_PIECE)
        ]
        entries, pieces = self._entries(
            head, min(max(_MIN_CHUNK, 2 * self._others), geometry.ring_length)
        )
        if not self._read([(0, memoryview(again)), *buckets, *pieces], small=False):
            return _UNREADABLE
        mirror[:IMAGE_HEADER_SIZE] = again
        cursor, _, state = image_apply(mirror, again, entries, head, head)
        if state in (RingState.LAPPED, RingState.FOREIGN):
            return -1
        self._cursor = cursor
        return 2


def open_image(
    location: ImageLocation,
    clients: Mapping[str, TransportClient],
    *,
    map_locally: bool,
) -> ImageReader | None:
    """The best way this client has to read the image at ``location``, or None.

    Mapped when allowed (``map_locally``: the client may use ``shm``) and on the
    controller's host; else the first of ``clients`` (most preferred first) that serves it
    and reaches it.
    """
    if map_locally:
        mapped = MappedImage.map(location)
        if mapped is not None:
            return mapped
    for client, endpoint in _usable_endpoints(location, clients):
        remote = RemoteImage.connect(client, endpoint, location)
        if remote is not None:
            return remote
    return None


def could_read(location: ImageLocation, clients: Mapping[str, TransportClient]) -> bool:
    """Whether the image at ``location`` is served on a transport among ``clients`` that
    reaches it (mapping aside): one that could not be opened now may be later."""
    return any(True for _ in _usable_endpoints(location, clients))


def _usable_endpoints(
    location: ImageLocation, clients: Mapping[str, TransportClient]
) -> Iterator[tuple[TransportClient, NodeEndpoint]]:
    endpoints = {e.transport: e for e in location.endpoints}
    for name, client in clients.items():
        endpoint = endpoints.get(name)
        if name != "shm" and endpoint is not None and client.reachable(endpoint):
            yield client, endpoint


class ImageSlot:
    """The store's current reader, swapped whole when the image moves; thread-safe."""

    def __init__(self, reader: ImageReader | None = None) -> None:
        self._lock = threading.Lock()
        self.reader = reader

    def replace(self, reader: ImageReader | None) -> None:
        with self._lock:
            old, self.reader = self.reader, reader
        if old is not None and old is not reader:
            old.close()
