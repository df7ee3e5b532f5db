"""The ``tcp`` client across a fork: the child closes its copies of the idle connections at
once (its descriptors only: no FIN, no TLS close_notify) and opens its own; the parent keeps
using the very connections it had, plain or TLS. Real node processes; children bounded
(``fork_children``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import TlsFiles
from fork_children import check_child, in_children, parent_still_whole, round_trip

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits
from kvfabric.transports.tcp.connection import Connection

_SECRET = "s3cret"


@pytest.fixture(params=["plain", "tls"])
def tcp_url(
    request: pytest.FixtureRequest, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A store URL over tcp to a real node and controller (both serving TLS for ``tls``),
    with a secret: the connections carry a handshake's state the child must not disturb."""
    tls = request.param == "tls"
    args: list[str] = []
    options = {"transport": "tcp", "timeout": "30s", "control_timeout": "30s"}
    if tls:
        for option in (
            "tcp.tls=true",
            f"tcp.tls_cert={tls_files.cert}",
            f"tcp.tls_key={tls_files.key}",
        ):
            args += ["--transport-opt", option]
        options |= {"tcp.tls": "true", "tcp.tls_ca": str(tls_files.cert)}
    monkeypatch.setenv("KVFABRIC_SECRET", _SECRET)
    # Room for every child's extents: a child exits without giving its extents back, so
    # each holds its lease (a sixteenth of the capacity at most, per node) until it runs
    # out; at 64 MiB leases could evict the parent's values while the test reads them.
    with Cluster(
        nodes=2,
        transports=("tcp",),
        capacity="256MiB",
        node_args=args,
        controller_args=["--transport", "tcp", *args],
        secret=_SECRET.encode(),
    ) as cluster:
        yield cluster.url(**options)


def _idle_connections(store: Store) -> list[Connection]:
    """The store's tcp client's idle connections, every node's and the lookup image's."""
    return _idle_of(store.records._routes._clients["tcp"])


def _idle_of(client: Any) -> list[Connection]:
    return [conn for entry in client._peers.values() for conn in entry.state._idle]


def _stored(store: Store) -> tuple[list[bytes], list[bytes]]:
    keys = chain_keys(list(range(128)), 1, namespace=uuid.uuid4().bytes)
    values = [os.urandom(20_000) for _ in keys]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
    assert store.batched_contains(keys) == len(keys)
    assert exact_hits(store, keys, values) == len(keys)
    return keys, values


def test_a_child_closes_only_its_copies_of_the_idle_connections(tcp_url: str) -> None:
    with kvfabric.connect(tcp_url) as store:
        keys, values = _stored(store)
        inherited = store.records._routes._clients["tcp"]
        idle = _idle_of(inherited)
        fds = [conn.stream.sock.fileno() for conn in idle]
        # The nodes' connections and the lookup image's.
        assert len(store.records._routes._clients["tcp"]._peers) == 3
        assert len(fds) >= 3

        def child() -> tuple[list[bool], int]:
            # Before the child does anything: its copies are closed already.
            closed = []
            for fd in fds:
                try:
                    os.fstat(fd)
                except OSError:
                    closed.append(True)
                else:
                    closed.append(False)
            return closed, len(_idle_of(inherited))

        for closed, left in in_children("os.fork", child, count=2):
            assert closed == [True] * len(fds)
            assert left == 0
        # The parent reads on the very connections it had: nothing ended them.
        assert exact_hits(store, keys, values) == len(keys)
        assert store.batched_contains(keys) == len(keys)
        assert {id(c) for c in idle} <= {id(c) for c in _idle_connections(store)}
        assert all(conn.stream.sock.fileno() == fd for conn, fd in zip(idle, fds, strict=True))
        parent_still_whole(store, keys, values)


def test_a_store_over_tcp_forked_works_in_the_children(tcp_url: str) -> None:
    with kvfabric.connect(tcp_url) as store:
        keys, values = _stored(store)
        idle = _idle_connections(store)
        for mechanism in ("os.fork", "multiprocessing"):
            for report in in_children(mechanism, lambda: round_trip(store, keys), count=2):
                check_child(report, values)
                assert report.transports == ["tcp"]
        parent_still_whole(store, keys, values)
        assert {id(c) for c in idle} <= {id(c) for c in _idle_connections(store)}
