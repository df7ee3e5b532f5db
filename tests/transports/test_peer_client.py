"""What every transport inherits from ``kvfabric.spi``: the peer table, segment planning,
the server-side region table, and the error boundary.

The client here is a real ``PeerClient`` whose "node" is memory in this process: it counts
how often the base class calls each primitive, so the table's rules show as exact counts.
"""

from __future__ import annotations

import threading

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
        for i, seg in enumerate(batch.segments):
            if seg.offset == 0xBAD:  # the node itself refuses this one
                batch.refuse(i, "the node said no")
                continue
            peer.data[seg.offset : seg.offset + seg.buffer.nbytes] = seg.buffer


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
