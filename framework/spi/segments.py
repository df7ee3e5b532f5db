"""The checks a segment passes before any byte moves, on either side of a transport.

One set of rules, applied once per segment: the region is known, the rkey matches, the
bytes lie inside the region, and the caller's buffer is flat (C-contiguous) and, for a
read, writable. A client plans each batch with :func:`plan_batch` before its transport's
primitives run; a server that checks requests itself (``tcp``) looks them up in a
:class:`RegionTable`, which applies the same region rules and answers with a
:class:`SegmentStatus` its wire protocol can carry. A refused segment moves no bytes; the
rest of its batch still does.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvfabric._runtime.native import crc32c_many
from kvfabric.errors import TransportError
from kvfabric.spi.transport import RegionHandle, Segment

__all__ = ["Batch", "RegionTable", "SegmentStatus", "plan_batch", "segment_status"]


class SegmentStatus(enum.IntEnum):
    """Whether a region accepts a segment; the values are wire-stable (``tcp`` sends them)."""

    OK = 0
    UNKNOWN_REGION = 1
    BAD_RKEY = 2
    OUT_OF_BOUNDS = 3
    READ_ONLY = 4

    def describe(self) -> str:
        return _STATUS_TEXT[self]


_STATUS_TEXT = {
    SegmentStatus.OK: "accepted",
    SegmentStatus.UNKNOWN_REGION: "unknown region",
    SegmentStatus.BAD_RKEY: "bad rkey",
    SegmentStatus.OUT_OF_BOUNDS: "out of the region's bounds",
    SegmentStatus.READ_ONLY: "a write to a read-only region",
}
# Module constants: looked up once per segment, where an enum attribute costs more.
_OK = SegmentStatus.OK
_UNKNOWN_REGION = SegmentStatus.UNKNOWN_REGION
_BAD_RKEY = SegmentStatus.BAD_RKEY
_OUT_OF_BOUNDS = SegmentStatus.OUT_OF_BOUNDS
_READ_ONLY_REGION = SegmentStatus.READ_ONLY


def segment_status(
    handle: RegionHandle | None, rkey: int, offset: int, length: int
) -> SegmentStatus:
    """The region rules: ``handle`` is the region the segment names (None: unknown)."""
    if handle is None:
        return _UNKNOWN_REGION
    if rkey != handle.rkey:
        return _BAD_RKEY
    if offset < 0 or length < 0 or offset + length > handle.size:
        return _OUT_OF_BOUNDS
    return _OK


class Batch:
    """One call's segments for one node, planned: what a transport's primitives move.

    ``segments`` are the accepted, non-empty ones, in the caller's order, each with a flat
    ``'B'`` buffer (the caller's memory, never a copy). ``errors`` has one entry per segment
    the caller passed: ``None`` unless planning refused it or a primitive calls
    :meth:`refuse`. ``deadline`` (``time.monotonic()``) bounds the whole call.

    ``crc_spans``: when the caller asked for checksums, ``(start, stop)`` ranges of
    ``segments`` (in order, not overlapping; an empty range is an empty payload) whose
    bytes make one CRC32C each, one per range the caller passed. A primitive that can
    checksum while it moves bytes (``native.copy_many``, ``native.recv_into_all`` with
    ``crc_spans``) sets ``crcs``, one per span: for a read, of the bytes as they landed;
    for a write, of the source bytes it stored. Otherwise ``crcs`` stays None and
    :meth:`checksum` computes them in one native call.

    ``trailer`` (a checksummed write to a transport that ``streams_trailers``): the
    segments from ``trailer_start`` on are the records' headers, planned with placeholder
    contents; ``trailer(crcs)`` gives their real buffers, in the same order and sizes, once
    the spans' CRCs are known. The primitive sends the payloads, checksumming them as they
    go, then those buffers, and sets ``crcs``.
    """

    __slots__ = (
        "crc_spans",
        "crcs",
        "deadline",
        "errors",
        "node",
        "positions",
        "segments",
        "trailer",
        "trailer_start",
    )

    def __init__(
        self,
        node: int,
        segments: list[Segment],
        positions: list[int],
        errors: list[TransportError | None],
        deadline: float,
        crc_spans: list[tuple[int, int]] | None = None,
    ) -> None:
        self.node = node
        self.segments = segments
        self.positions = positions
        self.errors = errors
        self.deadline = deadline
        self.crc_spans = crc_spans
        self.crcs: list[int] | None = None
        self.trailer: Callable[[list[int]], list[memoryview]] | None = None
        self.trailer_start = len(segments)

    def checksum(self) -> list[int]:
        """The CRC32C of each span's buffers as they are now: one native call, one release
        of the GIL for the whole batch ([] without spans)."""
        spans = self.crc_spans
        if not spans:
            return []
        segs = self.segments
        return crc32c_many([[segs[i].buffer for i in range(a, b)] for a, b in spans])

    def refuse(self, index: int, reason: str) -> None:
        """Record that the node refused ``segments[index]`` (e.g. a status in its reply)."""
        position = self.positions[index]
        self.errors[position] = TransportError(
            f"node {self.node} refused segment {position} ({self.segments[index]!r}): {reason}"
        )


def plan_batch(
    node: int,
    segments: Sequence[Segment],
    regions: Mapping[int, RegionHandle],
    *,
    into_buffers: bool,
    deadline: float,
    crc_spans: Sequence[tuple[int, int]] | None = None,
) -> Batch:
    """Check every segment before anything moves; ``into_buffers``: a read (buffers written).

    A refused segment gets a :class:`~kvfabric.errors.TransportError` saying why: unknown
    region, bad rkey, out of bounds, a non-contiguous buffer, or a read into a read-only one
    (which would otherwise overwrite an immutable object such as ``bytes``).

    ``crc_spans``: ``(start, stop)`` ranges of ``segments`` (the caller's indices, in order,
    not overlapping) whose bytes make one CRC32C each; they become the batch's
    ``crc_spans``, ranges of its accepted segments. A refused segment drops out of its span
    (whose CRC the caller then ignores: the segment has an error) and an empty one adds
    nothing to it.
    """
    accepted: list[Segment] = []
    positions: list[int] = []
    errors: list[TransportError | None] = [None] * len(segments)
    for i, seg in enumerate(segments):
        buf = seg.buffer
        if buf.ndim != 1 or buf.format != "B" or not buf.c_contiguous:
            flat = _flat(buf)
            if flat is None:
                errors[i] = _refused(node, i, seg, _NOT_FLAT)
                continue
            seg = Segment(seg.region, seg.rkey, seg.offset, flat)
            buf = flat
        if into_buffers and buf.readonly:
            errors[i] = _refused(node, i, seg, _READ_ONLY)
            continue
        # segment_status's rules, inlined: this loop runs once per segment of every batch.
        length = buf.nbytes
        handle = regions.get(seg.region)
        offset = seg.offset
        if handle is None or seg.rkey != handle.rkey or offset < 0 or offset + length > handle.size:
            status = segment_status(handle, seg.rkey, offset, length)
            errors[i] = _refused(node, i, seg, status.describe())
        elif length:
            accepted.append(seg)
            positions.append(i)
    spans = None if crc_spans is None else _accepted_spans(crc_spans, positions, len(segments))
    return Batch(node, accepted, positions, errors, deadline, spans)


def _accepted_spans(
    spans: Sequence[tuple[int, int]], positions: list[int], count: int
) -> list[tuple[int, int]]:
    """Caller-index spans as ranges of the accepted segments (``positions`` is sorted)."""
    previous = 0
    for start, stop in spans:
        if not previous <= start <= stop <= count:
            raise ValueError(
                f"crc span ({start}, {stop}) of {count} segments: spans must be in order, "
                "not overlap and lie within the segments"
            )
        previous = stop
    if len(positions) == count:  # every segment accepted: the indices are the same
        return [(start, stop) for start, stop in spans]
    left = bisect.bisect_left
    return [(left(positions, start), left(positions, stop)) for start, stop in spans]


_NOT_FLAT = "the buffer is not C-contiguous; pass a contiguous buffer (or one per piece)"
_READ_ONLY = (
    "the destination buffer is read-only (bytes, or a read-only view); "
    "reads need a writable buffer (bytearray, numpy array, mmap, ...)"
)


def _flat(buf: memoryview) -> memoryview | None:
    """A flat byte view of the same memory, or None when there is none."""
    if not buf.c_contiguous:
        return None
    try:
        return buf.cast("B")
    except TypeError:
        return None


def _refused(node: int, index: int, seg: Segment, reason: str) -> TransportError:
    return TransportError(f"node {node}: segment {index} ({seg!r}) refused: {reason}")


class RegionTable:
    """The regions a server exposes, for servers that check each request themselves.

    Filled by ``register`` before clients learn the regions; lookups take no lock (a dict
    read is atomic), so the serving threads never contend on it.
    """

    def __init__(self) -> None:
        self._regions: dict[int, tuple[RegionHandle, memoryview]] = {}

    def add(self, handle: RegionHandle, memory: memoryview) -> None:
        """Expose ``memory`` (a flat view of at least ``handle.size`` bytes) as the region."""
        if memory.nbytes < handle.size:
            raise ValueError(
                f"region {handle.region} is {handle.size} bytes; its memory has {memory.nbytes}"
            )
        self._regions[handle.region] = (handle, memory)

    def check(
        self, region: int, rkey: int, offset: int, length: int, *, write: bool = False
    ) -> tuple[SegmentStatus, memoryview | None]:
        """The segment's status, and the region memory it may touch when accepted; a
        ``write`` into memory exposed read-only (a lookup image's server) is refused."""
        entry = self._regions.get(region)
        if entry is None:
            return _UNKNOWN_REGION, None
        handle, memory = entry
        status = segment_status(handle, rkey, offset, length)
        if status is not _OK:
            return status, None
        if write and memory.readonly:
            return _READ_ONLY_REGION, None
        return status, memory[offset : offset + length]

    def check_all(
        self, entries: Iterable[tuple[int, int, int, int]]
    ) -> tuple[bytearray, list[memoryview | None]]:
        """For ``(region, rkey, offset, length)`` entries: a status byte each, and the memory
        each accepted one may touch (None where refused)."""
        statuses = bytearray()
        views: list[memoryview | None] = []
        check = self.check
        for region, rkey, offset, length in entries:
            status, view = check(region, rkey, offset, length)
            statuses.append(status)
            views.append(view)
        return statuses, views

    def clear(self) -> None:
        self._regions.clear()
