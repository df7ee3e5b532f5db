"""The client's side of the lookup image: lookups answered by reading the index's buckets.

The index publishes its entries as an image (:mod:`kvfabric.spi.image`). This module reads
it, one way per deployment:

- **mapped** — on the controller's host, the image's file mapped read-only and probed in
  place by C: no system call, no copy, the controller's CPU untouched. The probe trusts the
  image only while its owner's heartbeat is fresh (``MAX_AGE``), so a controller that
  stopped or was replaced is asked instead of its stale image. ``embedded://`` stores probe
  their index's own image the same way (no heartbeat needed: it lives in this process).
- **remote** — elsewhere, through a transport client, the image being a region of the
  pseudo-node :data:`~kvfabric.spi.IMAGE_NODE`: one batched read per lookup (the header,
  then each key's 512-byte window, windows that nearly touch merged), landed in a scratch
  buffer and probed there. The header rides along, so a lookup never trusts a replaced image.

A reader answers a probe or says it cannot (:attr:`~kvfabric.spi.ImageStop.UNUSABLE`), never
raises for a failed read: the store then asks the controller. It knows nothing of the
store's caches or counters.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from kvfabric._wire.protocol import ImageLocation
from kvfabric.errors import KvfabricError, ProtocolError
from kvfabric.spi.image import (
    IMAGE_HEADER_SIZE,
    IMAGE_NODE,
    IMAGE_REGION,
    ImageGeometry,
    ImageStop,
    host_identity,
    image_exists,
    image_prefix,
    image_windows,
)
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportClient

__all__ = ["MAX_AGE", "ImageReader", "MappedImage", "RemoteImage", "open_image"]

log = logging.getLogger("kvfabric")

MAX_AGE = 2.0
"""Seconds a mapped image's heartbeat may lag before it is not trusted. The owner beats
every ~0.25 s; a controller loop held up longer than this only costs lookups by RPC."""

_UNUSABLE = (0, ImageStop.UNUSABLE, b"")


class ImageReader(abc.ABC):
    """One image, read one way; thread-safe."""

    round_trips: int = 0
    """Data-plane round trips each probe costs."""

    @abc.abstractmethod
    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes]:
        """``(hits, stop, wires)`` as :func:`~kvfabric.spi.image.image_prefix` answers.

        ``TypeError`` for a key that is not 32 bytes; anything else is ``UNUSABLE``.
        """

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> bytes:
        """One :class:`~kvfabric.spi.ImageStop` per key (MISS, HIT or UNKNOWN)."""

    def close(self) -> None:
        """Release what the reader holds (a mapping, a connection)."""


class MappedImage(ImageReader):
    """An image in this process's address space, probed in place."""

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

    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes]:
        try:
            return image_prefix(self._view, keys, self._id, None, self._max_age)
        except ValueError:  # the view was released: the store is closing
            return _UNUSABLE

    def exists(self, keys: Sequence[bytes]) -> bytes:
        try:
            return image_exists(self._view, keys, self._id, None, self._max_age)[1]
        except ValueError:
            return bytes([ImageStop.UNKNOWN]) * len(keys)

    def close(self) -> None:
        if self._owned is not None:
            # A probe still running on another thread keeps it: the GC unmaps it then.
            with contextlib.suppress(BufferError):
                self._owned.close()


class RemoteImage(ImageReader):
    """An image read through a transport client: one batched read per probe."""

    round_trips = 1

    def __init__(
        self, client: TransportClient, endpoint: NodeEndpoint, geometry: ImageGeometry
    ) -> None:
        self._client = client
        self._rkey = endpoint.regions[0].rkey
        self._geometry = geometry

    @classmethod
    def connect(
        cls, client: TransportClient, endpoint: NodeEndpoint, location: ImageLocation
    ) -> RemoteImage | None:
        """Reach the image over ``client`` and check its header (one round trip)."""
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
        if geometry.image_id != location.image_id:
            client.disconnect(IMAGE_NODE)
            return None
        return cls(client, endpoint, geometry)

    def _land(self, keys: Sequence[bytes]) -> tuple[memoryview, bytes] | None:
        ranges, positions = image_windows(keys, self._geometry)
        plan = memoryview(ranges).cast("Q")
        offsets, lengths = plan[0::2].tolist(), plan[1::2].tolist()
        starts = list(itertools.accumulate(lengths, initial=0))
        # Uninitialised: every byte of it is landed before it is read.
        view = np.empty(starts[-1], np.uint8).data
        rkey = self._rkey
        segments = [
            Segment(IMAGE_REGION, rkey, offset, view[start : start + length])
            for offset, length, start in zip(offsets, lengths, starts[:-1], strict=True)
        ]
        try:
            errors = self._client.read(IMAGE_NODE, segments)
        except KvfabricError as exc:
            log.debug("kvfabric: lookup image read failed: %s", exc)
            return None
        if any(error is not None for error in errors):
            return None
        return view, positions

    def prefix(self, keys: Sequence[bytes]) -> tuple[int, int, bytes]:
        landed = self._land(keys)
        if landed is None:
            return _UNUSABLE
        landing, positions = landed
        return image_prefix(landing, keys, self._geometry.image_id, positions, 0.0)

    def exists(self, keys: Sequence[bytes]) -> bytes:
        landed = self._land(keys)
        if landed is None:
            return bytes([ImageStop.UNKNOWN]) * len(keys)
        landing, positions = landed
        return image_exists(landing, keys, self._geometry.image_id, positions, 0.0)[1]

    def close(self) -> None:
        self._client.disconnect(IMAGE_NODE)


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
    endpoints = {e.transport: e for e in location.endpoints}
    for name, client in clients.items():
        endpoint = endpoints.get(name)
        if name == "shm" or endpoint is None or not client.reachable(endpoint):
            continue
        remote = RemoteImage.connect(client, endpoint, location)
        if remote is not None:
            return remote
    return None


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
