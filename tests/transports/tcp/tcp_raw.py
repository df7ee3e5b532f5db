"""The tcp transport's wire spoken by hand, a proxy between a client and a node, a node
that answers as a test scripts it, in-process nodes given tcp options, and the TLS
certificates the ``tls_files`` fixture (conftest.py) makes.

For tests that send what a well-behaved client never would, or watch and alter what crosses
the wire. Frame layouts come from ``kvfabric.transports.tcp.wire`` and the handshake from
``kvfabric.transports.tcp.auth`` (the module docstrings there describe them).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import attrs

from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginOptions
from kvfabric.spi import BackendConfig, NodeEndpoint, TransportConfig
from kvfabric.transports.tcp.auth import (
    GREETING_SIZE,
    HELLO_SIZE,
    NONCE_SIZE,
    PROOF_SIZE,
    client_proof,
    new_nonce,
    pack_greeting,
    server_proof,
    unpack_greeting,
)
from kvfabric.transports.tcp.wire import ENTRY, HEADER, MAGIC, VERSION, Op

__all__ = [
    "ENTRY",
    "HEADER",
    "PATIENT",
    "Answer",
    "Proxy",
    "ScriptedNode",
    "TlsFiles",
    "address",
    "connect",
    "frame",
    "handshake",
    "hello_reply_code",
    "local_endpoint",
    "local_node",
    "recv_exactly",
    "recv_until_closed",
    "rss_mib",
]

# A bound only a hang reaches.
PATIENT = 30.0


@attrs.frozen(kw_only=True)
class TlsFiles:
    cert: Path
    """A self-signed certificate for 127.0.0.1 (its own CA: what clients trust)."""
    key: Path
    other_cert: Path
    """Another self-signed certificate for 127.0.0.1: a stranger's, trusted by nobody."""
    other_key: Path


def frame(op: int, count: int, rid: int = 1, *, version: int = VERSION, code: int = 0) -> bytes:
    return HEADER.pack(MAGIC, version, op, code, count, rid)


def address(endpoint: NodeEndpoint) -> tuple[str, int]:
    host, _, port = endpoint.address.decode().rpartition(":")
    return host, int(port)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    received = b""
    sock.settimeout(PATIENT)
    while len(received) < n:
        chunk = sock.recv(n - len(received))
        assert chunk, f"the node closed after {len(received)} of {n} bytes"
        received += chunk
    return received


def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the node sends before it closes (a hang fails on the socket timeout)."""
    sock.settimeout(PATIENT)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def hello_reply_code(sock: socket.socket, key: bytes = b"") -> int:
    """Read the greeting, send a HELLO proved with ``key``; the code of the node's reply
    (its proof is read too when the code is 0)."""
    greeting = recv_exactly(sock, HEADER.size + GREETING_SIZE)
    assert HEADER.unpack_from(greeting)[2] == Op.GREETING
    flags, nonce = unpack_greeting(greeting[HEADER.size :])
    client_nonce = new_nonce()
    proof = client_proof(key, flags, nonce, client_nonce)
    sock.sendall(frame(Op.HELLO, len(client_nonce) + len(proof), 0) + client_nonce + proof)
    code = int(HEADER.unpack(recv_exactly(sock, HEADER.size))[3])
    if code == 0:
        recv_exactly(sock, PROOF_SIZE)
    return code


def handshake(sock: socket.socket, key: bytes = b"") -> None:
    """The client's side of a plain handshake; asserts the node accepted it."""
    code = hello_reply_code(sock, key)
    assert code == 0, f"handshake refused with code {code}"


def connect(endpoint: NodeEndpoint, key: bytes = b"") -> socket.socket:
    """A raw socket to the node, past the handshake."""
    sock = socket.create_connection(address(endpoint), timeout=PATIENT)
    try:
        handshake(sock, key)
    except BaseException:
        sock.close()
        raise
    return sock


Transform = Callable[[int, bytes], bytes]
"""Rewrites a chunk of the node's bytes given its offset in the stream (for a man in the
middle); the identity by default."""


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of one node: records both directions of every
    connection, and may rewrite what the node sends (``transform``)."""

    def __init__(self, target: tuple[str, int], transform: Transform | None = None) -> None:
        self.target = target
        self.transform = transform
        self.client_bytes = bytearray()
        self.node_bytes = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def endpoint_for(self, endpoint: NodeEndpoint) -> NodeEndpoint:
        """``endpoint`` with the proxy's address in place of the node's."""
        return NodeEndpoint(
            node=endpoint.node,
            transport=endpoint.transport,
            address=f"127.0.0.1:{self.port}".encode(),
            regions=endpoint.regions,
        )

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept() (close() alone does not, on Linux).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(PATIENT)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            node = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, node]
            for src, dst, record, transform in (
                (client, node, self.client_bytes, None),
                (node, client, self.node_bytes, self.transform),
            ):
                thread = threading.Thread(
                    target=self._pump, args=(src, dst, record, transform), daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        record: bytearray,
        transform: Transform | None,
    ) -> None:
        offset = 0
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    record += chunk
                if transform is not None:
                    chunk = transform(offset, chunk)
                offset += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


Answer = Callable[[int, int, int, bytes], bytes | None]
"""What a :class:`ScriptedNode` sends for a frame, given its op, count, request id and
table: the bytes of its reply (then the node keeps serving), or None to close."""


class ScriptedNode:
    """A node on 127.0.0.1 that runs the real handshake (plain, under ``key``), reads each
    READ or WRITE frame whole (a WRITE's payloads too) and sends what ``answer`` returns
    (closing after an error reply, as a node does), for a client's side of replies no real
    node sends. One connection at a time (``concurrent``: each on a thread of its own, for
    a client that uses several at once); counts them."""

    def __init__(self, answer: Answer, key: bytes = b"", *, concurrent: bool = False) -> None:
        self.answer = answer
        self.key = key
        self.concurrent = concurrent
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}".encode()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def endpoint_like(self, endpoint: NodeEndpoint) -> NodeEndpoint:
        """``endpoint`` (its regions) at this node's address."""
        return attrs.evolve(endpoint, address=self.address)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(PATIENT)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            if self.concurrent:
                threading.Thread(target=self._serve_closing, args=(conn,), daemon=True).start()
            else:
                self._serve_closing(conn)

    def _serve_closing(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, AssertionError):
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        nonce = new_nonce()
        conn.sendall(frame(Op.GREETING, GREETING_SIZE, 0) + pack_greeting(0, nonce))
        hello = recv_exactly(conn, HEADER.size + HELLO_SIZE)[HEADER.size :]
        proof = server_proof(self.key, 0, nonce, hello[:NONCE_SIZE])
        conn.sendall(frame(Op.HELLO, PROOF_SIZE, 0) + proof)
        while head := conn.recv(HEADER.size, socket.MSG_WAITALL):
            _, _, op, _, count, rid = HEADER.unpack(head)
            table = recv_exactly(conn, count * ENTRY.size)
            if op == Op.WRITE:
                recv_exactly(conn, sum(e[3] for e in ENTRY.iter_unpack(table)))
            reply = self.answer(op, count, rid, table)
            if reply is None:
                return
            conn.sendall(reply)
            if HEADER.unpack_from(reply)[3]:
                return  # an error reply: a node closes after it


def rss_mib(pid: int) -> float:
    """Resident memory of a process (``VmRSS`` in /proc), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def local_node(token: bytes = b"", **options: str) -> DataNode:
    """An in-process node (real sockets) given ``tcp.NAME=VALUE`` options the way
    ``--transport-opt`` gives them, for tests that read its counters."""
    return DataNode.create(
        backend="dram",
        transports=["tcp"],
        backend_config=BackendConfig(capacity=8 << 20, region_size=4 << 20),
        transport_config=TransportConfig(token=token),
        plugin_options=PluginOptions({"tcp": options}),
    )


def local_endpoint(node: DataNode) -> NodeEndpoint:
    return attrs.evolve(next(e for e in node.info().endpoints if e.transport == "tcp"), node=1)
