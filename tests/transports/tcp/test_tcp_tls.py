"""TLS on the tcp data plane (``tcp.tls=true``): what it hides and what it refuses.

Nodes run in-process (real sockets) where a test reads their counters or puts a proxy in
front of them; the store test runs real controller and node processes. Certificates come
from the ``tls_files`` fixture (made with the openssl command).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tcp_raw import Proxy, TlsFiles, address, local_endpoint, local_node

import kvfabric
from kvfabric import PutOutcome
from kvfabric._node.node import DataNode
from kvfabric.errors import ConfigError, TransportError
from kvfabric.keys import chain_keys
from kvfabric.spi import NodeEndpoint, TransportClient, TransportConfig
from kvfabric.testing import Cluster, segment_for, wait_for
from kvfabric.transports.tcp import TcpTransport

_KEY = b"secret"
_SIZE = 64 * 1024
# Well past the handshake (a few KiB with TLS, 113 bytes without) and the write's reply:
# inside the payload of the read that follows.
_FLIP_AT = 40_000


@pytest.fixture
def tls_node(tls_files: TlsFiles) -> Iterator[DataNode]:
    node = local_node(_KEY, tls="true", tls_cert=str(tls_files.cert), tls_key=str(tls_files.key))
    yield node
    node.close()


def _client(endpoint: NodeEndpoint, *, key: bytes = _KEY, **options: str) -> TransportClient:
    config = TransportConfig(timeout=10.0, token=key, options=TcpTransport.parse_options(options))
    client = TcpTransport.create_client(config)
    client.connect(endpoint)
    return client


def _write_then_read(client: TransportClient, endpoint: NodeEndpoint, data: bytes) -> bytearray:
    assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
    dest = bytearray(len(data))
    assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
    return dest


def test_over_tls_the_wire_shows_neither_the_payload_nor_the_key(
    tls_node: DataNode, tls_files: TlsFiles
) -> None:
    endpoint = local_endpoint(tls_node)
    proxy = Proxy(address(endpoint))
    client = _client(proxy.endpoint_for(endpoint), tls="true", tls_ca=str(tls_files.cert))
    data = os.urandom(_SIZE)
    try:
        assert _write_then_read(client, endpoint, data) == data
    finally:
        client.close()
        proxy.close()
    wire = bytes(proxy.client_bytes + proxy.node_bytes)
    assert len(wire) > 2 * _SIZE  # the session went through the proxy...
    assert data[:64] not in wire  # ...encrypted
    assert _KEY not in wire
    assert tls_node.servers["tcp"].stats()["handshakes"] == 1


def test_a_client_without_tls_is_told_the_node_requires_it(tls_node: DataNode) -> None:
    endpoint = local_endpoint(tls_node)
    client = _client(endpoint)
    try:
        with pytest.raises(TransportError, match="requires TLS"):
            client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))])
    finally:
        client.close()


def test_a_tls_client_refuses_a_node_that_does_not_offer_it(tls_files: TlsFiles) -> None:
    node = local_node(_KEY)
    try:
        endpoint = local_endpoint(node)
        client = _client(endpoint, tls="true", tls_ca=str(tls_files.cert))
        try:
            with pytest.raises(TransportError, match="does not offer TLS"):
                client.write(1, [segment_for(endpoint, 0, 0, b"x" * 8)])
        finally:
            client.close()
        assert node.servers["tcp"].stats()["requests"] == 0
    finally:
        node.close()


def test_a_node_presenting_a_certificate_the_client_does_not_trust_is_refused(
    tls_files: TlsFiles,
) -> None:
    """What a man in the middle with a certificate of its own would present."""
    stranger = local_node(
        _KEY, tls="true", tls_cert=str(tls_files.other_cert), tls_key=str(tls_files.other_key)
    )
    try:
        endpoint = local_endpoint(stranger)
        client = _client(endpoint, tls="true", tls_ca=str(tls_files.cert))
        try:
            with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
                client.write(1, [segment_for(endpoint, 0, 0, b"x" * 8)])
        finally:
            client.close()
        # The node sees the client's alert when its accept loop next runs.
        wait_for(
            "the failed handshake counted",
            lambda: stranger.servers["tcp"].stats()["tls_failures"] == 1,
        )
        stats = stranger.servers["tcp"].stats()
        assert (stats["handshakes"], stats["requests"]) == (0, 0)
    finally:
        stranger.close()


def _flip(offset: int, chunk: bytes) -> bytes:
    """A man in the middle: one bit of the node's stream at ``_FLIP_AT`` inverted."""
    if offset <= _FLIP_AT < offset + len(chunk):
        i = _FLIP_AT - offset
        return chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1 :]
    return chunk


def _read_through_flipping_proxy(
    endpoint: NodeEndpoint, data: bytes, **options: str
) -> Callable[[], bytearray]:
    """Write ``data`` directly, then a read of it through a proxy that flips one bit."""
    direct = _client(endpoint, **options)
    try:
        assert direct.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
    finally:
        direct.close()

    def read() -> bytearray:
        proxy = Proxy(address(endpoint), transform=_flip)
        client = _client(proxy.endpoint_for(endpoint), **options)
        try:
            # A write first, so the flipped bit falls in the read's reply on any link.
            assert client.write(1, [segment_for(endpoint, 1, 0, b"w" * 16)]) == [None]
            dest = bytearray(len(data))
            assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
            return dest
        finally:
            client.close()
            proxy.close()

    return read


def test_with_tls_bytes_altered_in_flight_are_never_delivered(
    tls_node: DataNode, tls_files: TlsFiles
) -> None:
    endpoint = local_endpoint(tls_node)
    data = os.urandom(_SIZE)
    read = _read_through_flipping_proxy(endpoint, data, tls="true", tls_ca=str(tls_files.cert))
    with pytest.raises(TransportError):  # TLS: the record's authentication tag fails
        read()


def test_without_tls_bytes_altered_in_flight_are_delivered(tls_files: TlsFiles) -> None:
    """The threat docs/security.md names for plain tcp: an attacker on the path can alter a
    payload and the transport cannot tell (the store's CRC32C is not a MAC)."""
    node = local_node(_KEY)
    try:
        endpoint = local_endpoint(node)
        data = os.urandom(_SIZE)
        landed = _read_through_flipping_proxy(endpoint, data)()
        assert landed != data
        assert sum(a != b for a, b in zip(landed, data, strict=True)) == 1
    finally:
        node.close()


def test_tls_options_are_checked_when_given(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        TcpTransport.parse_options({"tls_ca": str(tmp_path / "missing.pem")})
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="no usable CA"):
        TcpTransport.parse_options({"tls_ca": str(tmp_path / "junk.pem")})
    with pytest.raises(ConfigError, match="tls_cert"):
        TcpTransport.create_server(TransportConfig(options={"tls": "true"}))


def _tls_server_args(tls_files: TlsFiles) -> list[str]:
    """What a node or controller is given on its command line to serve tcp over TLS."""
    return [
        "--transport-opt",
        "tcp.tls=true",
        "--transport-opt",
        f"tcp.tls_cert={tls_files.cert}",
        "--transport-opt",
        f"tcp.tls_key={tls_files.key}",
    ]


@pytest.mark.slow
def test_a_store_over_tls_with_a_secret_round_trips_between_real_processes(
    tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_args = _tls_server_args(tls_files)
    keys = chain_keys(list(range(8)), 1, namespace=os.urandom(16))
    values = [os.urandom(100_000) for _ in keys]
    monkeypatch.setenv("KVFABRIC_SECRET", "s3cret")
    with Cluster(
        nodes=1, transports=("tcp",), capacity="64MiB", node_args=node_args, secret=b"s3cret"
    ) as cluster:
        tls = {"tcp.tls": "true", "tcp.tls_ca": str(tls_files.cert)}
        # The timeout bounds a hang, not the machine's speed (TLS on a busy 2-core host).
        url = cluster.url(transport="tcp", timeout="30s", **tls)
        with kvfabric.connect(url) as store:
            assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
            assert store.batched_get(keys) == values
        # Without TLS the node refuses the client: every get is a miss, never wrong bytes.
        with kvfabric.connect(cluster.url(transport="tcp")) as plain:
            assert plain.batched_get(keys) == [None] * len(keys)


@pytest.mark.slow
def test_a_controller_over_tls_serves_its_lookup_image_over_tls_from_its_image_process(
    tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's process gets the controller's transport settings (TLS, the secret): a
    TLS client looks up one-sided through it, a plain one is refused and asks by RPC."""
    tls_args = _tls_server_args(tls_files)
    keys = chain_keys(list(range(8)), 1, namespace=os.urandom(16))
    monkeypatch.setenv("KVFABRIC_SECRET", "s3cret")
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity="64MiB",
        node_args=tls_args,
        controller_args=["--transport", "tcp", *tls_args],
        secret=b"s3cret",
    ) as cluster:
        assert len(cluster.image_server_pids()) == 1
        tls = {"tcp.tls": "true", "tcp.tls_ca": str(tls_files.cert)}
        url = cluster.url(transport="tcp", timeout="30s", **tls)
        with kvfabric.connect(url) as store:
            store.batched_put(keys, [os.urandom(1000) for _ in keys])
            store.batched_contains(keys)  # the mirror catches up with the put
            before = store.stats()
            assert store.batched_contains(keys) == len(keys)
            after = store.stats()
        assert after["control_rpcs"] == before["control_rpcs"]
        assert after["onesided_lookups"] - before["onesided_lookups"] == 1
        with kvfabric.connect(cluster.url(transport="tcp")) as plain:
            assert plain.batched_contains(keys) == len(keys)  # by RPC
            assert plain.stats()["onesided_lookups"] == 0
