"""A ``tcp`` client's connections to one node: kept idle between calls, handed out one call at
a time.

Per node a client keeps a few idle connections (``tcp.pool``, default 8), so concurrent
calls do not serialize and the handshake is paid per connection, not per call. A
connection that failed or timed out is closed, never reused. A pooled connection the node
closed (it restarted, shut down, or closed it for idling) is retried once on a fresh one:
reads and writes are idempotent.

After ``os.fork()`` the child's copies of the idle connections are closed at once (closing a
copy closes only the child's descriptor: no FIN, no TLS close_notify, the parent's stream
goes on untouched), so no call of the child ever shares a stream with the parent, and a
node sees the parent's connection end when the parent ends it. A connection some parent
thread was using at that instant is left to the parent.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from kvfabric._runtime import forks
from kvfabric.errors import ProtocolError
from kvfabric.transports.tcp.connection import Connection, Link

__all__ = ["Peer", "on_connection", "on_connections"]

T = TypeVar("T")


def _parse_address(address: bytes) -> tuple[str, int]:
    host, sep, port = address.decode(errors="replace").rpartition(":")
    if not sep or not port.isdigit():
        raise ProtocolError(f"tcp: not a HOST:PORT address: {address!r}")
    return host.strip("[]"), int(port)


class Peer:
    """A node's address and its idle connections (the client's state per node)."""

    def __init__(self, raw: bytes, pool_size: int, link: Link) -> None:
        self.address = _parse_address(raw)
        self.link = link
        self._pool_size = pool_size
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        _peers.add(self)

    def take(self) -> Connection | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give_back(self, conn: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop_idle()

    def open(self, deadline: float) -> Connection:
        return Connection.open(self.address, self.link, deadline)

    def forget_inherited(self) -> None:
        """In a forked child, before any other thread runs: close this process's copies of
        the idle connections (never ``shutdown``, which would end the parent's stream too)
        and drop a lock some parent thread may have held."""
        idle, self._idle = self._idle, []
        self._lock = threading.Lock()
        for conn in idle:
            conn.close()


_peers: weakref.WeakSet[Peer] = weakref.WeakSet()


def _forget_inherited() -> None:
    for peer in list(_peers):
        peer.forget_inherited()


forks.in_child(_forget_inherited)


def on_connection(peer: Peer, work: Callable[[Connection], T], deadline: float) -> T:
    """``work`` on a pooled connection, or on a fresh one: :func:`on_connections` of one."""
    return on_connections(peer, 1, lambda conns: work(conns[0]), deadline)


def on_connections(
    peer: Peer, count: int, work: Callable[[list[Connection]], T], deadline: float
) -> T:
    """``work`` on ``count`` connections at once, pooled ones first, then fresh ones; they go
    back to the pool after it, or are closed if it raised (their stream states are
    unknown)."""
    conns: list[Connection] = []
    pooled = False
    try:
        while len(conns) < count:
            conn = peer.take()
            pooled |= conn is not None
            conns.append(conn if conn is not None else peer.open(deadline))
    except BaseException:
        for conn in conns:
            peer.give_back(conn)
        raise
    if pooled:
        try:
            return _run_all(peer, conns, work)
        except ConnectionError:
            # The node closed or reset a pooled connection (it restarted, shut down, or
            # closed it for idling): its idle siblings may be as stale. Reads and writes
            # are idempotent, so one retry on fresh connections is safe.
            peer.drop_idle()
        conns = []
    try:
        while len(conns) < count:
            conns.append(peer.open(deadline))
    except BaseException:
        for conn in conns:
            conn.close()
        raise
    return _run_all(peer, conns, work)


def _run_all(peer: Peer, conns: list[Connection], work: Callable[[list[Connection]], T]) -> T:
    try:
        result = work(conns)
    except BaseException:
        for conn in conns:
            conn.close()  # their stream states are unknown: never reuse them
        raise
    for conn in conns:
        peer.give_back(conn)
    return result
