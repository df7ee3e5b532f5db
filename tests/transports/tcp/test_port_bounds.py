"""Every data port, and the controller's image port, bounds a frame's memory before trusting it.

One test per port, each on a real server process: a hostile client sends frames that claim
(or carry) far more than any honest request — a header counting 2^32 - 1 entries, a write
of 256 MiB to a region that does not exist or may not be written — and the process's peak
resident memory (``VmHWM`` in /proc) grows by less than a generous bound, while an honest
client is served right after. (The controller's own port: tests/distributed.) The ``shm``
transport has no port: a client maps the node's memory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import uuid

import pytest
from tcp_raw import ENTRY, address, connect, frame, recv_exactly, recv_until_closed

import kvfabric
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._plugins import plugin_manager
from kvfabric.errors import KvfabricError
from kvfabric.keys import chain_keys
from kvfabric.spi import NodeEndpoint
from kvfabric.testing import Cluster, RegionServer, round_trip_works
from kvfabric.transports.tcp.wire import HEADER, Op

_GROWTH_BOUND_MIB = 64.0
_HUGE = 256 << 20
_CHUNK = bytes(1 << 20)


def _peak_mib(pid: int) -> float:
    """A process's peak resident memory (``VmHWM`` in /proc), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def _send_huge(sock: socket.socket) -> None:
    """Send 256 MiB of payload (sendall returns once the server took it all)."""
    sock.settimeout(60)
    for _ in range(_HUGE // len(_CHUNK)):
        sock.sendall(_CHUNK)


def _tcp_attack(endpoint: NodeEndpoint) -> None:
    """Oversize tcp frames: before the handshake, a header claiming 2^32 - 1 bytes; after
    it, a READ of 2^32 - 1 entries, and a WRITE of 256 MiB to region 999 (refused, read
    through a scratch buffer)."""
    with socket.create_connection(address(endpoint), timeout=30) as sock:
        sock.sendall(frame(Op.HELLO, 0xFFFFFFFF))
        recv_until_closed(sock)
    with connect(endpoint) as sock:
        sock.sendall(frame(Op.READ, 0xFFFFFFFF))
        assert len(recv_until_closed(sock)) == HEADER.size  # an error reply, then closed
    with connect(endpoint) as sock:
        sock.sendall(frame(Op.WRITE, 1) + ENTRY.pack(999, 1, 0, _HUGE))
        _send_huge(sock)


def test_the_tcp_data_port_bounds_oversize_frames() -> None:
    server = RegionServer("tcp")
    try:
        before = _peak_mib(server.process.pid)
        _tcp_attack(server.endpoint)
        assert round_trip_works("tcp", server.endpoint)
        after = _peak_mib(server.process.pid)
    finally:
        server.close()
    print(f"\ntcp node peak RSS {before:.0f} MiB -> {after:.0f} MiB")
    assert after - before < _GROWTH_BOUND_MIB


def test_the_image_port_bounds_oversize_frames() -> None:
    """The lookup image over tcp is served by a child of the controller: the same bounds
    hold there, and lookups stay one-sided."""
    with Cluster(nodes=1, transports=("tcp",)) as cluster, kvfabric.connect(cluster.url()) as store:
        keys = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
        store.batched_put(keys, [b"v"] * 32)
        client = ControlClient(cluster.endpoint, timeout=5.0)
        try:
            location = RemoteIndex(client).image_location()
        finally:
            client.close()
        assert location is not None
        endpoint = next(e for e in location.endpoints if e.transport == "tcp")
        (pid,) = cluster.image_server_pids()
        before = _peak_mib(pid)
        _tcp_attack(endpoint)
        onesided = store.stats()["onesided_lookups"]
        assert store.batched_contains(keys) == 32
        assert store.stats()["onesided_lookups"] == onesided + 1
        after = _peak_mib(pid)
    print(f"\nimage server peak RSS {before:.0f} MiB -> {after:.0f} MiB")
    assert after - before < _GROWTH_BOUND_MIB


_EXAMPLE_REQUEST = struct.Struct("<BI")


def test_the_example_transport_port_bounds_oversize_frames() -> None:
    """The worked example a third party copies bounds what it reads too: a count past its
    limit closes the connection before anything is allocated for it, and a refused write's
    bytes are drained through a bounded buffer."""
    server = RegionServer("example")
    try:
        before = _peak_mib(server.process.pid)
        with socket.create_connection(address(server.endpoint), timeout=30) as sock:
            sock.sendall(_EXAMPLE_REQUEST.pack(2, 0xFFFFFFFF))
            assert recv_until_closed(sock) == b""
        with socket.create_connection(address(server.endpoint), timeout=30) as sock:
            sock.sendall(_EXAMPLE_REQUEST.pack(2, 1) + ENTRY.pack(999, 1, 0, _HUGE))
            _send_huge(sock)
            assert recv_exactly(sock, 1) != b"\x00"  # its one status: refused
        assert round_trip_works("example", server.endpoint)
        after = _peak_mib(server.process.pid)
    finally:
        server.close()
    print(f"\nexample node peak RSS {before:.0f} MiB -> {after:.0f} MiB")
    assert after - before < _GROWTH_BOUND_MIB


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its socket inodes matched in /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_ucx_port_bounds_oversize_frames() -> None:
    """UCX speaks its own wire (kvfabric reads no length from a ucx peer): what the node's
    UCX listens on is sent a header of all ones and 256 MiB of garbage, and drops it."""
    try:
        plugin_manager().transport("ucx").check_available()
    except KvfabricError as exc:
        pytest.skip(f"ucx is not usable here: {exc}")
    server = RegionServer("ucx")
    try:
        before = _peak_mib(server.process.pid)
        for port in _listening_ports(server.process.pid):
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
            ):
                sock.sendall(b"\xff" * 64)
                _send_huge(sock)
        assert server.process.poll() is None
        assert round_trip_works("ucx", server.endpoint)
        after = _peak_mib(server.process.pid)
    finally:
        server.close()
    print(f"\nucx node peak RSS {before:.0f} MiB -> {after:.0f} MiB")
    assert after - before < _GROWTH_BOUND_MIB


@pytest.mark.parametrize("transport", ["tcp", "example"])
def test_a_port_serves_honest_clients_after_many_oversize_claims(transport: str) -> None:
    """Claims alone (headers, no payload) on many connections cost nothing either."""
    server = RegionServer(transport)
    try:
        before = _peak_mib(server.process.pid)
        for _ in range(64):
            with socket.create_connection(address(server.endpoint), timeout=30) as sock:
                if transport == "tcp":
                    sock.sendall(frame(Op.HELLO, 0xFFFFFFFF))
                else:
                    sock.sendall(_EXAMPLE_REQUEST.pack(1, 0xFFFFFFFF))
                recv_until_closed(sock)
        assert round_trip_works(transport, server.endpoint)
        after = _peak_mib(server.process.pid)
    finally:
        server.close()
    assert after - before < _GROWTH_BOUND_MIB
