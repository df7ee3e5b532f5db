"""Faults with real processes: dead and stalled nodes, a dead controller, secrets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._runtime.image import IMAGE_NODE
from kvfabric.keys import chain_keys
from kvfabric.spi import Segment, TransportConfig
from kvfabric.testing import Cluster, free_port, wait_for
from kvfabric.transports.tcp import TcpTransport


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _as_bytes(values: list[memoryview | None]) -> list[bytes | None]:
    return [bytes(v) if v is not None else None for v in values]


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp",)) as c:
        yield c


def _by_node(cluster: Cluster, store: Store, keys: list[bytes]) -> dict[str, list[int]]:
    client = ControlClient(cluster.endpoint, timeout=2.0)
    try:
        names = {n.id: n.name for n in RemoteIndex(client).nodes()}
    finally:
        client.close()
    out: dict[str, list[int]] = {}
    for i, d in enumerate(store.locate(keys)):
        assert d is not None
        out.setdefault(names[d.node], []).append(i)
    return out


def test_killing_a_node_during_a_get_gives_misses_in_time_and_the_rest_keeps_working(
    two_nodes: Cluster,
) -> None:
    with kvfabric.connect(two_nodes.url(timeout="1s")) as store:
        keys = _keys(32)
        values = [os.urandom(1 << 20) for _ in keys]
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 32
        placement = _by_node(two_nodes, store, keys)
        assert set(placement) == {"node0", "node1"}
        assert store.batched_contains(keys) == 32

        # Freeze node0 so the get is certainly in flight when it dies.
        two_nodes.signal_node(0, signal.SIGSTOP)
        result: list[list[memoryview | None]] = []
        reader = threading.Thread(target=lambda: result.append(store.batched_get(keys)))
        gets = store.stats()["gets"]
        started = time.monotonic()
        reader.start()
        # The get has started: its reads (of descriptors the lookup above left) go to the
        # frozen node and wait there for the 1 s timeout.
        wait_for("the get started", lambda: store.stats()["gets"], until=lambda n: n > gets)
        two_nodes.kill_node(0)
        reader.join(timeout=30)  # the bound catches a hang, not slowness
        assert not reader.is_alive()
        print(f"\nget with a node killed mid-read: {time.monotonic() - started:.2f}s (timeout 1s)")
        got = _as_bytes(result[0])
        for i in placement["node0"]:
            assert got[i] is None
        for i in placement["node1"]:
            assert got[i] == values[i]

        # The controller drops the dead node and its entries after missed heartbeats.
        wait_for(
            "the dead node dropped", two_nodes.node_names, until=lambda names: names == ["node1"]
        )
        assert store.batched_exists([keys[i] for i in placement["node0"]]) == [False] * len(
            placement["node0"]
        )

        # The same client goes on with the surviving node.
        fresh = _keys(8)
        fresh_values = [os.urandom(4096) for _ in fresh]
        assert store.batched_put(fresh, fresh_values) == [PutOutcome.STORED] * 8
        assert store.batched_contains(fresh) == 8
        assert _as_bytes(store.batched_get(fresh)) == fresh_values


def test_a_stalled_node_turns_reads_into_misses_within_the_timeout(two_nodes: Cluster) -> None:
    with kvfabric.connect(two_nodes.url(timeout="500ms")) as store:
        keys = _keys(16)
        values = [os.urandom(50_000) for _ in keys]
        store.batched_put(keys, values)
        placement = _by_node(two_nodes, store, keys)
        two_nodes.signal_node(1, signal.SIGSTOP)
        try:
            started = time.monotonic()
            got = _as_bytes(store.batched_get(keys))
            print(f"\nget with a stalled node: {time.monotonic() - started:.2f}s (timeout 0.5s)")
            assert all(got[i] is None for i in placement["node1"])
            assert all(got[i] == values[i] for i in placement["node0"])
        finally:
            two_nodes.signal_node(1, signal.SIGCONT)
        # Running again (SIGCONT resumes it before kill() returns), a read gets everything
        # once the client's hold-off of the node is over and a probe finds it answering
        # (if it was not dropped meanwhile; test_node_backoff.py counts each step).
        if two_nodes.node_names() == ["node0", "node1"]:
            wait_for(
                "the resumed node read again",
                lambda: _as_bytes(store.batched_get(keys)) == values,
                every=0.1,
            )


def test_controller_restart_gives_misses_meanwhile_then_the_same_client_hits_again() -> None:
    with Cluster(nodes=1, transports=("tcp", "shm")) as cluster:
        # Lookups by RPC: with the lookup image they answer from it for a moment after the
        # crash (test_onesided_lookup.py covers that).
        url = cluster.url(control_timeout="300ms", retry_interval="200ms", lookup_image="0")
        with kvfabric.connect(url) as store:
            keys = _keys(10)
            values = [os.urandom(2048) for _ in keys]
            store.batched_put(keys, values)
            assert store.batched_contains(keys) == 10

            cluster.kill_controller()
            started = time.monotonic()
            assert store.batched_contains(keys) == 0
            assert store.batched_put(_keys(2), [b"a", b"b"]) == [PutOutcome.FAILED] * 2
            assert store.batched_exists(keys) == [False] * 10
            print(f"\nthree calls with the controller dead: {time.monotonic() - started:.2f}s")

            cluster.start_controller()
            cluster.wait_nodes(1)  # the node re-registers with the new controller by itself
            fresh = _keys(6)
            fresh_values = [os.urandom(1000) for _ in fresh]
            wait_for(
                "puts stored again",
                lambda: store.batched_put(fresh, fresh_values),
                until=lambda outcomes: outcomes == [PutOutcome.STORED] * 6,
                every=0.1,
            )
            assert store.batched_contains(fresh) == 6
            assert _as_bytes(store.batched_get(fresh)) == fresh_values
            # The new controller rebuilt its index from the node's records: the keys stored
            # before the crash hit again, with their own bytes.
            assert store.batched_contains(keys) == 10
            assert _as_bytes(store.batched_get(keys)) == values


def test_a_node_joining_later_is_used_by_existing_clients() -> None:
    with Cluster(nodes=1, transports=("tcp",)) as cluster, kvfabric.connect(cluster.url()) as store:
        store.batched_put(_keys(4), [b"x"] * 4)
        cluster.add_node()
        cluster.wait_nodes(2)
        # The client learns of the new node from the next reply it gets (this put's, which
        # may still go to the node it writes to through its extent); puts after it spread.
        first = _keys(10)
        assert store.batched_put(first, [b"y"] * 10) == [PutOutcome.STORED] * 10
        keys = _keys(100)
        values = [os.urandom(3000) for _ in keys]
        store.batched_put(keys, values)
        assert set(_by_node(cluster, store, keys)) == {"node0", "node1"}
        assert _as_bytes(store.batched_get(keys)) == values


def test_a_shared_secret_admits_clients_that_know_it_and_only_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = b"correct horse battery staple"
    with Cluster(nodes=1, transports=("tcp",), secret=secret) as cluster:
        monkeypatch.setenv("KVFABRIC_SECRET", secret.decode())
        with kvfabric.connect(cluster.url(transport="tcp")) as store:
            keys = _keys(3)
            values = [b"one", b"two", b"three"]
            assert store.batched_put(keys, values) == [PutOutcome.STORED] * 3
            assert store.batched_contains(keys) == 3
            assert _as_bytes(store.batched_get(keys)) == values
        monkeypatch.setenv("KVFABRIC_SECRET", "a wrong guess")
        with kvfabric.connect(cluster.url(control_timeout="300ms")) as intruder:
            assert intruder.batched_contains(keys) == 0
            assert intruder.batched_put(keys, values) == [PutOutcome.FAILED] * 3
        monkeypatch.delenv("KVFABRIC_SECRET")
        with kvfabric.connect(cluster.url(control_timeout="300ms")) as anonymous:
            assert anonymous.batched_contains(keys) == 0


def test_serve_runs_controller_and_node_in_one_process() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfabric._tools.cli",
            "serve",
            "--listen",
            f"tcp://127.0.0.1:{port}",
            "--capacity",
            "64MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"connect with kvfabric://127.0.0.1:{port}" in line
        with kvfabric.connect(f"kvfabric://127.0.0.1:{port}") as store:
            keys = _keys(5)
            values = [os.urandom(777) for _ in keys]
            store.batched_put(keys, values)
            assert store.batched_contains(keys) == 5
            assert _as_bytes(store.batched_get(keys)) == values
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_serve_lends_its_node_servers_to_the_image_read_only() -> None:
    """In ``serve`` the node's tcp server serves the lookup image in-process: a write sent
    to the image (a client holding the data-plane secret, none here) is refused."""
    port = free_port()
    command = ["serve", "--listen", f"tcp://127.0.0.1:{port}", "--capacity", "64MiB"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfabric._tools.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "lookup image over" in proc.stdout.readline()
        control = ControlClient(f"tcp://127.0.0.1:{port}", timeout=5.0)
        try:
            location = RemoteIndex(control).image_location()
        finally:
            control.close()
        assert location is not None
        endpoint = next(e for e in location.endpoints if e.transport == "tcp")
        handle = endpoint.regions[0]
        client = TcpTransport.create_client(TransportConfig(timeout=5.0))
        try:
            client.connect(endpoint)
            seg = Segment(handle.region, handle.rkey, 0, memoryview(bytes(64)))
            (error,) = client.write(IMAGE_NODE, [seg])
        finally:
            client.close()
        assert error is not None
        assert "read-only" in str(error)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_a_node_stopped_with_sigterm_deregisters_and_its_entries_go_at_once() -> None:
    # With a 60 s heartbeat timeout, only the node's own deregistration can remove it within
    # the bound below.
    with Cluster(nodes=2, transports=("tcp",), controller_args=["--node-timeout", "60s"]) as c:
        with kvfabric.connect(c.url()) as store:
            keys = _keys(40)
            store.batched_put(keys, [os.urandom(1000) for _ in keys])
            placement = _by_node(c, store, keys)
            assert set(placement) == {"node0", "node1"}
            c.signal_node(0, signal.SIGTERM)
            assert c.nodes[0] is not None
            assert c.nodes[0].popen.wait(timeout=30) == 0
            names = c.node_names()
            assert names == ["node1"]
            gone = [keys[i] for i in placement["node0"]]
            kept = [keys[i] for i in placement["node1"]]
            assert store.batched_exists(gone) == [False] * len(gone)
            assert store.batched_exists(kept) == [True] * len(kept)
        controller = c.stats()["controller"]
        assert controller["nodes_deregistered"] == 1
        assert controller["nodes_dropped"] == 0
