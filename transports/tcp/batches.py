"""How a ``tcp`` client moves a planned batch: cut into frames, or into lanes, and sent.

A batch of more than ``MAX_COUNT`` segments goes as several frames on one connection, cut
between CRC spans so each span's CRC comes from the frame that lands it. A read of at least
:data:`READ_LANE_MIN` bytes goes as one frame per lane (``tcp.read_lanes``) on as many
connections at once, in one native call (``request_reply_lanes``). A checksummed write
sends its payloads checksummed as they go and the records' headers, made from those CRCs,
after them in the same frame.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from kvfabric.spi import Batch, Segment, SegmentStatus
from kvfabric.transports.tcp.connection import Connection, Frame, check_reply, reply_statuses
from kvfabric.transports.tcp.pool import Peer, on_connection, on_connections
from kvfabric.transports.tcp.stream import PeerClosed, exchange_lanes
from kvfabric.transports.tcp.wire import HEADER, MAGIC, MAX_COUNT, Op

__all__ = ["READ_LANE_MIN", "frame_bounds", "lane_cuts", "move"]

_OK = SegmentStatus.OK

READ_LANE_MIN = 8 << 20
"""A read of this many bytes or more to one node moves over ``tcp.read_lanes`` connections
at once; a smaller one goes as one frame on one connection (a lane's thread and connection
cost more than they save on a small read: the same floor as ``write_lanes``)."""


def move(peer: Peer, op: Op, batch: Batch) -> None:
    """Move a planned batch, in frames of at most ``MAX_COUNT`` segments.

    A read with ``crc_spans`` gets each span's CRC from the frame that lands it (frames
    are cut between spans); where a span is longer than a frame, the batch's CRCs are
    left to PeerClient (one more native call).
    """
    segments = batch.segments
    if op == Op.WRITE and batch.trailer is not None:
        _write_with_trailer(peer, batch)
        return
    spans = batch.crc_spans if op == Op.READ else None
    if op == Op.READ and peer.link.read_lanes > 1 and peer.link.tls is None:
        cuts = lane_cuts(segments, spans, peer.link.read_lanes)
        if cuts is not None:
            _read_in_lanes(peer, batch, cuts)
            return
    bounds, framed = frame_bounds(len(segments), spans)
    frames = []
    for (start, stop), frame_spans in zip(bounds, framed, strict=True):
        frames.append(Frame(segments[start:stop], frame_spans))
    statuses, crcs = _exchange(peer, op, frames, batch.deadline)
    if spans is not None and framed[0] is not None:
        batch.crcs = crcs
    _refuse(batch, statuses)


def lane_cuts(
    segments: Sequence[Segment], spans: list[tuple[int, int]] | None, lanes: int
) -> list[int] | None:
    """Where a read splits into up to ``lanes`` lanes of about equal bytes: each lane's
    first segment after the first's, never inside a span (each span's CRC comes from one
    lane). None for a read under ``READ_LANE_MIN`` bytes, one no cut splits, or one whose
    lanes would not each fit one frame."""
    sizes = [seg.buffer.nbytes for seg in segments]
    total = sum(sizes)
    if total < READ_LANE_MIN or len(sizes) < 2:
        return None
    starts = [a for a, _ in spans] if spans else []
    cuts: list[int] = []
    done = 0
    for cut, size in enumerate(sizes[:-1], start=1):
        done += size
        if len(cuts) == lanes - 1 or done * lanes < total * (len(cuts) + 1):
            continue
        k = bisect.bisect_right(starts, cut) - 1
        if spans and k >= 0 and starts[k] < cut < spans[k][1]:
            continue  # inside a span: the next cut
        cuts.append(cut)
    bounds = [0, *cuts, len(sizes)]
    if not cuts or any(b - a > MAX_COUNT for a, b in itertools.pairwise(bounds)):
        return None
    return cuts


def _read_in_lanes(peer: Peer, batch: Batch, cuts: list[int]) -> None:
    """A large read as one frame per lane, at once, each on a connection of its own: the
    segments up to the first cut on the first, and so on; one native call."""
    segments, spans = batch.segments, batch.crc_spans
    bounds = [0, *cuts, len(segments)]
    framed: list[list[tuple[int, int]]] = [[] for _ in range(len(cuts) + 1)]
    owner = 0  # the lane of the span at hand
    for start, stop in spans or ():
        while stop > bounds[owner + 1]:
            owner += 1  # spans are in order, and none crosses a cut
        framed[owner].append((start - bounds[owner], stop - bounds[owner]))
    frames = [
        Frame(segments[a:b], None if spans is None else framed[i])
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]

    def run(conns: list[Connection]) -> tuple[bytes, list[int]]:
        prepared = [conn.read_lane(f) for conn, f in zip(conns, frames, strict=True)]
        try:
            crcs = exchange_lanes([lane for lane, _ in prepared], batch.deadline)
        except PeerClosed:
            # A node's error reply is a bare header, then it closes: read what it says.
            for lane, rid in prepared:
                if HEADER.unpack_from(lane.reply)[0] == MAGIC:
                    check_reply(lane.reply, Op.READ, rid, len(lane.payloads))
            raise
        statuses = b"".join(
            reply_statuses(lane.reply, Op.READ, rid, len(lane.payloads)) for lane, rid in prepared
        )
        return statuses, [crc for lane_crcs in crcs for crc in lane_crcs]

    statuses, crcs = on_connections(peer, len(frames), run, batch.deadline)
    if spans is not None:
        batch.crcs = crcs
    _refuse(batch, statuses)


def _write_with_trailer(peer: Peer, batch: Batch) -> None:
    """A checksummed write: in one frame, the payloads checksummed as they are sent; in
    several (more than ``MAX_COUNT`` segments), the CRCs first and the trailer filled in."""
    trailer = batch.trailer
    assert trailer is not None
    segments = batch.segments
    start = batch.trailer_start
    if len(segments) <= MAX_COUNT:
        frame = Frame(segments, batch.crc_spans, trailer, start)
        statuses, crcs = _exchange(peer, Op.WRITE, [frame], batch.deadline)
    else:
        crcs = batch.checksum()
        tail = [
            Segment(seg.region, seg.rkey, seg.offset, buffer)
            for seg, buffer in zip(segments[start:], trailer(crcs), strict=True)
        ]
        whole = [*segments[:start], *tail]
        bounds, _ = frame_bounds(len(whole), None)
        frames = [Frame(whole[a:b], None) for a, b in bounds]
        statuses, _ = _exchange(peer, Op.WRITE, frames, batch.deadline)
    batch.crcs = crcs
    _refuse(batch, statuses)


def _refuse(batch: Batch, statuses: bytes) -> None:
    if statuses.count(_OK) != len(statuses):
        for i, status in enumerate(statuses):
            if status != _OK:
                batch.refuse(i, SegmentStatus(status).describe())


def frame_bounds(
    count: int, spans: list[tuple[int, int]] | None
) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]] | None]]:
    """Where frames start and stop, and each frame's spans (None: no CRCs to take).

    A frame holds at most ``MAX_COUNT`` segments and ends where a span starts rather than
    inside one, so every span lies in one frame; a span too long for any frame drops the
    CRCs of the whole batch (None for every frame).
    """
    if count <= MAX_COUNT:
        return [(0, count)], [spans]
    starts = [a for a, _ in spans] if spans else []
    bounds: list[tuple[int, int]] = []
    whole = spans is not None
    start = 0
    while start < count:
        stop = min(start + MAX_COUNT, count)
        if spans and stop < count:
            k = bisect.bisect_right(starts, stop) - 1
            if k >= 0 and starts[k] < stop < spans[k][1]:
                if starts[k] > start:
                    stop = starts[k]
                else:
                    whole = False
        bounds.append((start, stop))
        start = stop
    if not whole or spans is None:
        return bounds, [None] * len(bounds)
    framed: list[list[tuple[int, int]] | None] = []
    k = 0
    for start, stop in bounds:
        mine: list[tuple[int, int]] = []
        while k < len(spans) and spans[k][1] <= stop:
            a, b = spans[k]
            mine.append((a - start, b - start))
            k += 1
        framed.append(mine)
    return bounds, framed


def _exchange(peer: Peer, op: Op, frames: list[Frame], deadline: float) -> tuple[bytes, list[int]]:
    """Send every frame and collect the status tables, on a pooled or fresh connection."""

    def run(conn: Connection) -> tuple[bytes, list[int]]:
        statuses: list[bytes] = []
        crcs: list[int] = []
        for frame in frames:
            frame_statuses, frame_crcs = conn.exchange(op, frame, deadline)
            statuses.append(frame_statuses)
            crcs += frame_crcs
        return b"".join(statuses), crcs

    return on_connection(peer, run, deadline)
