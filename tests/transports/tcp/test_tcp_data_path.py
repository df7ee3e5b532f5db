"""The data path over ``tcp`` as a store drives it: the GIL taken back a bounded number of
times per batch, each read's CRCs taken as its bytes land, and replies no real node sends
(error codes, unknown statuses, answers to another request, silence) handled as refusals,
protocol errors and timeouts.

GIL returns are counted by ``kvfabric._runtime.native`` in the calling thread (a plain tcp
frame is one native call: the request, its reply and a read's payloads). Nodes run as real
processes on 127.0.0.1 (``RegionServer``), or in this process where a test scripts their
replies (``ScriptedNode``). Timings are printed, never asserted.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from tcp_raw import ENTRY, HEADER, PATIENT, Answer, ScriptedNode, frame

import kvfabric
from kvfabric import Store, chain_keys
from kvfabric._client.record_io import LANE_MIN_BYTES
from kvfabric._runtime import native
from kvfabric._runtime.native import crc32c_many
from kvfabric.errors import TransportError, TransportTimeoutError
from kvfabric.spi import NodeEndpoint, RegionHandle, Segment, TransportClient
from kvfabric.testing import BusyThread, RegionServer, open_client, segment_for
from kvfabric.transports.tcp.wire import MAX_COUNT, Code, Op

_MIB = 1 << 20
_COUNT = 64
_SIZE = 4 * _MIB


@pytest.fixture(scope="module")
def big_server() -> Iterator[RegionServer]:
    """A node process with room for 64 x 4 MiB (four 64 MiB regions)."""
    server = RegionServer("tcp", capacity=256 * _MIB, region_size=64 * _MIB)
    yield server
    server.close()


@pytest.fixture
def client(big_server: RegionServer) -> Iterator[TransportClient]:
    # The timeout bounds a hang, not the machine's speed. One lane, whatever the host's
    # CPUs: these tests count one connection's frames (lanes have tests of their own).
    client = open_client("tcp", big_server.endpoint, timeout=60.0, options={"read_lanes": "1"})
    # Warm: the pooled connection's handshake (two waits for the node) is paid here.
    assert client.read(1, [segment_for(big_server.endpoint, 0, 0, bytearray(8))]) == [None]
    yield client
    client.close()


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [os.urandom(_SIZE) for _ in range(_COUNT)]


def _place(endpoint: NodeEndpoint, i: int, buf: Any) -> Segment:
    """Chunk ``i`` of 4 MiB: 16 to a 64 MiB region."""
    return segment_for(endpoint, i // 16, (i % 16) * _SIZE, buf)


def _returns(fn: Callable[[], Any]) -> tuple[Any, int, float]:
    """``fn()``'s result, the GIL returns it took (native count), and its seconds."""
    before = native.gil_reacquisitions()
    started = time.perf_counter()
    result = fn()
    return result, native.gil_reacquisitions() - before, time.perf_counter() - started


# -- the GIL ------------------------------------------------------------------------------


def test_a_64_by_4mib_write_and_checksummed_read_take_the_gil_back_once_each(
    big_server: RegionServer, client: TransportClient, blobs: list[bytes]
) -> None:
    endpoint = big_server.endpoint
    writes = [_place(endpoint, i, b) for i, b in enumerate(blobs)]
    errors, write_returns, write_s = _returns(lambda: client.write(1, writes))
    assert errors == [None] * _COUNT
    dests = [bytearray(_SIZE) for _ in range(_COUNT)]
    reads = [_place(endpoint, i, d) for i, d in enumerate(dests)]
    spans = [(i, i + 1) for i in range(_COUNT)]
    (errors, crcs), read_returns, read_s = _returns(
        lambda: client.read_checksummed(1, reads, spans)
    )
    batch = _COUNT * _SIZE
    print(
        f"\nwrite {batch / write_s / 1e9:.2f} GB/s, read {batch / read_s / 1e9:.2f} GB/s; "
        f"GIL returns: write {write_returns}, read {read_returns}"
    )
    # One frame each: the request, the reply and the read's payloads with their CRCs in
    # one native call.
    assert (write_returns, read_returns) == (1, 1)
    assert errors == [None] * _COUNT
    assert dests == [bytearray(b) for b in blobs]
    assert crcs == crc32c_many(blobs)  # taken as the bytes landed: no second pass


def test_a_checksummed_write_takes_the_gil_back_at_most_twice_and_stores_the_trailer_last(
    big_server: RegionServer, client: TransportClient, blobs: list[bytes]
) -> None:
    """One frame holding payloads and trailer, in two native calls: the payloads, each
    checksummed as it is sent, then the trailer made from those CRCs and the reply."""
    endpoint = big_server.endpoint
    writes = [_place(endpoint, i, b) for i, b in enumerate(blobs)]
    spans = [(i, i + 1) for i in range(_COUNT)]
    trailer_at = (3, 63 * _MIB)

    def trailer(crcs: list[int]) -> list[Segment]:
        packed = b"".join(c.to_bytes(4, "little") for c in crcs)
        return [segment_for(endpoint, trailer_at[0], trailer_at[1], packed)]

    (errors, crcs), returns, _ = _returns(
        lambda: client.write_checksummed(1, writes, spans, trailer)
    )
    # The payloads' call always waits (it releases the GIL up front); the trailer's is
    # small and takes the GIL back only if the reply had not come when it first looked.
    assert returns in (1, 2)
    assert errors == [None] * (_COUNT + 1)
    assert crcs == crc32c_many(blobs)
    stored = bytearray(4 * _COUNT)
    assert client.read(1, [segment_for(endpoint, *trailer_at, stored)]) == [None]
    assert stored == b"".join(c.to_bytes(4, "little") for c in crcs)


def test_a_busy_python_thread_beside_a_large_read_keeps_running_and_costs_one_return(
    big_server: RegionServer, client: TransportClient, blobs: list[bytes]
) -> None:
    endpoint = big_server.endpoint
    assert client.write(1, [_place(endpoint, i, b) for i, b in enumerate(blobs)]) == [None] * 64
    dests = [bytearray(_SIZE) for _ in range(_COUNT)]
    reads = [_place(endpoint, i, d) for i, d in enumerate(dests)]
    rounds = 3
    returns: list[int] = []
    counted: list[int] = []
    with BusyThread() as busy:
        for _ in range(rounds):
            before = busy.count
            errors, taken, seconds = _returns(lambda: client.read(1, reads))
            counted.append(busy.count - before)
            assert errors == [None] * _COUNT
            returns.append(taken)
            print(
                f"\nread beside a busy thread: {_COUNT * _SIZE / seconds / 1e9:.2f} GB/s; "
                f"the thread counted {counted[-1]:,} meanwhile"
            )
    # The bytes move without the GIL, so the thread ran during every read; and the read
    # took the GIL back once each time (one wait for it, not one per receive).
    assert returns == [1] * rounds
    assert all(n > 0 for n in counted)
    assert dests == [bytearray(b) for b in blobs]


def test_a_small_read_whose_reply_comes_within_the_hold_keeps_the_gil(
    big_server: RegionServer, client: TransportClient
) -> None:
    """A frame under 256 KiB (a lookup's image buckets, a few small records) waits for its
    reply with the GIL held for up to HOLD_GIL: beside a busy Python thread, a reply that
    comes within it costs no wait of a switch interval. Of 20 reads from a node process
    that answers in tens of microseconds, at least one took no return of the GIL, and none
    took more than one."""
    endpoint = big_server.endpoint
    buffers = [bytearray(4096) for _ in range(4)]
    assert client.write(1, [_place(endpoint, i, b) for i, b in enumerate(buffers)]) == [None] * 4
    reads = [_place(endpoint, i, bytearray(4096)) for i in range(4)]
    returns = []
    for _ in range(20):
        errors, taken, _ = _returns(lambda: client.read(1, reads))
        assert errors == [None] * 4
        returns.append(taken)
    assert set(returns) <= {0, 1}
    assert 0 in returns


def test_a_store_puts_in_two_lanes_of_at_most_two_returns_and_gets_with_one_over_tcp() -> None:
    """Through an embedded store (index in this process): a large put goes as two frames
    at once (``write_lanes``), each its CRCs and its frame, the calling thread running one;
    a get is one frame (the records' headers and payloads with each payload's CRC)."""
    name = f"tcp-data-path-{uuid.uuid4().hex[:8]}"
    values = [np.random.default_rng(i).integers(0, 256, _SIZE, dtype=np.uint8) for i in range(16)]
    keys = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
    url = f"embedded://{name}?capacity=160MiB&transport=tcp&timeout=60s&tcp.read_lanes=1"
    with kvfabric.connect(url) as store:
        # Warm both lanes' connections: a put of the same shape under other keys.
        other = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
        assert {o.value for o in store.batched_put(other, values)} == {"stored"}
        assert store.local_node is not None
        server = store.local_node.servers["tcp"]
        frames = server.stats()["frames"]
        outcomes, put_returns, _ = _returns(lambda: store.batched_put(keys, values))
        put_frames, frames = server.stats()["frames"] - frames, server.stats()["frames"]
        assert {o.value for o in outcomes} == {"stored"}
        dests = [np.ones(_SIZE, dtype=np.uint8) for _ in values]
        got, get_returns, _ = _returns(lambda: store.batched_get(keys, into=dests))
        get_frames = server.stats()["frames"] - frames
    # The caller's lane: its payloads' call, and its trailer's if it had to wait for the reply.
    assert put_returns in (1, 2)
    assert get_returns == 1
    assert (put_frames, get_frames) == (2, 1)
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))


def test_a_put_below_the_lane_minimum_is_one_frame_over_tcp() -> None:
    name = f"tcp-data-path-{uuid.uuid4().hex[:8]}"
    count = 16
    size = LANE_MIN_BYTES // count - 4096  # the whole put just under the minimum
    values = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]
    keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
    with kvfabric.connect(f"embedded://{name}?capacity=64MiB&transport=tcp&timeout=60s") as store:
        _warm(store)
        assert store.local_node is not None
        server = store.local_node.servers["tcp"]
        frames = server.stats()["frames"]
        outcomes, put_returns, _ = _returns(lambda: store.batched_put(keys, values))
        assert server.stats()["frames"] - frames == 1
        assert {o.value for o in outcomes} == {"stored"}
        assert put_returns in (1, 2)  # the trailer's call may find its reply there
        got = store.batched_get(keys)
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))


def _warm(store: Store) -> None:
    """One put and get, so the client's connection to the node is open and pooled."""
    key = chain_keys([1], 1, namespace=uuid.uuid4().bytes)
    assert store.batched_put(key, [b"warm"])[0].value == "stored"
    assert store.batched_get(key)[0] is not None


# -- batches of several frames ------------------------------------------------------------


def _many_segments(
    endpoint: NodeEndpoint, count: int, size: int
) -> tuple[bytes, bytearray, list[Segment]]:
    """``count`` adjacent reads of ``size`` bytes from region 0, and the bytes they read."""
    data = os.urandom(count * size)
    dest = bytearray(len(data))
    view = memoryview(dest)
    reads = [
        segment_for(endpoint, 0, i * size, view[i * size : (i + 1) * size]) for i in range(count)
    ]
    return data, dest, reads


@pytest.mark.parametrize(
    ("span_length", "expected_returns"),
    [
        # 65,536 is no multiple of 3: the first frame ends where a span starts (65,535).
        pytest.param(3, 2, id="spans_within_frames"),
        # One span longer than a frame: its CRC is taken in one more native call.
        pytest.param(None, 3, id="a_span_longer_than_a_frame"),
    ],
)
def test_a_read_of_more_segments_than_a_frame_gets_every_crc(
    big_server: RegionServer,
    client: TransportClient,
    span_length: int | None,
    expected_returns: int,
) -> None:
    endpoint = big_server.endpoint
    count, size = MAX_COUNT + 4_500, 64  # both frames over 256 KiB: each waits for its reply
    data, dest, reads = _many_segments(endpoint, count, size)
    view = memoryview(data)
    assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
    if span_length is None:
        spans = [(0, count)]
    else:
        spans = [(i, min(i + span_length, count)) for i in range(0, count, span_length)]
    (errors, crcs), returns, _ = _returns(lambda: client.read_checksummed(1, reads, spans))
    assert errors == [None] * count
    assert dest == data
    assert crcs == crc32c_many([view[a * size : b * size] for a, b in spans])
    assert returns == expected_returns


def test_a_checksummed_write_of_more_segments_than_a_frame_stores_every_record(
    big_server: RegionServer, client: TransportClient
) -> None:
    """Past one frame the trailer cannot follow its payloads' CRCs in the same frame: the
    CRCs come first (one native call) and the frames go as usual."""
    endpoint = big_server.endpoint
    count, size = MAX_COUNT + 4_500, 64
    data, _, _ = _many_segments(endpoint, count, size)
    view = memoryview(data)
    writes = [
        segment_for(endpoint, 0, i * size, view[i * size : (i + 1) * size]) for i in range(count)
    ]
    spans = [(i, min(i + 3, count)) for i in range(0, count, 3)]
    trailer_at = (3, 0)

    def trailer(crcs: list[int]) -> list[Segment]:
        packed = b"".join(c.to_bytes(4, "little") for c in crcs)
        return [segment_for(endpoint, trailer_at[0], trailer_at[1], packed)]

    errors, crcs = client.write_checksummed(1, writes, spans, trailer)
    assert errors == [None] * (count + 1)
    assert crcs == crc32c_many([view[a * size : b * size] for a, b in spans])
    landed = bytearray(count * size)
    assert client.read(1, [segment_for(endpoint, 0, 0, landed)]) == [None]
    assert landed == data
    stored = bytearray(4 * len(spans))
    assert client.read(1, [segment_for(endpoint, *trailer_at, stored)]) == [None]
    assert stored == b"".join(c.to_bytes(4, "little") for c in crcs)


# -- replies no real node sends ---------------------------------------------------------------


# Regions the client checks segments against; the scripted node answers for them.
_REGION = RegionHandle(region=7, rkey=0x1234, size=64 * _MIB)


def _reply(op: int, count: int, rid: int, statuses: bytes, *, code: int = 0) -> bytes:
    return frame(op, count, rid, code=code) + statuses


def _payload(op: int, table: bytes) -> bytes:
    """A read's bytes for every entry (all 0x5A); nothing for a write."""
    if op != Op.READ:
        return b""
    return b"".join(b"\x5a" * entry[3] for entry in ENTRY.iter_unpack(table))


def _correct(op: int, count: int, rid: int, table: bytes) -> bytes:
    return _reply(op, count, rid, bytes(count)) + _payload(op, table)


Scripted = Callable[..., tuple[ScriptedNode, TransportClient]]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """A scripted node and a tcp client connected to it (both closed when the test ends)."""
    made: list[tuple[ScriptedNode, TransportClient]] = []

    def make(answer: Answer, timeout: float = 10.0) -> tuple[ScriptedNode, TransportClient]:
        node = ScriptedNode(answer)
        endpoint = NodeEndpoint(node=1, transport="tcp", address=node.address, regions=(_REGION,))
        made.append((node, open_client("tcp", endpoint, timeout=timeout)))
        return made[-1]

    yield make
    for node, client in made:
        client.close()
        node.close()


def _segment(buf: Any, offset: int = 0) -> Segment:
    return Segment(_REGION.region, _REGION.rkey, offset, memoryview(buf).cast("B"))


def test_a_scripted_node_that_answers_correctly_is_served_on_one_connection(
    scripted: Scripted,
) -> None:
    """The scripted node speaks the protocol: the tests below change only their replies."""
    node, client = scripted(_correct)
    dest = bytearray(1000)
    assert client.read(1, [_segment(dest), _segment(bytearray(0))]) == [None, None]
    assert dest == b"\x5a" * 1000
    assert client.write(1, [_segment(b"x" * 100)]) == [None]
    assert node.connections == 1


def test_segment_statuses_in_a_reply_become_refusals_of_those_segments(
    scripted: Scripted,
) -> None:
    """Only the accepted segment's bytes follow the reply; the others are refused with the
    node's reason, and the connection serves the next call."""

    def answer(op: int, count: int, rid: int, table: bytes) -> bytes:
        entries = list(ENTRY.iter_unpack(table))
        statuses = bytes([0, 2, 3][:count])
        body = b"\x5a" * entries[0][3] if op == Op.READ else b""
        return _reply(op, count, rid, statuses) + body

    node, client = scripted(answer)
    dests = [bytearray(100), bytearray(100), bytearray(100)]
    errors = client.read(1, [_segment(d, i * 100) for i, d in enumerate(dests)])
    assert errors[0] is None
    assert "bad rkey" in str(errors[1])
    assert "out of the region's bounds" in str(errors[2])
    assert dests == [b"\x5a" * 100, bytes(100), bytes(100)]
    assert client.write(1, [_segment(b"y" * 10)]) == [None]
    assert node.connections == 1


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_an_error_reply_is_a_refusal_of_the_call_and_is_not_retried(
    scripted: Scripted, op: Op
) -> None:
    """A bare header with a code, then the node closes: the call fails with the node's
    reason. (Only a pooled connection that simply closed is retried.)"""
    first = [True]

    def answer(r_op: int, count: int, rid: int, table: bytes) -> bytes | None:
        if first[0]:
            first[0] = False
            return _correct(r_op, count, rid, table)
        return _reply(r_op, 0, 0, b"", code=Code.TOO_LARGE)

    node, client = scripted(answer)
    assert client.read(1, [_segment(bytearray(10))]) == [None]  # a pooled connection now
    call = client.read if op == Op.READ else client.write
    with pytest.raises(TransportError, match="refused: batch too large"):
        call(1, [_segment(bytearray(4 * _MIB))])
    assert node.connections == 1


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("unknown_status", "unknown segment status"),
        ("another_request", "does not match its request"),
        ("another_version", "wire version 9"),
    ],
)
def test_a_reply_that_breaks_the_protocol_is_a_protocol_error(
    scripted: Scripted, case: str, match: str
) -> None:
    def answer(op: int, count: int, rid: int, table: bytes) -> bytes:
        if case == "unknown_status":
            return _reply(op, count, rid, bytes([9] * count))
        if case == "another_request":
            return _correct(op, count, rid + 1, table)
        return HEADER.pack(b"KVFT", 9, op, 0, count, rid) + bytes(count) + _payload(op, table)

    node, client = scripted(answer)
    with pytest.raises(TransportError, match=match):
        client.read(1, [_segment(bytearray(64))])
    # The connection was closed, never pooled: the next call opens another.
    with pytest.raises(TransportError, match=match):
        client.read(1, [_segment(bytearray(64))])
    assert node.connections == 2


def test_a_node_that_never_replies_times_the_whole_call_out(scripted: Scripted) -> None:
    hold = threading.Event()

    def silent(*_: object) -> None:
        hold.wait(PATIENT)  # until the test is over (a bound only a hang reaches)

    node, client = scripted(silent, timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TransportTimeoutError):
            client.read(1, [_segment(bytearray(4 * _MIB))])
    finally:
        hold.set()
    print(f"\ntimed out after {time.monotonic() - started:.2f} s (timeout 0.5 s)")
    assert node.connections == 1


def test_a_pooled_connection_the_node_closed_is_retried_once_on_a_fresh_one(
    scripted: Scripted,
) -> None:
    served = [0]

    def answer(op: int, count: int, rid: int, table: bytes) -> bytes | None:
        served[0] += 1
        return _correct(op, count, rid, table) if served[0] != 2 else None

    node, client = scripted(answer)
    dest = bytearray(300_000)  # over 256 KiB: the whole call runs without the GIL
    assert client.read(1, [_segment(dest)]) == [None]
    dest[:] = bytes(len(dest))
    assert client.read(1, [_segment(dest)]) == [None]  # closed, then retried
    assert dest == b"\x5a" * len(dest)
    assert node.connections == 2


# -- a large read over several connections at once (tcp.read_lanes) ---------------------------


def test_a_64_by_4mib_read_in_two_lanes_lands_every_byte_and_crc_with_one_return(
    big_server: RegionServer, blobs: list[bytes]
) -> None:
    """``tcp.read_lanes=2``: the read goes as two frames at once on two connections, in one
    native call; each record's CRC comes from the lane that landed it."""
    endpoint = big_server.endpoint
    client = open_client("tcp", endpoint, timeout=60.0, options={"read_lanes": "2"})
    try:
        writes = [_place(endpoint, i, b) for i, b in enumerate(blobs)]
        assert client.write(1, writes) == [None] * _COUNT
        dests = [bytearray(_SIZE) for _ in range(_COUNT)]
        # Spans of three records (and one of none), so a cut could fall inside a span.
        spans = [(i, min(i + 3, _COUNT)) for i in range(0, _COUNT, 3)] + [(_COUNT, _COUNT)]
        reads = [_place(endpoint, i, d) for i, d in enumerate(dests)]
        # Both lanes' connections opened (a handshake waits for the node twice) and pooled.
        assert client.read(1, reads) == [None] * _COUNT
        for dest in dests:
            dest[:] = bytes(_SIZE)
        (errors, crcs), returns, seconds = _returns(
            lambda: client.read_checksummed(1, reads, spans)
        )
        print(f"\nread in two lanes: {_COUNT * _SIZE / seconds / 1e9:.2f} GB/s")
        assert returns == 1
        assert errors == [None] * _COUNT
        assert dests == [bytearray(b) for b in blobs]
        assert crcs == crc32c_many([b"".join(blobs[a:b]) for a, b in spans])
    finally:
        client.close()


def _lanes_node(answer: Callable[..., bytes | None]) -> tuple[ScriptedNode, TransportClient]:
    node = ScriptedNode(answer, concurrent=True)
    endpoint = NodeEndpoint(node=1, transport="tcp", address=node.address, regions=(_REGION,))
    return node, open_client("tcp", endpoint, timeout=10.0, options={"read_lanes": "2"})


def _halves() -> tuple[list[bytearray], list[Segment]]:
    """Two reads of 8 MiB: a read of 16 MiB, split between them."""
    dests = [bytearray(8 * _MIB), bytearray(8 * _MIB)]
    return dests, [_segment(dests[0]), _segment(dests[1], 8 * _MIB)]


def test_a_read_in_lanes_uses_two_connections_and_pools_both() -> None:
    node, client = _lanes_node(_correct)
    try:
        for _ in range(2):
            dests, reads = _halves()
            assert client.read(1, reads) == [None, None]
            assert dests == [b"\x5a" * (8 * _MIB)] * 2
        assert node.connections == 2
        small = bytearray(1000)  # under READ_LANE_MIN: one frame, on a pooled connection
        assert client.read(1, [_segment(small)]) == [None]
        assert node.connections == 2
    finally:
        client.close()
        node.close()


def test_an_error_reply_on_one_lane_refuses_the_read_and_closes_both_connections() -> None:
    served = [0]

    def answer(op: int, count: int, rid: int, table: bytes) -> bytes:
        served[0] += 1
        if served[0] == 4:  # one of the second read's frames
            return _reply(op, 0, 0, b"", code=Code.TOO_LARGE)
        return _correct(op, count, rid, table)

    node, client = _lanes_node(answer)
    try:
        assert client.read(1, _halves()[1]) == [None, None]
        with pytest.raises(TransportError, match="refused: batch too large"):
            client.read(1, _halves()[1])
        dests, reads = _halves()
        assert client.read(1, reads) == [None, None]
        assert dests == [b"\x5a" * (8 * _MIB)] * 2
        assert node.connections == 4  # neither connection of the failed read was reused
    finally:
        client.close()
        node.close()


def test_pooled_lanes_the_node_closed_are_retried_once_on_fresh_connections() -> None:
    served = [0]

    def answer(op: int, count: int, rid: int, table: bytes) -> bytes | None:
        served[0] += 1
        return None if served[0] == 3 else _correct(op, count, rid, table)

    node, client = _lanes_node(answer)
    try:
        assert client.read(1, _halves()[1]) == [None, None]
        dests, reads = _halves()
        assert client.read(1, reads) == [None, None]  # one lane closed, then both retried
        assert dests == [b"\x5a" * (8 * _MIB)] * 2
        assert node.connections == 4
    finally:
        client.close()
        node.close()


def test_a_refused_segment_in_one_lane_is_refused_alone() -> None:
    def answer(op: int, count: int, rid: int, table: bytes) -> bytes:
        entries = list(ENTRY.iter_unpack(table))
        if entries[0][2] == 0:
            return _correct(op, count, rid, table)
        return _reply(op, count, rid, bytes([2] * count))  # bad rkey

    node, client = _lanes_node(answer)
    try:
        dests, reads = _halves()
        errors = client.read(1, reads)
        assert errors[0] is None
        assert "bad rkey" in str(errors[1])
        assert dests == [b"\x5a" * (8 * _MIB), bytes(8 * _MIB)]
    finally:
        client.close()
        node.close()
