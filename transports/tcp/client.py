"""The ``tcp`` client: a :class:`~kvfabric.spi.PeerClient` over pooled, authenticated
connections.

The peer table, segment checks and error mapping are inherited; what is tcp's own lives in
the modules beside this one: a connection and its frames (``connection``), the idle
connections kept per node (``pool``), and how a planned batch is cut into frames or lanes
and moved (``batches``). Every call is bounded by ``config.timeout`` as a whole,
connecting included.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence

from kvfabric.errors import ProtocolError, TransportError
from kvfabric.spi import (
    SOCKET_ERRORS,
    Batch,
    NodeEndpoint,
    PeerClient,
    Segment,
    TransportConfig,
)
from kvfabric.transports.tcp.batches import move
from kvfabric.transports.tcp.connection import Link, Refused
from kvfabric.transports.tcp.pool import Peer, on_connection
from kvfabric.transports.tcp.tuning import AUTO
from kvfabric.transports.tcp.wire import MAX_COUNT, Op

__all__ = ["TcpClient"]


class TcpClient(PeerClient[Peer]):
    # PeerClosed is a ConnectionError; Refused: the node answered with an error code, or
    # the handshake cannot succeed (TLS on one side only, a node without the secret).
    native_errors = {**SOCKET_ERRORS, ProtocolError: TransportError, Refused: TransportError}
    # A checksummed write checksums its payloads as they are sent and sends the records'
    # headers, made from those CRCs, after them in the same frame: one round trip, and no
    # pass over the payloads of its own for the CRCs.
    streams_trailers = True
    # A large put over two connections: the client's sending thread, copying and
    # checksumming, is what limits one (docs/performance.md).
    write_lanes = 2

    def __init__(
        self,
        config: TransportConfig,
        pool: int,
        tls: ssl.SSLContext | None,
        busy_poll: float,
        send_buffer: int = AUTO,
        read_lanes: int = 1,
    ) -> None:
        super().__init__(config)
        self._pool_size = pool
        self._link = Link(
            key=config.token,
            tls=tls,
            busy_poll=busy_poll,
            send_buffer=send_buffer,
            read_lanes=read_lanes,
        )

    def describe(self, endpoint: NodeEndpoint) -> str:
        return f"tcp: node {endpoint.node} at {endpoint.address.decode(errors='replace')}"

    def open_peer(self, endpoint: NodeEndpoint) -> Peer:
        return Peer(endpoint.address, self._pool_size, self._link)

    def close_peer(self, peer: Peer) -> None:
        peer.close()

    def read_segments(self, peer: Peer, batch: Batch) -> None:
        move(peer, Op.READ, batch)

    def write_segments(self, peer: Peer, batch: Batch) -> None:
        move(peer, Op.WRITE, batch)

    def read_small(self, node: int, segments: Sequence[Segment]) -> bool:
        """One frame, made here: no batch planned. The node checks each segment as it
        checks any (region, rkey, bounds) and lands only those it accepted; the buffers
        are the caller's, sized by it. Planning and framing a batch in Python would take
        a large share of a small image read, long enough for the lookup to outlast the
        node's spin and pay its wake-up too (docs/performance.md).
        """
        if len(segments) > MAX_COUNT:
            return super().read_small(node, segments)
        entry = self._entry(node)
        deadline = time.monotonic() + self.config.timeout
        with entry.boundary:
            return on_connection(
                entry.state, lambda conn: conn.read_small(segments, deadline), deadline
            )
