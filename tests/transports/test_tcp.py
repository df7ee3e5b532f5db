"""The ``tcp`` transport: the shipped conformance suites, then what only TCP has.

The region server runs as a real separate process on 127.0.0.1 wherever the server is the
thing under test; tests that read the server's counters run it in-process (still over real
sockets). No test asserts a timing beyond generous bounds that only a hang would exceed.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from kvfabric._node.node import DataNode
from kvfabric.errors import TransportError, TransportTimeoutError
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportConfig
from kvfabric.testing import (
    RegionServer,
    StoreConformance,
    TransportConformance,
    open_client,
    round_trip_works,
    segment_for,
)
from kvfabric.transports.tcp import TcpTransport

_MIB = 1 << 20
# The wire header (see the module docstring of kvfabric.transports.tcp).
_HEADER = struct.Struct("<4sBBHIQ")
_ENTRY = struct.Struct("<IQQQ")
_READ, _WRITE, _HELLO = 1, 2, 3


class TestTcpTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "tcp"


class TestEmbeddedStoreOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        return f"embedded://{unique_name}?capacity=512MiB&transport=tcp"


# -- helpers -------------------------------------------------------------------------------


def _address(endpoint: NodeEndpoint) -> tuple[str, int]:
    host, _, port = endpoint.address.decode().rpartition(":")
    return host, int(port)


def _recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes (a hang fails on the socket timeout)."""
    sock.settimeout(10)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


@pytest.fixture
def server() -> Iterator[RegionServer]:
    server = RegionServer("tcp")
    yield server
    server.close()


def _local_node(*, token: bytes = b"", port: int = 0) -> DataNode:
    """An in-process node (real sockets), for tests that read its counters or restart it."""
    return DataNode.create(
        backend="dram",
        transports=["tcp"],
        backend_config=BackendConfig(capacity=8 * _MIB, region_size=4 * _MIB),
        transport_config=TransportConfig(token=token, port=port),
    )


@pytest.fixture
def node() -> Iterator[DataNode]:
    node = _local_node(token=b"secret")
    yield node
    node.close()


def _local_endpoint(node: DataNode) -> NodeEndpoint:
    return attrs.evolve(next(e for e in node.info().endpoints if e.transport == "tcp"), node=1)


# -- authentication ------------------------------------------------------------------------


def test_wrong_or_missing_token_is_refused_and_the_right_one_is_served() -> None:
    server = RegionServer("tcp", token="secret")
    try:
        for token in (b"wrong", b""):
            client = open_client("tcp", server.endpoint, token=token)
            with pytest.raises(TransportError):
                client.read(1, [segment_for(server.endpoint, 0, 0, bytearray(16))])
            client.close()
        assert round_trip_works("tcp", server.endpoint, token=b"secret")
    finally:
        server.close()


def test_auth_failures_are_counted_and_close_the_connection(node: DataNode) -> None:
    endpoint = _local_endpoint(node)
    with socket.create_connection(_address(endpoint)) as sock:
        sock.sendall(_HEADER.pack(b"KVFT", 1, _HELLO, 0, 5, 0) + b"wrong")
        reply = _recv_until_closed(sock)
    assert _HEADER.unpack(reply[: _HEADER.size])[3] != 0  # an error code, then EOF
    with socket.create_connection(_address(endpoint)) as sock:
        sock.sendall(_HEADER.pack(b"KVFT", 1, _READ, 0, 0, 1))  # no HELLO first
        _recv_until_closed(sock)
    assert node.servers["tcp"].stats()["auth_failures"] == 2
    assert round_trip_works("tcp", endpoint, token=b"secret")


# -- malformed input -----------------------------------------------------------------------


def test_random_bytes_and_a_truncated_header_leave_the_node_serving(
    server: RegionServer,
) -> None:
    with socket.create_connection(_address(server.endpoint)) as sock:
        sock.sendall(os.urandom(4096))
        _recv_until_closed(sock)  # the server closes this connection...
    with socket.create_connection(_address(server.endpoint)) as sock:
        sock.sendall(_HEADER.pack(b"KVFT", 1, _READ, 0, 1, 7)[:9])
    # ...and a stalled half-header on a third connection blocks nobody else.
    stalled = socket.create_connection(_address(server.endpoint))
    stalled.sendall(b"KVF")
    try:
        assert round_trip_works("tcp", server.endpoint)
    finally:
        stalled.close()


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(_HEADER.pack(b"KVFT", 1, _READ, 0, 1_000_000, 1), id="count"),
        pytest.param(
            _HEADER.pack(b"KVFT", 1, _WRITE, 0, 1, 1) + _ENTRY.pack(0, 1, 0, 1 << 62),
            id="total_length",
        ),
    ],
)
def test_absurd_frames_are_refused_with_an_error_reply(server: RegionServer, frame: bytes) -> None:
    with socket.create_connection(_address(server.endpoint)) as sock:
        sock.sendall(frame)
        reply = _recv_until_closed(sock)
    magic, _, _, code, count, _ = _HEADER.unpack(reply)
    assert (magic, count) == (b"KVFT", 0)
    assert code != 0
    assert round_trip_works("tcp", server.endpoint)


def test_bad_frames_are_counted(node: DataNode) -> None:
    endpoint = _local_endpoint(node)
    for frame in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10, _HEADER.pack(b"KVFT", 9, 1, 0, 0, 0)):
        with socket.create_connection(_address(endpoint)) as sock:
            sock.sendall(frame)
            _recv_until_closed(sock)
    assert node.servers["tcp"].stats()["bad_frames"] == 2


# -- faults --------------------------------------------------------------------------------


def test_stalled_node_times_out_then_a_fresh_read_works(server: RegionServer) -> None:
    endpoint = server.endpoint
    data = os.urandom(64 * 1024)
    client = open_client("tcp", endpoint, timeout=1.0)
    try:
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TransportTimeoutError):
                client.read(1, [segment_for(endpoint, 0, 0, bytearray(len(data)))])
            assert time.monotonic() - started < 1.0 + 4.0
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        dest = bytearray(len(data))
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == data
    finally:
        client.close()


def test_killed_node_fails_fast_not_at_the_timeout(server: RegionServer) -> None:
    endpoint = server.endpoint
    client = open_client("tcp", endpoint, timeout=30.0)
    try:
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(16))]) == [None]
        server.kill()
        for _ in range(2):  # first on the pooled connection, then on a fresh one
            started = time.monotonic()
            with pytest.raises(TransportError) as caught:
                client.read(1, [segment_for(endpoint, 0, 0, bytearray(16))])
            assert not isinstance(caught.value, TransportTimeoutError)
            assert time.monotonic() - started < 5.0
    finally:
        client.close()


def test_reconnect_to_a_new_address_replaces_the_old_one() -> None:
    first, second = RegionServer("tcp"), RegionServer("tcp")
    client = open_client("tcp", first.endpoint)
    try:
        assert client.read(1, [segment_for(first.endpoint, 0, 0, bytearray(16))]) == [None]
        first.kill()
        client.connect(second.endpoint)
        data = os.urandom(1000)
        assert client.write(1, [segment_for(second.endpoint, 0, 0, data)]) == [None]
        dest = bytearray(1000)
        assert client.read(1, [segment_for(second.endpoint, 0, 0, dest)]) == [None]
        assert dest == data
    finally:
        client.close()
        first.close()
        second.close()


def test_node_restarted_on_the_same_port_is_reached_without_a_failed_call() -> None:
    first = _local_node()
    endpoint = _local_endpoint(first)
    client = open_client("tcp", endpoint)
    try:
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(16))]) == [None]
        first.close()  # leaves the client a pooled connection the node has closed
        second = _local_node(port=_address(endpoint)[1])
        try:
            restarted = _local_endpoint(second)
            assert restarted.address == endpoint.address
            client.connect(restarted)
            data = os.urandom(1000)
            assert client.write(1, [segment_for(restarted, 0, 0, data)]) == [None]
            dest = bytearray(1000)
            assert client.read(1, [segment_for(restarted, 0, 0, dest)]) == [None]
            assert dest == data
        finally:
            second.close()
    finally:
        client.close()


# -- batches and concurrency ---------------------------------------------------------------


def test_refused_writes_in_a_batch_keep_the_stream_in_sync(server: RegionServer) -> None:
    endpoint = server.endpoint
    handle = endpoint.regions[0]
    a, b = os.urandom(10_000), os.urandom(10_000)
    client = open_client("tcp", endpoint)
    try:
        errors = client.write(
            1,
            [
                segment_for(endpoint, 0, 0, a),
                Segment(handle.region, handle.rkey ^ 1, 20_000, memoryview(os.urandom(_MIB))),
                segment_for(endpoint, 0, handle.size - 10, os.urandom(100)),
                segment_for(endpoint, 0, 50_000, b),
            ],
        )
        assert [e is None for e in errors] == [True, False, False, True]
        dests = [bytearray(10_000), bytearray(10_000)]
        reads = [segment_for(endpoint, 0, 0, dests[0]), segment_for(endpoint, 0, 50_000, dests[1])]
        assert client.read(1, reads) == [None, None]
        assert dests == [a, b]
    finally:
        client.close()


def test_records_of_header_and_payload_scatter_into_their_buffers(
    server: RegionServer,
) -> None:
    """Thousands of adjacent 64-byte headers and payloads: more than one syscall's worth."""
    endpoint = server.endpoint
    count, size, stride = 1500, 1000, 2048
    records = [os.urandom(64 + size) for _ in range(count)]
    client = open_client("tcp", endpoint)
    try:
        writes = [segment_for(endpoint, i % 2, (i // 2) * stride, r) for i, r in enumerate(records)]
        assert client.write(1, writes) == [None] * count
        heads = [bytearray(64) for _ in range(count)]
        bodies = [bytearray(size) for _ in range(count)]
        reads: list[Segment] = []
        for i in range(count):
            offset = (i // 2) * stride
            reads.append(segment_for(endpoint, i % 2, offset, heads[i]))
            reads.append(segment_for(endpoint, i % 2, offset + 64, bodies[i]))
        assert client.read(1, reads) == [None] * (2 * count)
        assert [bytes(h + b) for h, b in zip(heads, bodies, strict=True)] == records
    finally:
        client.close()


def test_batch_larger_than_one_frame_is_split_and_lands(server: RegionServer) -> None:
    endpoint = server.endpoint
    count = 70_000  # the wire allows 65536 entries per frame
    data = os.urandom(count * 16)
    client = open_client("tcp", endpoint, timeout=30.0)
    try:
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        dest = bytearray(len(data))
        view = memoryview(dest)
        reads = [
            segment_for(endpoint, 0, i * 16, view[i * 16 : (i + 1) * 16]) for i in range(count)
        ]
        assert client.read(1, reads) == [None] * count
        assert dest == data
    finally:
        client.close()


def test_64_by_4mib_batch_lands_byte_exact() -> None:
    server = RegionServer("tcp", capacity=256 * _MIB, region_size=64 * _MIB)
    endpoint = server.endpoint
    chunk = 4 * _MIB
    blobs = [os.urandom(chunk) for _ in range(64)]
    client = open_client("tcp", endpoint, timeout=60.0)
    try:

        def place(i: int, buf: object) -> Segment:
            return segment_for(endpoint, i // 16, (i % 16) * chunk, buf)

        assert client.write(1, [place(i, b) for i, b in enumerate(blobs)]) == [None] * 64
        dests = [bytearray(chunk) for _ in range(64)]
        assert client.read(1, [place(i, d) for i, d in enumerate(dests)]) == [None] * 64
        assert all(d == b for d, b in zip(dests, blobs, strict=True))
    finally:
        client.close()
        server.close()


# -- the server's own bookkeeping ----------------------------------------------------------


def test_server_counts_what_it_served(node: DataNode) -> None:
    endpoint = _local_endpoint(node)
    handle = endpoint.regions[0]
    client = open_client("tcp", endpoint, token=b"secret")
    try:
        client.write(
            1, [segment_for(endpoint, 0, 0, b"x" * 100), segment_for(endpoint, 1, 0, b"y")]
        )
        client.read(
            1,
            [
                segment_for(endpoint, 0, 0, bytearray(100)),
                Segment(handle.region, handle.rkey + 1, 0, memoryview(bytearray(8))),
            ],
        )
    finally:
        client.close()
    stats = node.servers["tcp"].stats()
    assert stats["connections"] == 1
    assert stats["requests"] == 2
    assert (stats["segments_written"], stats["bytes_written"]) == (2, 101)
    assert (stats["segments_read"], stats["bytes_read"]) == (1, 100)
    assert stats["refused_segments"] == 1
    assert stats["bad_frames"] == stats["auth_failures"] == 0


def test_close_returns_promptly_with_idle_clients_connected() -> None:
    node = _local_node()
    endpoint = _local_endpoint(node)
    client = open_client("tcp", endpoint)
    idle = socket.create_connection(_address(endpoint))
    try:
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))]) == [None]
        started = time.monotonic()
        node.close()
        assert time.monotonic() - started < 5.0
        with pytest.raises(TransportError):
            client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))])
    finally:
        idle.close()
        client.close()


def test_the_advertised_host_is_what_clients_are_told() -> None:
    server = TcpTransport.create_server(TransportConfig(host="127.0.0.1", advertise="localhost"))
    try:
        host, _, port = server.address.decode().rpartition(":")
        assert host == "localhost"
        assert int(port) > 0
    finally:
        server.close()


def _limited_server(**options: str) -> tuple[Any, NodeEndpoint, DataNode]:
    node = DataNode.create(
        backend="dram",
        transports=["tcp"],
        backend_config=BackendConfig(capacity=1 << 20),
        transport_config=TransportConfig(options=options),
    )
    return node.servers["tcp"], _local_endpoint(node), node


def test_a_half_sent_frame_is_dropped_after_the_frame_timeout() -> None:
    server, endpoint, node = _limited_server(frame_timeout="0.3")
    try:
        with socket.create_connection(_address(endpoint)) as sock:
            sock.sendall(_HEADER.pack(b"KVFT", 1, 1, 0, 1, 0))  # a READ header, no entry
            sock.settimeout(5)
            assert sock.recv(1) == b""  # the node hung up on the stalled frame
        assert server.stats()["stalled_frames"] == 1
        assert round_trip_works("tcp", endpoint)
    finally:
        node.close()


def test_connections_beyond_the_cap_are_refused_and_the_rest_served() -> None:
    server, endpoint, node = _limited_server(max_connections="2")
    held = [socket.create_connection(_address(endpoint)) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection(_address(endpoint)) as extra:
            extra.settimeout(5)
            assert extra.recv(1) == b""
        assert server.stats()["connections_refused"] == 1
        held.pop().close()
        time.sleep(0.2)
        assert round_trip_works("tcp", endpoint)
    finally:
        for sock in held:
            sock.close()
        node.close()
