"""The tcp data port under hostile traffic: strangers cannot starve it, and learn nothing.

Memory is measured on real node processes (``VmRSS`` before and after, with bounds far
above what the node needs, so only unbounded growth fails); counters are read from
in-process nodes (still real sockets). No test asserts a timing: a deadline is shown by
its outcome (the node closed the connection, a counter moved).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from tcp_raw import (
    ENTRY,
    HEADER,
    PATIENT,
    Proxy,
    address,
    connect,
    frame,
    hello_reply_code,
    local_endpoint,
    local_node,
    recv_exactly,
    recv_until_closed,
    rss_mib,
)

from kvfabric._control.security import Credentials
from kvfabric._node.node import DataNode
from kvfabric._runtime.native import SERVE_MAX_COUNT
from kvfabric.errors import ConfigError, TransportError
from kvfabric.spi import NodeEndpoint, Segment
from kvfabric.testing import RegionServer, open_client, round_trip_works, segment_for, wait_for
from kvfabric.transports.tcp.auth import GREETING_SIZE, HELLO_SIZE
from kvfabric.transports.tcp.wire import Code, Op

_KEY = b"secret"
# Far above what a thousand bounded connections cost the node (a few MiB measured), far
# below what the unbounded ones cost before (1.8 GB for 1,000 header-only connections).
_RSS_BOUND_MIB = 100.0


@pytest.fixture
def nodes() -> Iterator[Callable[..., DataNode]]:
    """In-process nodes given tcp options (closed when the test ends)."""
    made: list[DataNode] = []

    def make(token: bytes = _KEY, **options: str) -> DataNode:
        node = local_node(token, **options)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def _stats(node: DataNode) -> dict[str, int]:
    return node.servers["tcp"].stats()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the node has closed ``sock`` (reads what is pending without waiting)."""
    sock.setblocking(False)
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


# -- deadlines -------------------------------------------------------------------------------


def test_a_connection_that_never_answers_its_challenge_is_closed_at_the_deadline(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes(handshake_timeout="300ms")
    endpoint = local_endpoint(node)
    with socket.create_connection(address(endpoint)) as sock:
        assert len(recv_until_closed(sock)) == HEADER.size + GREETING_SIZE  # greeting, EOF
    assert _stats(node)["handshake_timeouts"] == 1
    assert round_trip_works("tcp", endpoint, token=_KEY)


def test_a_half_sent_frame_is_dropped_at_the_frame_deadline(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes(frame_timeout="300ms")
    endpoint = local_endpoint(node)
    with connect(endpoint, _KEY) as sock:
        sock.sendall(frame(Op.READ, 1))  # a READ header, no entry
        assert recv_until_closed(sock) == b""  # the node hung up on the stalled frame
    assert _stats(node)["stalled_frames"] == 1
    assert round_trip_works("tcp", endpoint, token=_KEY)


def test_a_frame_that_keeps_trickling_in_is_dropped_at_the_frame_deadline(
    nodes: Callable[..., DataNode],
) -> None:
    """The deadline is for the whole frame, not per receive: a byte every 20 ms never lets
    a receive time out, yet the frame (28 KB of table) would take 9 minutes."""
    node = nodes(frame_timeout="500ms")
    endpoint = local_endpoint(node)
    request = frame(Op.READ, 1000) + bytes(1000 * ENTRY.size)
    sent = 0
    with connect(endpoint, _KEY) as sock:
        deadline = time.monotonic() + PATIENT
        try:
            while not _closed_by_peer(sock):
                assert time.monotonic() < deadline, "the node kept the trickling frame"
                sock.send(request[sent : sent + 1])
                sent += 1
                time.sleep(0.02)  # the trickle under test: one byte per 20 ms
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed between the check and the send
    assert sent < len(request)
    assert _stats(node)["stalled_frames"] == 1
    print(f"\nthe node dropped the trickling frame after {sent} of {len(request)} bytes")


@pytest.mark.parametrize("busy_poll", ["0", "1ms"])
def test_an_idle_connection_is_closed_and_the_pooled_client_reconnects_without_a_failure(
    nodes: Callable[..., DataNode], busy_poll: str
) -> None:
    """Also with the node spinning for each next frame (tcp.busy_poll): the spin never
    outlasts the idle deadline's wait."""
    node = nodes(idle_timeout="300ms", busy_poll=busy_poll)
    endpoint = local_endpoint(node)
    client = open_client("tcp", endpoint, token=_KEY)
    try:
        dest = bytearray(16)
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        wait_for("the idle connection closed", lambda: _stats(node)["idle_timeouts"] == 1)
        # The pooled connection is closed: the call retries once on a fresh one.
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
    finally:
        client.close()
    assert _stats(node)["handshakes"] == 2


# -- caps ------------------------------------------------------------------------------------


def test_past_max_pending_the_oldest_handshakes_are_closed_and_a_client_gets_in(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes(max_pending="4")
    endpoint = local_endpoint(node)
    strangers = [socket.create_connection(address(endpoint)) for _ in range(10)]
    try:
        wait_for("6 handshakes evicted", lambda: _stats(node)["pending_evicted"] == 6)
        closed = [True] * 6 + [False] * 4
        wait_for(
            "the 6 oldest closed",
            lambda: [_closed_by_peer(s) for s in strangers],
            until=lambda seen: seen == closed,
        )
        assert round_trip_works("tcp", endpoint, token=_KEY)  # its connection: the 11th
        assert _stats(node)["pending_evicted"] == 7
    finally:
        for sock in strangers:
            sock.close()


def test_at_max_connections_the_longest_idle_connection_makes_room(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes(max_connections="2")
    endpoint = local_endpoint(node)
    handle = endpoint.regions[0]
    oldest = connect(endpoint, _KEY)
    newer = connect(endpoint, _KEY)
    try:
        assert round_trip_works("tcp", endpoint, token=_KEY)
        assert _stats(node)["idle_evicted"] == 1
        assert recv_until_closed(oldest) == b""
        newer.sendall(frame(Op.READ, 1) + ENTRY.pack(handle.region, handle.rkey, 0, 8))
        assert recv_exactly(newer, HEADER.size + 1 + 8)[HEADER.size] == 0  # still served
    finally:
        oldest.close()
        newer.close()


def test_at_max_connections_with_every_one_busy_a_client_is_told_busy(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes(max_connections="2")
    endpoint = local_endpoint(node)
    busy = [connect(endpoint, _KEY) for _ in range(2)]
    try:
        for sock in busy:
            sock.sendall(frame(Op.READ, 1))  # half a frame: busy until the frame deadline
        wait_for("both threads inside a frame", lambda: _stats(node)["frames"] == 2)
        with socket.create_connection(address(endpoint)) as extra:
            assert hello_reply_code(extra, _KEY) == Code.BUSY
        assert _stats(node)["connections_refused"] == 1
        busy.pop().close()
        # The slot is free once the node's thread sees the close: until then, BUSY.
        wait_for("the freed slot serves", lambda: _round_trip_or_busy(endpoint))
    finally:
        for sock in busy:
            sock.close()


def _round_trip_or_busy(endpoint: NodeEndpoint) -> bool:
    try:
        return round_trip_works("tcp", endpoint, token=_KEY)
    except TransportError:
        return False


# -- memory (real node processes) ------------------------------------------------------------


def _idle(server: RegionServer) -> socket.socket:
    return socket.create_connection(address(server.endpoint))


def _half_header(server: RegionServer) -> socket.socket:
    sock = socket.create_connection(address(server.endpoint))
    sock.sendall(frame(Op.HELLO, HELLO_SIZE, 0)[:10])
    return sock


def _authenticated_header_only(server: RegionServer) -> socket.socket:
    """Authenticated, then a READ header announcing the most entries a frame may have."""
    sock = connect(server.endpoint, _KEY)
    sock.sendall(frame(Op.READ, 65536))
    return sock


@pytest.mark.slow
@pytest.mark.parametrize(
    "open_one",
    [
        pytest.param(_idle, id="idle"),
        pytest.param(_half_header, id="half_header"),
        pytest.param(_authenticated_header_only, id="authenticated_header_only"),
    ],
)
def test_a_thousand_hostile_connections_leave_rss_bounded_and_a_client_served(
    open_one: Callable[[RegionServer], socket.socket],
) -> None:
    server = RegionServer("tcp", token=_KEY.decode())
    held: list[socket.socket] = []
    try:
        before = rss_mib(server.process.pid)
        held = [open_one(server) for _ in range(1000)]
        # Served after all 1,000 were accepted: the node has seen every one.
        assert round_trip_works("tcp", server.endpoint, token=_KEY)
        after = rss_mib(server.process.pid)
        print(f"\nnode RSS {before:.0f} MiB -> {after:.0f} MiB with 1,000 held connections")
        assert after - before < _RSS_BOUND_MIB
    finally:
        for sock in held:
            sock.close()
        server.close()


@pytest.mark.slow
def test_a_refused_huge_write_costs_the_node_no_memory() -> None:
    """A WRITE announcing ~1 TiB for a region that does not exist: the node reads the
    payload through one scratch buffer (no view per chunk) while it keeps coming."""
    server = RegionServer("tcp", token=_KEY.decode())
    held: list[socket.socket] = []
    try:
        before = rss_mib(server.process.pid)
        chunk = bytes(1 << 20)
        for _ in range(4):
            sock = connect(server.endpoint, _KEY)
            sock.sendall(frame(Op.WRITE, 1) + ENTRY.pack(999, 1, 0, (1 << 40) - 1))
            for _ in range(64):
                sock.sendall(chunk)  # 64 MiB each: sendall returns once the node took it
            held.append(sock)
        after = rss_mib(server.process.pid)
        print(f"\nnode RSS {before:.0f} MiB -> {after:.0f} MiB draining 4 x 64 MiB refused")
        assert after - before < _RSS_BOUND_MIB / 2
        assert round_trip_works("tcp", server.endpoint, token=_KEY)
    finally:
        for sock in held:
            sock.close()
        server.close()


@pytest.mark.parametrize("count", [SERVE_MAX_COUNT, SERVE_MAX_COUNT + 1])
def test_a_read_is_served_alike_by_the_native_loop_and_by_python(
    nodes: Callable[..., DataNode], count: int
) -> None:
    """Up to SERVE_MAX_COUNT entries a READ is served in C, past it in Python: the same
    statuses (accepted, unknown region, bad rkey, out of bounds), bytes and counters."""
    node = nodes()
    endpoint = local_endpoint(node)
    region = endpoint.regions[0]
    data = os.urandom(4096)
    client = open_client("tcp", endpoint, token=_KEY)
    try:
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
    finally:
        client.close()
    kinds = [
        (region.region, region.rkey, 100, 50, 0),  # accepted
        (region.region + 77, region.rkey, 0, 8, 1),  # unknown region
        (region.region, region.rkey ^ 1, 0, 8, 2),  # bad rkey
        (region.region, region.rkey, region.size - 4, 8, 3),  # out of bounds
    ]
    entries = [kinds[i % 4] for i in range(count)]
    before = _stats(node)
    with connect(endpoint, _KEY) as sock:
        table = b"".join(ENTRY.pack(r, k, o, n) for r, k, o, n, _ in entries)
        sock.sendall(frame(Op.READ, count, rid=9) + table)
        reply = recv_exactly(sock, HEADER.size + count)
        accepted = sum(1 for *_, status in entries if status == 0)
        payload = recv_exactly(sock, 50 * accepted)
        assert reply[: HEADER.size] == frame(Op.READ, count, rid=9)
        assert reply[HEADER.size :] == bytes(status for *_, status in entries)
        assert payload == data[100:150] * accepted
    after = _stats(node)
    assert after["requests"] - before["requests"] == 1
    assert after["frames"] - before["frames"] == 1
    assert after["segments_read"] - before["segments_read"] == accepted
    assert after["bytes_read"] - before["bytes_read"] == 50 * accepted
    assert after["refused_segments"] - before["refused_segments"] == count - accepted


def test_a_small_read_adding_up_to_too_much_is_refused_and_the_node_serves_on(
    nodes: Callable[..., DataNode],
) -> None:
    node = nodes()
    endpoint = local_endpoint(node)
    region = endpoint.regions[0]
    with connect(endpoint, _KEY) as sock:
        huge = ENTRY.pack(region.region, region.rkey, 0, 1 << 40)
        sock.sendall(frame(Op.READ, 2) + huge + huge)
        assert recv_until_closed(sock)[: HEADER.size] == frame(Op.READ, 0, 0, code=Code.TOO_LARGE)
    assert _stats(node)["bad_frames"] == 1
    assert round_trip_works("tcp", endpoint, token=_KEY)


# -- what the wire shows -----------------------------------------------------------------------


@pytest.fixture
def derived_key() -> tuple[bytes, bytes]:
    """A deployment's secret and the tcp key derived from it (as the CLI derives it)."""
    secret = b"correct horse battery staple " + os.urandom(8).hex().encode()
    return secret, Credentials.from_secret(secret).data_token


def test_neither_the_secret_nor_its_key_ever_crosses_the_wire(
    nodes: Callable[..., DataNode], derived_key: tuple[bytes, bytes]
) -> None:
    secret, key = derived_key
    node = nodes(token=key)
    endpoint = local_endpoint(node)
    proxy = Proxy(address(endpoint))
    client = open_client("tcp", proxy.endpoint_for(endpoint), token=key)
    try:
        data = os.urandom(4096)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        dest = bytearray(4096)
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == data
    finally:
        client.close()
        proxy.close()
    wire = bytes(proxy.client_bytes + proxy.node_bytes)
    assert data in wire  # the capture saw the session (plain tcp: payloads are readable)
    for sensitive in (secret, key, key.hex().encode()):
        assert sensitive not in wire


def test_a_recorded_handshake_replayed_on_another_connection_is_refused(
    nodes: Callable[..., DataNode], derived_key: tuple[bytes, bytes]
) -> None:
    _, key = derived_key
    node = nodes(token=key)
    endpoint = local_endpoint(node)
    handle = endpoint.regions[0]
    proxy = Proxy(address(endpoint))
    try:
        assert round_trip_works("tcp", proxy.endpoint_for(endpoint), token=key)
    finally:
        proxy.close()
    recorded = bytes(proxy.client_bytes)
    assert HEADER.unpack_from(recorded)[2] == Op.HELLO
    failures = _stats(node)["auth_failures"]
    # Replayed alone, and replayed whole with a read of the region behind it.
    for replay in (
        recorded[: HEADER.size + HELLO_SIZE],
        recorded + frame(Op.READ, 1) + ENTRY.pack(handle.region, handle.rkey, 0, 4096),
    ):
        with socket.create_connection(address(endpoint)) as sock:
            sock.sendall(replay)
            received = recv_until_closed(sock)
        assert HEADER.unpack_from(received, HEADER.size + GREETING_SIZE)[3] == Code.AUTH_FAILED
        assert len(received) == HEADER.size + GREETING_SIZE + HEADER.size  # nothing else
    assert _stats(node)["auth_failures"] == failures + 2


def test_a_client_refuses_a_node_that_cannot_prove_it_holds_the_secret(
    nodes: Callable[..., DataNode],
) -> None:
    """An impostor on the node's address that waves every client through (it cannot check
    their proofs) gets no request: its own proof is wrong."""
    real = local_endpoint(nodes())
    handle = real.regions[0]
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            body = bytes([0]) + os.urandom(32)
            conn.sendall(frame(Op.GREETING, len(body), 0) + body)
            recv_exactly(conn, HEADER.size + HELLO_SIZE)
            conn.sendall(frame(Op.HELLO, 32, 0) + os.urandom(32))  # "OK", and a made-up proof
            received.append(recv_until_closed(conn))

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    fake = NodeEndpoint(
        node=1,
        transport="tcp",
        address=f"127.0.0.1:{listener.getsockname()[1]}".encode(),
        regions=real.regions,
    )
    client = open_client("tcp", fake, token=_KEY)
    try:
        with pytest.raises(TransportError, match="could not prove"):
            client.write(1, [Segment(handle.region, handle.rkey, 0, memoryview(b"x" * 64))])
    finally:
        client.close()
        thread.join(PATIENT)
        listener.close()
    assert received == [b""]  # the client hung up without sending a frame


def test_a_busy_poll_over_a_millisecond_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match=r"tcp\.busy_poll is at most 1ms"):
        local_node(_KEY, busy_poll="5ms")
