"""What every transport inherits from ``kvfabric.spi``: the peer table, segment planning,
the server-side region table, and the error boundary.

The client here is a real ``PeerClient`` whose "node" is memory in this process: it counts
how often the base class calls each primitive, so the table's rules show as exact counts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import crc32c
import pytest

from kvfabric.errors import ProtocolError, TransportError, TransportTimeoutError
from kvfabric.spi import (
    SOCKET_ERRORS,
    Batch,
    NodeEndpoint,
    PeerClient,
    RegionHandle,
    RegionTable,
    Segment,
    SegmentStatus,
    TransportClient,
    TransportConfig,
    map_exceptions,
    plan_batch,
)

_SIZE = 4096
_HANDLE = RegionHandle(region=7, rkey=0xABC, size=_SIZE)


class _Memory:
    """A node's one region, in this process."""

    def __init__(self, endpoint: NodeEndpoint) -> None:
        self.endpoint = endpoint
        self.data = bytearray(_SIZE)
        self.closed = False


class _InProcessClient(PeerClient[_Memory]):
    def __init__(self, failure: BaseException | None = None) -> None:
        super().__init__(TransportConfig(timeout=5.0))
        self.opened: list[NodeEndpoint] = []
        self.closed: list[_Memory] = []
        self.failure = failure
        self.writes: list[list[int]] = []
        """The offsets of each write primitive call's segments, in order."""

    def open_peer(self, endpoint: NodeEndpoint) -> _Memory:
        self.opened.append(endpoint)
        return _Memory(endpoint)

    def close_peer(self, peer: _Memory) -> None:
        peer.closed = True
        self.closed.append(peer)

    def read_segments(self, peer: _Memory, batch: Batch) -> None:
        if self.failure is not None:
            raise self.failure
        for seg in batch.segments:
            seg.buffer[:] = peer.data[seg.offset : seg.offset + seg.buffer.nbytes]

    def write_segments(self, peer: _Memory, batch: Batch) -> None:
        self.writes.append([seg.offset for seg in batch.segments])
        for i, seg in enumerate(batch.segments):
            if seg.offset == 0xBAD:  # the node itself refuses this one
                batch.refuse(i, "the node said no")
                continue
            peer.data[seg.offset : seg.offset + seg.buffer.nbytes] = seg.buffer


class _ChecksummingClient(_InProcessClient):
    """Its primitives hand over CRCs as they move bytes (sentinels: 1000 + span index)."""

    checksums_writes = True

    def read_segments(self, peer: _Memory, batch: Batch) -> None:
        super().read_segments(peer, batch)
        if batch.crc_spans is not None:
            batch.crcs = [1000 + k for k in range(len(batch.crc_spans))]

    def write_segments(self, peer: _Memory, batch: Batch) -> None:
        super().write_segments(peer, batch)
        if batch.crc_spans is not None:
            batch.crcs = [
                crc32c.crc32c(b"".join(s.buffer for s in batch.segments[a:b]))
                for a, b in batch.crc_spans
            ]


class _StreamingClient(_InProcessClient):
    """Its write primitive checksums the payloads as it stores them, then stores the trailer
    ``batch.trailer`` makes from those CRCs, in the same call (as ``tcp`` does)."""

    streams_trailers = True

    def write_segments(self, peer: _Memory, batch: Batch) -> None:
        if batch.trailer is None:
            super().write_segments(peer, batch)
            return
        start = batch.trailer_start
        spans = batch.crc_spans or []
        crcs = [crc32c.crc32c(b"".join(s.buffer for s in batch.segments[a:b])) for a, b in spans]
        buffers = batch.trailer(crcs)
        batch.segments[start:] = [
            Segment(s.region, s.rkey, s.offset, b)
            for s, b in zip(batch.segments[start:], buffers, strict=True)
        ]
        super().write_segments(peer, batch)
        batch.crcs = crcs


def _endpoint(node: int = 1, address: bytes = b"here") -> NodeEndpoint:
    return NodeEndpoint(node=node, transport="inprocess", address=address, regions=(_HANDLE,))


def _segment(offset: int, buf: object) -> Segment:
    return Segment(_HANDLE.region, _HANDLE.rkey, offset, memoryview(buf))  # type: ignore[arg-type]


# -- the peer table ----------------------------------------------------------------------


def test_connecting_again_with_the_same_endpoint_opens_nothing() -> None:
    client = _InProcessClient()
    for _ in range(3):
        client.connect(_endpoint())
    assert len(client.opened) == 1
    assert client.closed == []


def test_a_changed_endpoint_replaces_the_node_and_closes_the_old_state() -> None:
    client = _InProcessClient()
    client.connect(_endpoint(address=b"here"))
    client.write(1, [_segment(0, b"old!")])
    client.connect(_endpoint(address=b"there"))
    assert [e.address for e in client.opened] == [b"here", b"there"]
    assert [m.endpoint.address for m in client.closed] == [b"here"]
    dest = bytearray(4)
    assert client.read(1, [_segment(0, dest)]) == [None]
    assert dest == bytes(4)  # the new node's memory, not the old one's


def test_concurrent_connects_to_one_endpoint_leave_one_peer_and_close_the_rest() -> None:
    client = _InProcessClient()
    start = threading.Barrier(8)

    def connect() -> None:
        start.wait()
        client.connect(_endpoint())

    threads = [threading.Thread(target=connect) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(client.opened) - len(client.closed) == 1
    client.close()
    assert len(client.opened) == len(client.closed)


def test_disconnect_and_close_release_each_peer_once_and_refuse_later_calls() -> None:
    client = _InProcessClient()
    client.connect(_endpoint(1))
    client.connect(_endpoint(2))
    client.disconnect(1)
    client.disconnect(1)
    assert [m.endpoint.node for m in client.closed] == [1]
    with pytest.raises(TransportError, match="not connected to node 1"):
        client.read(1, [_segment(0, bytearray(4))])
    client.close()
    client.close()
    assert [m.endpoint.node for m in client.closed] == [1, 2]
    with pytest.raises(TransportError, match="closed"):
        client.connect(_endpoint(3))


def test_a_refusal_by_the_node_is_reported_for_that_segment_only() -> None:
    client = _InProcessClient()
    client.connect(_endpoint())
    errors = client.write(1, [_segment(0, b"a"), _segment(0xBAD, b"b"), _segment(8, b"c")])
    assert errors[0] is None
    assert errors[2] is None
    assert isinstance(errors[1], TransportError)
    assert "segment 1" in str(errors[1])
    assert "the node said no" in str(errors[1])


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (TimeoutError("timed out"), TransportTimeoutError),
        (ConnectionResetError("reset"), TransportError),
        (TransportTimeoutError("ours already"), TransportTimeoutError),
    ],
)
def test_what_a_primitive_raises_is_mapped_at_the_boundary(
    raised: BaseException, expected: type[TransportError]
) -> None:
    client = _InProcessClient(failure=raised)
    client.connect(_endpoint())
    with pytest.raises(expected) as caught:
        client.read(1, [_segment(0, bytearray(4))])
    assert type(caught.value) is expected
    assert str(raised) in str(caught.value)


def test_a_batch_of_refused_or_empty_segments_never_calls_a_primitive() -> None:
    client = _InProcessClient(failure=AssertionError("a primitive was called"))
    client.connect(_endpoint())
    errors = client.read(1, [_segment(_SIZE, bytearray(1)), _segment(0, bytearray(0))])
    assert isinstance(errors[0], TransportError)
    assert errors[1] is None


# -- planning ------------------------------------------------------------------------------


def test_planning_refuses_each_bad_segment_with_its_reason_and_keeps_the_rest() -> None:
    regions = {_HANDLE.region: _HANDLE}
    writable = bytearray(16)
    segments = [
        _segment(0, writable),
        Segment(99, _HANDLE.rkey, 0, memoryview(writable)),
        Segment(_HANDLE.region, _HANDLE.rkey + 1, 0, memoryview(writable)),
        _segment(_SIZE - 8, writable),
        _segment(-1, writable),
        _segment(0, b"immutable bytes!"),
        _segment(0, memoryview(bytearray(32))[::2]),
        _segment(0, bytearray(0)),
    ]
    batch = plan_batch(3, segments, regions, into_buffers=True, deadline=0.0)
    reasons = [str(e) if e is not None else None for e in batch.errors]
    assert reasons[0] is None
    assert reasons[7] is None
    for i, reason in [
        (1, "unknown region"),
        (2, "bad rkey"),
        (3, "bounds"),
        (4, "bounds"),
        (5, "read-only"),
        (6, "contiguous"),
    ]:
        assert reason in str(reasons[i])
        assert f"segment {i}" in str(reasons[i])
    assert batch.positions == [0]  # the empty one is fine and moves nothing
    assert batch.segments == [segments[0]]  # the caller's own segment, not a copy


def test_planning_a_write_accepts_read_only_sources_and_flattens_shaped_ones() -> None:
    regions = {_HANDLE.region: _HANDLE}
    shaped = memoryview(bytearray(64)).cast("B", (8, 8))
    batch = plan_batch(
        1,
        [_segment(0, b"read-only source"), _segment(64, shaped)],
        regions,
        into_buffers=False,
        deadline=0.0,
    )
    assert batch.errors == [None, None]
    flat = batch.segments[1].buffer
    assert (flat.ndim, flat.format, flat.nbytes) == (1, "B", 64)


def test_planning_maps_crc_spans_onto_the_accepted_segments() -> None:
    regions = {_HANDLE.region: _HANDLE}
    buf = bytearray(8)
    segments = [
        _segment(0, buf),  # 0: a header
        _segment(8, buf),  # 1
        _segment(_SIZE, buf),  # 2: out of bounds, refused
        _segment(16, bytearray(0)),  # 3: empty, moves nothing
        _segment(24, buf),  # 4: a header
        _segment(32, buf),  # 5
    ]
    batch = plan_batch(
        1, segments, regions, into_buffers=True, deadline=0.0, crc_spans=[(1, 4), (4, 4), (5, 6)]
    )
    assert batch.positions == [0, 1, 4, 5]
    assert batch.crc_spans == [(1, 2), (2, 2), (3, 4)]
    assert batch.crcs is None


@pytest.mark.parametrize("spans", [[(1, 3), (2, 4)], [(2, 1)], [(0, 7)], [(-1, 1)]])
def test_crc_spans_out_of_order_overlapping_or_outside_are_refused(
    spans: list[tuple[int, int]],
) -> None:
    segments = [_segment(8 * i, bytearray(8)) for i in range(6)]
    with pytest.raises(ValueError, match="crc span"):
        plan_batch(
            1, segments, {_HANDLE.region: _HANDLE}, into_buffers=True, deadline=0.0, crc_spans=spans
        )


def _records(client: PeerClient[_Memory]) -> tuple[list[Segment], list[bytes]]:
    """Two records written as a reader frames them (header, payload pieces) at 0 and 100."""
    parts = [b"H" * 8, b"one", b"two", b"h" * 8, b"three"]
    offsets = [0, 8, 11, 100, 108]
    client.write(1, [_segment(o, p) for o, p in zip(offsets, parts, strict=True)])
    return [_segment(o, bytearray(len(p))) for o, p in zip(offsets, parts, strict=True)], parts


def test_a_checksummed_read_checksums_what_landed_when_the_primitive_does_not() -> None:
    client = _InProcessClient()
    client.connect(_endpoint())
    reads, parts = _records(client)
    errors, crcs = client.read_checksummed(1, reads, [(1, 3), (4, 5)])
    assert errors == [None] * 5
    assert [bytes(s.buffer) for s in reads] == parts
    assert crcs == [crc32c.crc32c(b"onetwo"), crc32c.crc32c(b"three")]


def test_a_checksummed_read_returns_the_crcs_the_primitive_took_while_landing() -> None:
    client = _ChecksummingClient()
    client.connect(_endpoint())
    reads, parts = _records(client)
    errors, crcs = client.read_checksummed(1, reads, [(1, 3), (4, 5)])
    assert errors == [None] * 5
    assert [bytes(s.buffer) for s in reads] == parts
    assert crcs == [1000, 1001]


def _trailer(crcs: list[int]) -> list[Segment]:
    return [_segment(200 + 4 * i, crc.to_bytes(4, "little")) for i, crc in enumerate(crcs)]


@pytest.mark.parametrize("client_cls", [_InProcessClient, _ChecksummingClient, _StreamingClient])
def test_a_checksummed_write_stores_the_trailer_after_every_payload(
    client_cls: type[_InProcessClient],
) -> None:
    client = client_cls()
    client.connect(_endpoint())
    payloads = [_segment(0, b"abc"), _segment(3, b"de"), _segment(5, b"f"), _segment(0xBAD, b"g")]
    errors, crcs = client.write_checksummed(1, payloads, [(0, 2), (2, 3), (3, 4)], _trailer)
    assert crcs[:2] == [crc32c.crc32c(b"abcde"), crc32c.crc32c(b"f")]
    assert [e is None for e in errors] == [True, True, True, False, True, True, True]
    assert "the node said no" in str(errors[3])
    if client.checksums_writes:
        # The payloads, checksummed as they went, then the trailer in a call of its own.
        assert client.writes == [[0, 3, 5, 0xBAD], [200, 204, 208]]
    else:
        # One call: payloads, then the trailer (made from CRCs taken first, or, streaming,
        # as the payloads went).
        assert client.writes == [[0, 3, 5, 0xBAD, 200, 204, 208]]
    dest = bytearray(8)
    assert client.read(1, [_segment(200, dest)]) == [None]
    assert dest == crcs[0].to_bytes(4, "little") + crcs[1].to_bytes(4, "little")


def test_a_trailer_that_moves_with_its_crcs_is_refused_before_it_is_stored() -> None:
    """A streaming transport plans the trailer from placeholder CRCs: one whose places
    depend on the CRCs would land somewhere unchecked, so it is refused."""
    client = _StreamingClient()
    client.connect(_endpoint())

    def moving(crcs: list[int]) -> list[Segment]:
        return [_segment(200 if crc == 0 else 208, b"head") for crc in crcs]

    with pytest.raises(ValueError, match="must not depend on them"):
        client.write_checksummed(1, [_segment(0, b"payload")], [(0, 1)], moving)
    dest = bytearray(20)
    assert client.read(1, [_segment(200, dest)]) == [None]
    assert dest == bytes(20)


class _BareClient(TransportClient):
    """A transport written against ``TransportClient`` alone: it inherits the checksummed
    variants' defaults."""

    def __init__(self) -> None:
        self.memory = bytearray(_SIZE)
        self.writes: list[int] = []

    def connect(self, endpoint: NodeEndpoint) -> None:
        pass

    def read(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        for seg in segments:
            seg.buffer[:] = self.memory[seg.offset : seg.offset + seg.buffer.nbytes]
        return [None] * len(segments)

    def write(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        self.writes.append(len(segments))
        for seg in segments:
            self.memory[seg.offset : seg.offset + seg.buffer.nbytes] = seg.buffer
        return [None] * len(segments)

    def close(self) -> None:
        pass


def test_a_transport_without_peer_client_gets_checksummed_reads_and_writes() -> None:
    client = _BareClient()
    payloads = [_segment(8, b"hello "), _segment(14, b"world")]
    errors, crcs = client.write_checksummed(1, payloads, [(0, 2)], _trailer)
    assert errors == [None] * 3
    assert crcs == [crc32c.crc32c(b"hello world")]
    assert client.writes == [3]  # payloads and trailer in one call
    assert client.memory[200:204] == crcs[0].to_bytes(4, "little")
    dests = [_segment(8, bytearray(6)), _segment(14, bytearray(5))]
    errors, crcs = client.read_checksummed(1, dests, [(0, 1), (1, 2)])
    assert errors == [None, None]
    assert crcs == [crc32c.crc32c(b"hello "), crc32c.crc32c(b"world")]


# -- the server side ----------------------------------------------------------------------


def test_the_region_table_answers_what_the_client_checks() -> None:
    table = RegionTable()
    memory = memoryview(bytearray(_SIZE))
    table.add(_HANDLE, memory)
    statuses, views = table.check_all(
        [
            (7, 0xABC, 100, 10),
            (8, 0xABC, 0, 1),
            (7, 0xABD, 0, 1),
            (7, 0xABC, _SIZE - 1, 2),
        ]
    )
    assert list(statuses) == [
        SegmentStatus.OK,
        SegmentStatus.UNKNOWN_REGION,
        SegmentStatus.BAD_RKEY,
        SegmentStatus.OUT_OF_BOUNDS,
    ]
    assert views[0] is not None
    assert views[0].nbytes == 10
    assert views[1:] == [None, None, None]
    with pytest.raises(ValueError, match="memory has"):
        table.add(RegionHandle(region=9, rkey=1, size=_SIZE + 1), memory)


# -- the error boundary --------------------------------------------------------------------


def test_map_exceptions_maps_in_order_and_passes_ours_and_unmapped_through() -> None:
    mapping = {**SOCKET_ERRORS, ProtocolError: TransportError}
    with (
        pytest.raises(TransportTimeoutError, match="where: timed out") as caught,
        map_exceptions(mapping, where="where"),
    ):
        raise TimeoutError("timed out")
    assert isinstance(caught.value.__cause__, TimeoutError)
    with pytest.raises(TransportError, match="bad frame"), map_exceptions(mapping):
        raise ProtocolError("bad frame")
    original = TransportError("already ours")
    with pytest.raises(TransportError) as passed, map_exceptions(mapping, where="where"):
        raise original
    assert passed.value is original
    with pytest.raises(KeyError), map_exceptions(mapping):
        raise KeyError("not mapped")
