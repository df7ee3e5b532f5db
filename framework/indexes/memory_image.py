"""The memory index's lookup image: its published entries, as a table clients read one-sided.

The index keeps one from the start (unless its size is 0), served or not: it calls
:meth:`MemoryImage.show` for every entry it publishes (and whenever an entry's copies change)
and :meth:`MemoryImage.hide` for every entry that leaves, under its own lock, so there is one
writer, and answers lookups that reach it from the image too (:meth:`MemoryImage.prefix`,
which also stamps each hit's use in memory of the index's own, :meth:`MemoryImage.last_use`).
The format is :mod:`kvfabric._runtime.image`'s; this module owns the memory and where each
key sits: an entry's copy read first under its key, each other copy under an alternate key.

The memory is a memfd, like the ``dram`` backend's regions: a client on the same host maps
it read-only, and the controller registers it with its transport servers like a region.
Its pages, and those of the index's use stamps, are faulted in when it is made, as a data
node's regions are: a fresh shared page traps on its first write, and a publish writes one
bucket a key at random places, so without it a fresh index's first puts would pay a trap
per key.
Keys never move: a key goes into the first free bucket of its window and stays there until
it leaves (readers rely on it, see the format). A key whose window is full is *spilled*:
not in the image, counted in its home bucket, so lookups of that home ask the index.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Sequence

import attrs

from kvfabric._runtime.buffers import prefault_all
from kvfabric._runtime.image import (
    IMAGE_HEADER_SIZE,
    IMAGE_REGION,
    ImageGeometry,
    ImageStop,
    alternate_key,
    image_beat,
    image_exists,
    image_prefix,
    image_store,
)
from kvfabric._runtime.step_log import StepLog
from kvfabric.descriptor import Descriptor
from kvfabric.spi import MemoryKind, Region, format_size, new_rkey

__all__ = ["MemoryImage", "NoImage"]

log = logging.getLogger(__name__)

# Past this share of entries spilled, lookups fall back to RPC often enough to say so.
_SPILL_WARNING = 0.01


class MemoryImage:
    """One image and the bookkeeping of where each key sits; not thread-safe (the index's
    lock guards it)."""

    def __init__(self, size: int, *, replicas: int = 1) -> None:
        """``size``: bytes at most (rounded down to a power-of-two bucket count).
        ``replicas``: copies the index keeps of each value (all but the first go under
        alternate keys)."""
        self._replicas = replicas
        self.geometry = ImageGeometry.fitting(secrets.randbits(63) | 1, size)
        total = self.geometry.size
        self._fd = os.memfd_create("kvfabric-lookup-image", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, total)
            self._mapping = mmap.mmap(
                self._fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(self._fd)
            raise
        self._view = memoryview(self._mapping)
        header = self.geometry.header()
        self._view[: len(header)] = header
        image_beat(self._view)
        self.region = Region(
            id=IMAGE_REGION,
            size=total,
            rkey=new_rkey(),
            kind=MemoryKind.DRAM,
            view=self._view,
            path=f"/proc/{os.getpid()}/fd/{self._fd}",
        )
        window = self.geometry.window
        self._window = window
        # One byte per bucket: bytearray.find looks for a free one in C.
        self._used = bytearray(self.geometry.buckets + window - 1)
        # When the index's own probes last hit each bucket (its clock's seconds; 0: not since
        # the bucket's key came in): how lookups tell the index what they used.
        self._stamp_pages = mmap.mmap(-1, 8 * len(self._used))
        self._stamps = memoryview(self._stamp_pages).cast("d")
        views = [self._view, memoryview(self._stamp_pages)]
        size = sum(v.nbytes for v in views)
        with StepLog(log, f"preparing the lookup image ({format_size(size)})", total=size) as step:
            self.prefault_seconds = prefault_all(views, progress=step.advance)
        self._where: dict[bytes, int] = {}
        self._spilled: dict[bytes, int] = {}
        """Keys with no room in their window -> their home."""
        self._overflow: dict[int, int] = {}
        """Home -> how many of its keys are spilled."""
        self._warned = False

    def put(self, descriptor: Descriptor) -> None:
        """The key is published with this descriptor."""
        key = descriptor.key
        if key in self._where or key in self._spilled:
            self.remove(key)
        home = int.from_bytes(key[:8], "little") & (self.geometry.buckets - 1)
        slot = self._used.find(0, home, home + self._window)
        if slot < 0:
            self._spilled[key] = home
            count = self._overflow[home] = self._overflow.get(home, 0) + 1
            image_store(self._view, home, None, count)
            self._warn_if_crowded()
            return
        self._used[slot] = 1
        self._where[key] = slot
        self._stamps[slot] = 0.0
        image_store(self._view, slot, descriptor.to_bytes(), -1)

    def show(self, key: bytes, first: Descriptor, alternates: Sequence[Descriptor]) -> None:
        """A published entry, or its copies changed: the copy read first goes under its key,
        each other copy under :func:`~kvfabric._runtime.image.alternate_key` (those it no
        longer has come out)."""
        self.put(first)
        if self._replicas == 1:
            return
        for n in range(1, self._replicas):
            if n <= len(alternates):
                self.put(attrs.evolve(alternates[n - 1], key=alternate_key(key, n)))
            else:
                self.remove(alternate_key(key, n))

    def hide(self, key: bytes) -> None:
        """The entry left: its key and its alternates come out."""
        self.remove(key)
        if self._replicas == 1:
            return
        for n in range(1, self._replicas):
            self.remove(alternate_key(key, n))

    def remove(self, key: bytes) -> None:
        """The key is no longer published (a no-op for a key the image does not hold)."""
        slot = self._where.pop(key, None)
        if slot is not None:
            self._used[slot] = 0
            image_store(self._view, slot, b"", -1)
            return
        home = self._spilled.pop(key, None)
        if home is not None:
            count = self._overflow.pop(home) - 1
            if count:
                self._overflow[home] = count
            image_store(self._view, home, None, count)

    def prefix(self, keys: Sequence[bytes], now: float) -> tuple[int, int, bytes]:
        """The owner's own prefix probe, as :func:`~kvfabric._runtime.image.image_prefix` answers:
        ``(hits, stop, wires)``; each hit's use is stamped ``now`` (see :meth:`last_use`).
        Called under the index's lock, so no bucket is being written and neither the CRCs
        nor the heartbeat need checking."""
        return image_prefix(
            self._view,
            keys,
            self.geometry.image_id,
            0.0,
            checksums=False,
            stamps=self._stamps,
            now=now,
        )

    def exists(self, keys: Sequence[bytes], used_at: float | None = None) -> bytes:
        """Each key's :class:`~kvfabric._runtime.image.ImageStop` state (under the index's lock);
        with ``used_at``, each hit's use is stamped then."""
        return image_exists(
            self._view,
            keys,
            self.geometry.image_id,
            0.0,
            checksums=False,
            stamps=None if used_at is None else self._stamps,
            now=used_at or 0.0,
        )[1]

    def last_use(self, key: bytes) -> float:
        """When a probe of the index last hit ``key`` (0.0: none since it came in, or it is
        not in the image)."""
        slot = self._where.get(key)
        return 0.0 if slot is None else self._stamps[slot]

    def _warn_if_crowded(self) -> None:
        spilled, total = len(self._spilled), len(self._spilled) + len(self._where)
        if self._warned or total < 1000 or spilled < total * _SPILL_WARNING:
            return
        self._warned = True
        log.warning(
            "the lookup image holds %d entries in %d buckets and %d found no room: lookups "
            "of those go by RPC; a larger image (--index-opt memory.image=SIZE, about 256 "
            "bytes per entry) keeps them one-sided",
            total,
            self.geometry.buckets,
            spilled,
        )

    def beat(self) -> None:
        """Tell same-host readers the owner is alive (called every controller tick)."""
        image_beat(self._view)

    def set_nodes_generation(self, generation: int) -> None:
        """Say the data nodes changed. The heartbeat and the ring's head (bytes 24..40)
        are left as they are; a reader that reads the header while it changes finds its
        check wrong and asks the index, once."""
        header = ImageGeometry.with_nodes_generation(self._view[:IMAGE_HEADER_SIZE], generation)
        self._view[56:IMAGE_HEADER_SIZE] = header[56:]

    def stats(self) -> dict[str, int]:
        return {
            "image_entries": len(self._where),
            "image_spilled": len(self._spilled),
            "image_buckets": self.geometry.buckets,
            "image_prefault_ms": round(self.prefault_seconds * 1000),
        }

    def close(self) -> None:
        """Mark the image closed (readers stop trusting it at once) and release it.

        A reader on this host that still maps it keeps its pages alive, but sees it closed.
        """
        image_beat(self._view, False)
        with contextlib.suppress(BufferError):
            self._view.release()
            self._mapping.close()
        with contextlib.suppress(BufferError):
            self._stamps.release()
            self._stamp_pages.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class NoImage:
    """What an index keeping no image holds (size 0, or closed): it stores nothing and
    answers no probe, so the index answers every key itself."""

    def prefix(self, keys: Sequence[bytes], now: float) -> tuple[int, int, bytes]:
        return 0, ImageStop.UNUSABLE, b""

    def exists(self, keys: Sequence[bytes], used_at: float | None = None) -> bytes:
        return bytes([ImageStop.UNKNOWN]) * len(keys)

    def last_use(self, key: bytes) -> float:
        return 0.0

    def put(self, descriptor: Descriptor) -> None:
        pass

    def show(self, key: bytes, first: Descriptor, alternates: Sequence[Descriptor]) -> None:
        pass

    def hide(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        pass

    def beat(self) -> None:
        pass

    def set_nodes_generation(self, generation: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
