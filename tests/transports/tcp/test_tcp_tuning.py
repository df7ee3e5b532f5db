"""``tcp.send_buffer``: a fixed 256 KiB send buffer to a peer on this host (``auto``), the
kernel's autotuning (``0``) or a size, on the client's connections (its writes) and the
node's (its reads).

What is asserted is what the kernel holds for each socket (``SO_SNDBUF``: Linux keeps
twice what it is given, capped at ``net.core.wmem_max``), never how fast bytes move: the
speed is in ``kvfabric bench`` and docs/performance.md.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from tcp_raw import local_endpoint, local_node

from kvfabric._plugins import plugin_manager
from kvfabric.errors import ConfigError
from kvfabric.spi import TransportClient, TransportConfig
from kvfabric.testing import segment_for
from kvfabric.transports.tcp import tuning
from kvfabric.transports.tcp.tuning import (
    AUTO,
    LOCAL_SEND_BUFFER,
    on_this_host,
    parse_send_buffer,
    tune,
)

_KEY = b"secret"


def _held(asked: int) -> int:
    """What Linux keeps for ``SO_SNDBUF=asked``."""
    wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
    return 2 * min(asked, wmem_max)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    yield client, server
    client.close()
    server.close()


def test_send_buffer_values_parse_and_oversize_ones_are_refused() -> None:
    assert parse_send_buffer("auto") == AUTO
    assert parse_send_buffer(" Auto ") == AUTO
    assert parse_send_buffer("0") == 0
    assert parse_send_buffer("1MiB") == 1 << 20
    assert parse_send_buffer(65536) == 65536
    with pytest.raises(ConfigError, match=r"tcp\.send_buffer is at most 64MiB"):
        parse_send_buffer("65MiB")
    with pytest.raises(ConfigError):
        parse_send_buffer("lots")


def test_a_loopback_peer_is_on_this_host_and_a_socket_without_one_is_not(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    assert on_this_host(client)
    assert on_this_host(server)
    unconnected = socket.socket()
    left, right = socket.socketpair()  # AF_UNIX: no IP address at either end
    try:
        assert not on_this_host(unconnected)
        assert not on_this_host(left)
    finally:
        for sock in (unconnected, left, right):
            sock.close()


def test_auto_fixes_a_local_connections_send_buffer_and_zero_leaves_it_to_the_kernel(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    untouched = server.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    tune(server, 0)
    assert server.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == untouched
    assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    tune(client, AUTO)
    assert client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == _held(LOCAL_SEND_BUFFER)
    tune(server, 1 << 20)
    assert server.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == _held(1 << 20)


def test_auto_leaves_a_remote_peers_buffer_to_the_kernel_faked_peer(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only loopback can be reached here: the remote peer is this pair, declared remote.
    client, _ = pair
    monkeypatch.setattr(tuning, "on_this_host", lambda sock: False)
    untouched = client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    tuning.tune(client, AUTO)
    assert client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == untouched
    tuning.tune(client, 1 << 20)  # a size is a size, remote or not
    assert client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == _held(1 << 20)


def _client(**options: str) -> TransportClient:
    cls = plugin_manager().transport("tcp")
    config = TransportConfig(timeout=5.0, token=_KEY, options=cls.parse_options(options))
    return cls.create_client(config)


def _client_send_buffers(client: TransportClient) -> list[int]:
    # The pooled connections of node 1 (reaching in: no interface exposes sockets).
    peer = client._peers[1].state  # type: ignore[attr-defined]
    return [conn.stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for conn in peer._idle]


def _node_send_buffers(node: object) -> list[int]:
    server = node.servers["tcp"]  # type: ignore[attr-defined]
    return [
        conn.stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        for conn in server._conns
        if conn.stream is not None
    ]


@pytest.mark.parametrize(
    ("node_option", "client_option", "node_held", "client_held"),
    [
        (None, None, _held(LOCAL_SEND_BUFFER), _held(LOCAL_SEND_BUFFER)),
        ("1MiB", "64KiB", _held(1 << 20), _held(64 << 10)),
    ],
)
def test_each_side_sets_its_connections_send_buffer_as_configured(
    node_option: str | None, client_option: str | None, node_held: int, client_held: int
) -> None:
    node = local_node(_KEY, **({"send_buffer": node_option} if node_option else {}))
    client = _client(**({"send_buffer": client_option} if client_option else {}))
    try:
        endpoint = local_endpoint(node)
        client.connect(endpoint)
        data = bytes(range(256)) * 4096  # 1 MiB: past both buffers
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        dest = bytearray(len(data))
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == data
        assert _client_send_buffers(client) == [client_held]
        assert _node_send_buffers(node) == [node_held]
    finally:
        client.close()
        node.close()


def test_autotuning_on_both_sides_fixes_no_buffer() -> None:
    node = local_node(_KEY, send_buffer="0")
    client = _client(send_buffer="0")
    try:
        endpoint = local_endpoint(node)
        client.connect(endpoint)
        data = bytes(range(256)) * 4096
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        dest = bytearray(len(data))
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == data
        # The kernel's own sizes, whatever it grew them to: not the ones auto fixes.
        assert _held(LOCAL_SEND_BUFFER) not in _client_send_buffers(client)
        assert _held(LOCAL_SEND_BUFFER) not in _node_send_buffers(node)
    finally:
        client.close()
        node.close()


def test_an_oversize_send_buffer_is_refused_at_node_start() -> None:
    with pytest.raises(ConfigError, match=r"tcp\.send_buffer is at most 64MiB"):
        local_node(_KEY, send_buffer="1GiB")
