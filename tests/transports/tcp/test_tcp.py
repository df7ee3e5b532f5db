"""The ``tcp`` transport: the shipped conformance suites, then what only TCP has.

The region server runs as a real separate process on 127.0.0.1 wherever the server is the
thing under test; tests that read the server's counters run it in-process (still over real
sockets). No test asserts a timing; where one must wait, it polls for an outcome under a
bound only a hang would reach. What every transport must do (killed and stalled nodes,
refusals, reconnects) is in the conformance suite, not here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import attrs
import pytest
from tcp_raw import ENTRY, HEADER, address, connect, frame, recv_exactly, recv_until_closed

import kvfabric
from kvfabric import PutOutcome
from kvfabric._node.node import DataNode
from kvfabric.errors import TransportError
from kvfabric.keys import chain_keys
from kvfabric.spi import BackendConfig, NodeEndpoint, Segment, TransportConfig
from kvfabric.testing import (
    Cluster,
    RegionServer,
    StoreConformance,
    TransportConformance,
    open_client,
    round_trip_works,
    segment_for,
    wait_for,
)
from kvfabric.transports.tcp import TcpTransport
from kvfabric.transports.tcp.auth import GREETING_SIZE
from kvfabric.transports.tcp.stream import IOV_MAX
from kvfabric.transports.tcp.wire import Code, Op

_MIB = 1 << 20


class TestTcpTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "tcp"


class TestEmbeddedStoreOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        # The timeout bounds a hang, not the machine's speed: 256 MiB puts run on busy hosts.
        # dram.prefault off: a new store for each test, and preparing 512 MiB ahead
        # costs more than most tests (what they check does not depend on it).
        url = f"embedded://{unique_name}?capacity=512MiB&transport=tcp&timeout=60s"
        return f"{url}&dram.prefault=false"


# -- helpers -------------------------------------------------------------------------------


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


def _error_code(received: bytes) -> int:
    """The code of the error reply that follows the node's greeting."""
    reply = received[HEADER.size + GREETING_SIZE :]
    assert len(reply) == HEADER.size, "the node sent more than one error header"
    return int(HEADER.unpack(reply)[3])


def test_auth_failures_are_counted_and_close_the_connection(node: DataNode) -> None:
    endpoint = _local_endpoint(node)
    with socket.create_connection(address(endpoint)) as sock:
        sock.sendall(frame(Op.HELLO, 64, 0) + os.urandom(64))  # a proof made up
        assert _error_code(recv_until_closed(sock)) == Code.AUTH_FAILED  # then EOF
    with socket.create_connection(address(endpoint)) as sock:
        sock.sendall(frame(Op.READ, 0))  # no HELLO first
        assert _error_code(recv_until_closed(sock)) == Code.AUTH_REQUIRED
    assert node.servers["tcp"].stats()["auth_failures"] == 2
    assert round_trip_works("tcp", endpoint, token=b"secret")


def test_a_read_before_the_handshake_moves_no_bytes_even_with_a_valid_rkey(
    node: DataNode,
) -> None:
    """rkeys are honoured only on an authenticated connection."""
    endpoint = _local_endpoint(node)
    handle = endpoint.regions[0]
    with socket.create_connection(address(endpoint)) as sock:
        sock.sendall(frame(Op.READ, 1) + ENTRY.pack(handle.region, handle.rkey, 0, 4096))
        received = recv_until_closed(sock)
    assert len(received) == HEADER.size + GREETING_SIZE + HEADER.size  # no status, no bytes
    assert _error_code(received) == Code.AUTH_REQUIRED
    assert node.servers["tcp"].stats()["bytes_read"] == 0


# -- malformed input -----------------------------------------------------------------------


def test_random_bytes_and_a_truncated_header_leave_the_node_serving(
    server: RegionServer,
) -> None:
    with socket.create_connection(address(server.endpoint)) as sock:
        sock.sendall(os.urandom(4096))
        recv_until_closed(sock)  # the server closes this connection...
    with socket.create_connection(address(server.endpoint)) as sock:
        sock.sendall(frame(Op.READ, 1, 7)[:9])
    # ...and a stalled half-header on a third connection blocks nobody else.
    stalled = socket.create_connection(address(server.endpoint))
    stalled.sendall(b"KVF")
    try:
        assert round_trip_works("tcp", server.endpoint)
    finally:
        stalled.close()


@pytest.mark.parametrize(
    "request_frame",
    [
        pytest.param(frame(Op.READ, 1_000_000), id="count"),
        pytest.param(frame(Op.WRITE, 1) + ENTRY.pack(0, 1, 0, 1 << 62), id="total_length"),
    ],
)
def test_absurd_frames_are_refused_with_an_error_reply(
    server: RegionServer, request_frame: bytes
) -> None:
    with connect(server.endpoint) as sock:
        sock.sendall(request_frame)
        reply = recv_until_closed(sock)
    magic, _, _, code, count, _ = HEADER.unpack(reply)
    assert (magic, code, count) == (b"KVFT", Code.TOO_LARGE, 0)
    assert round_trip_works("tcp", server.endpoint)


def test_bad_frames_are_counted(node: DataNode) -> None:
    endpoint = _local_endpoint(node)
    for garbage in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10, frame(Op.HELLO, 64, version=1)):
        with socket.create_connection(address(endpoint)) as sock:
            sock.sendall(garbage)
            assert _error_code(recv_until_closed(sock)) == Code.BAD_FRAME
    assert node.servers["tcp"].stats()["bad_frames"] == 2


# -- faults --------------------------------------------------------------------------------


def test_node_restarted_on_the_same_port_is_reached_without_a_failed_call() -> None:
    first = _local_node()
    endpoint = _local_endpoint(first)
    client = open_client("tcp", endpoint)
    try:
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(16))]) == [None]
        first.close()  # leaves the client a pooled connection the node has closed
        second = _local_node(port=address(endpoint)[1])
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


def test_refused_writes_in_a_frame_are_drained_and_the_stream_stays_in_sync() -> None:
    """A client that skipped the checks: the node refuses per segment, reads and drops the
    refused payloads, and serves the next frame on the same connection."""
    node = _local_node()
    try:
        endpoint = _local_endpoint(node)
        handle = endpoint.regions[0]
        a, b = os.urandom(10_000), os.urandom(10_000)
        entries = [
            (handle.region, handle.rkey, 0, a),
            (handle.region, handle.rkey ^ 1, 20_000, os.urandom(_MIB)),
            (handle.region, handle.rkey, handle.size - 10, os.urandom(100)),
            (999, handle.rkey, 0, os.urandom(100)),
            (handle.region, handle.rkey, 50_000, b),
        ]
        with connect(endpoint) as sock:
            table = b"".join(ENTRY.pack(r, k, o, len(d)) for r, k, o, d in entries)
            head = frame(Op.WRITE, len(entries), 5)
            sock.sendall(head + table + b"".join(d for *_, d in entries))
            reply = recv_exactly(sock, HEADER.size + len(entries))
            assert list(reply[HEADER.size :]) == [0, 2, 3, 1, 0]
            # The same connection serves the next frame: the refused bytes were drained.
            sock.sendall(
                frame(Op.READ, 2, 6)
                + ENTRY.pack(handle.region, handle.rkey, 0, 10_000)
                + ENTRY.pack(handle.region, handle.rkey, 50_000, 10_000)
            )
            reply = recv_exactly(sock, HEADER.size + 2 + 20_000)
            assert reply[HEADER.size : HEADER.size + 2] == b"\x00\x00"
            assert reply[HEADER.size + 2 :] == a + b
        stats = node.servers["tcp"].stats()
        assert stats["refused_segments"] == 3
        assert (stats["segments_written"], stats["segments_read"]) == (2, 2)
    finally:
        node.close()


def test_batches_of_more_segments_than_iov_max_land_both_ways(server: RegionServer) -> None:
    """Each side gathers and scatters at most IOV_MAX buffers per system call: a batch of
    three times that many (and some) is split into calls, in both directions."""
    endpoint = server.endpoint
    count, size = 3 * IOV_MAX + 5, 100
    data = os.urandom(count * size)
    client = open_client("tcp", endpoint, timeout=30.0)
    try:
        source = memoryview(data)
        writes = [
            segment_for(endpoint, 0, i * size, source[i * size : (i + 1) * size])
            for i in range(count)
        ]
        assert client.write(1, writes) == [None] * count
        dest = bytearray(len(data))
        view = memoryview(dest)
        reads = [
            segment_for(endpoint, 0, i * size, view[i * size : (i + 1) * size])
            for i in range(count)
        ]
        assert client.read(1, reads) == [None] * count
        assert dest == data
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
        errors = client.read(
            1,
            [
                segment_for(endpoint, 0, 0, bytearray(100)),
                Segment(handle.region, handle.rkey + 1, 0, memoryview(bytearray(8))),
            ],
        )
    finally:
        client.close()
    assert errors[0] is None
    assert isinstance(errors[1], TransportError)  # refused by the client's own checks
    stats = node.servers["tcp"].stats()
    assert stats["connections"] == 1
    assert stats["requests"] == 2
    assert (stats["segments_written"], stats["bytes_written"]) == (2, 101)
    assert (stats["segments_read"], stats["bytes_read"]) == (1, 100)
    assert stats["refused_segments"] == 0  # the bad segment never left the client
    assert stats["bad_frames"] == stats["auth_failures"] == 0


def test_close_returns_with_idle_clients_connected() -> None:
    node = _local_node()
    endpoint = _local_endpoint(node)
    client = open_client("tcp", endpoint)
    idle = socket.create_connection(address(endpoint))
    try:
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))]) == [None]
        started = time.monotonic()
        node.close()  # a thread blocked on the idle connection would hang this
        print(f"\nclose with an idle client connected: {time.monotonic() - started:.3f} s")
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


# -- its declared options --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tcp_node() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp",), capacity="64MiB") as cluster:
        yield cluster


def _tcp_counters(cluster: Cluster, requests: int) -> dict[str, int]:
    """The node's tcp counters once it has reported ``requests`` requests (heartbeats)."""

    def node_counters() -> dict[str, int]:
        nodes = [v for k, v in cluster.stats().items() if k.startswith("node")]
        return nodes[0] if nodes else {}

    return wait_for(
        f"the node reported {requests} requests",
        node_counters,
        until=lambda counters: counters.get("tcp_requests", -1) >= requests,
    )


@pytest.mark.parametrize(("pool", "fresh_per_get"), [("0", 1), (None, 0)])
def test_pool_from_the_url_reaches_the_client(
    tcp_node: Cluster, pool: str | None, fresh_per_get: int
) -> None:
    """``?tcp.pool=0`` keeps no idle connection: every call opens one. By default the
    client's pooled connection serves every call."""
    keys = chain_keys([1], 1, namespace=os.urandom(16))
    options = {"tcp.pool": pool} if pool is not None else {}
    before = _tcp_counters(tcp_node, 0)
    with kvfabric.connect(tcp_node.url(transport="tcp", **options)) as store:
        assert store.batched_put(keys, [os.urandom(1000)]) == [PutOutcome.STORED]
        warm = _tcp_counters(tcp_node, before["tcp_requests"] + 1)
        for _ in range(5):
            assert store.batched_get(keys)[0] is not None
        after = _tcp_counters(tcp_node, warm["tcp_requests"] + 5)
    assert after["tcp_requests"] - warm["tcp_requests"] == 5
    assert after["tcp_connections"] - warm["tcp_connections"] == 5 * fresh_per_get
