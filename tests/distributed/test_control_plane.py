"""The controller as a real process: counted round trips, bad frames, stats, secrets."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import zmq

import kvfabric
from kvfabric import PutOutcome
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex, fetch_stats
from kvfabric._wire.member_bodies import write_deregister
from kvfabric._wire.protocol import (
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    MsgType,
    decode_header,
    encode,
)
from kvfabric.keys import chain_keys
from kvfabric.spi.index import NodeInfo
from kvfabric.testing import Cluster, free_port, wait_for


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp", "shm")) as c:
        yield c


def _nodes(cluster: Cluster) -> list[NodeInfo]:
    client = ControlClient(cluster.endpoint, timeout=2.0)
    try:
        return RemoteIndex(client).nodes()
    finally:
        client.close()


def _rpcs(cluster: Cluster) -> int:
    return cluster.stats()["controller"]["rpcs"]


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_contains_and_get_of_prefetched_keys_is_one_rpc_at_the_controller(
    cluster: Cluster, n: int
) -> None:
    # Lookups by RPC (one-sided ones cost the controller none: test_onesided_lookup.py).
    with kvfabric.connect(cluster.url(lookup_image="0")) as store:
        keys = _keys(n)
        values = [os.urandom(200) for _ in keys]
        store.batched_put(keys, values)
        before = _rpcs(cluster)
        assert store.batched_contains(keys) == n
        got = store.batched_get(keys)
        assert _rpcs(cluster) - before == 1
        assert [bytes(g) if g is not None else None for g in got] == values


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_put_is_at_most_two_rpcs_at_the_controller(cluster: Cluster, n: int) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(n)
        before = _rpcs(cluster)
        assert set(store.batched_put(keys, [b"v" * 100] * n)) == {PutOutcome.STORED}
        assert _rpcs(cluster) - before <= 2
        before = _rpcs(cluster)
        assert set(store.batched_put(keys, [b"v" * 100] * n)) == {PutOutcome.DEDUPLICATED}
        assert _rpcs(cluster) - before == 1


def test_writes_spread_over_nodes_and_reads_come_back_from_each(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(200)
        values = [os.urandom(10_000) for _ in keys]
        store.batched_put(keys, values)
        nodes = {d.node for d in store.locate(keys[:50]) if d is not None}
        assert len(nodes) == 2
        got = store.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == values


def test_same_host_nodes_are_read_over_shm_unless_tcp_is_forced(cluster: Cluster) -> None:
    keys = _keys(1)
    with (
        kvfabric.connect(cluster.url()) as auto,
        kvfabric.connect(cluster.url(transport="tcp")) as forced,
    ):
        auto.batched_put(keys, [b"x"])
        (descriptor,) = auto.locate(keys)
        assert descriptor is not None
        assert auto.batched_get(keys)[0] is not None
        assert forced.batched_get(keys)[0] is not None
        assert auto.records.transport_of(descriptor.node) == "shm"
        assert forced.records.transport_of(descriptor.node) == "tcp"


def _dealer(cluster: Cluster) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 2000
    sock.connect(cluster.endpoint)
    return sock


_BAD, _VERSION, _TYPE = ErrorCode.BAD_FRAME, ErrorCode.BAD_VERSION, ErrorCode.UNKNOWN_TYPE


def _frozen(cluster: Cluster) -> int:
    return cluster.stats()["controller"]["gc_frozen_objects"]


def _wait_frozen(cluster: Cluster, at_least: int) -> int:
    return wait_for(
        f"{at_least} objects frozen", lambda: _frozen(cluster), until=lambda n: n >= at_least
    )


def test_the_controller_freezes_its_entries_out_of_full_collections_and_frees_deleted_ones(
    cluster: Cluster,
) -> None:
    """A full collection walking every entry stalled the controller ~1 ms per thousand
    entries; entries are frozen out of it at the next tick, and deleting them still frees
    them (2,000 entries: at least one tracked object each)."""
    n = 2000
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(n)
        before = _wait_frozen(cluster, 1)
        assert set(store.batched_put(keys, [b"v" * 100] * n)) == {PutOutcome.STORED}
        frozen = _wait_frozen(cluster, before + n)
        assert frozen >= before + n
        assert store.delete(keys) == n
        # Freed once nothing holds them (a loop turn of the controller at most): wait for
        # the count rather than read it once.
        wait_for(
            f"the {n} deleted entries freed",
            lambda: _frozen(cluster),
            until=lambda now: now <= frozen - n,
        )


@pytest.mark.parametrize(
    ("frames", "code", "expect"),
    [
        ([b"garbage"], _BAD, "shorter than the header"),
        ([b"X" * 40], _BAD, "bad magic"),
        ([struct.pack("<4sHHQQQ", MAGIC, 99, 2, 7, 0, 0)], _VERSION, "protocol version"),
        ([encode(1234, 7)], _TYPE, "unknown message type"),
        ([encode(MsgType.LOOKUP_PREFIX, 7, struct.pack("<I", 5) + b"k" * 10)], _BAD, "not fit"),
        ([encode(MsgType.LOOKUP_PREFIX, 7, struct.pack("<I", 10**9))], _BAD, "does not fit"),
        ([encode(MsgType.NODES, 7, b"trailing")], _BAD, "unexpected bytes"),
        ([encode(MsgType.DEREGISTER_NODE, 7, b"\x01")], _BAD, "too short"),
        ([encode(MsgType.DEREGISTER_NODE, 7, write_deregister(1, 5) + b"x")], _BAD, "unexpected"),
    ],
)
def test_malformed_frames_get_an_error_reply_and_the_controller_keeps_serving(
    cluster: Cluster, frames: list[bytes], code: ErrorCode, expect: str
) -> None:
    sock = _dealer(cluster)
    try:
        sock.send_multipart(frames)
        header, reader = decode_header(sock.recv())
        assert header.type == MsgType.ERROR
        assert reader.u32() == code
        assert expect in reader.text()
    finally:
        sock.close()
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(3)
        store.batched_put(keys, [b"a", b"b", b"c"])
        assert store.batched_contains(keys) == 3


def test_a_deregistration_naming_another_incarnation_is_refused_and_changes_nothing(
    cluster: Cluster,
) -> None:
    (first, *_) = _nodes(cluster)
    sock = _dealer(cluster)
    try:
        body = write_deregister(first.id, first.incarnation + 1)
        sock.send(encode(MsgType.DEREGISTER_NODE, 7, body))
        header, reader = decode_header(sock.recv())
        assert header.type == MsgType.ERROR
        assert reader.u32() == ErrorCode.UNKNOWN_NODE
    finally:
        sock.close()
    assert cluster.node_names() == ["node0", "node1"]
    assert cluster.stats()["controller"]["nodes_deregistered"] == 0


def test_random_bytes_on_the_control_port_leave_it_serving(cluster: Cluster) -> None:
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", cluster.port), timeout=2) as raw:
            raw.sendall(os.urandom(4096))
    sock = _dealer(cluster)
    sock.send_multipart([b"a", b"b", b"c"])  # a multi-frame message: not ours, dropped
    sock.close()
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(2)
        store.batched_put(keys, [b"a", b"b"])
        assert store.batched_contains(keys) == 2
    assert cluster.stats()["controller"]["bad_frames"] >= 1


def test_random_bytes_on_a_data_port_leave_it_serving(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp")) as store:
        keys = _keys(4)
        values = [os.urandom(5000) for _ in keys]
        store.batched_put(keys, values)
        for node in _nodes(cluster):
            address = next(e for e in node.endpoints if e.transport == "tcp").address
            host, port = address.decode().rsplit(":", 1)
            for junk in (os.urandom(7), os.urandom(100_000), b"\x00" * 64):
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(junk)
        got = store.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == values


def test_stats_command_prints_index_and_node_counters(cluster: Cluster) -> None:
    # A lookup the index sees (a one-sided one does not count in its hit rate).
    with kvfabric.connect(cluster.url(lookup_image="0")) as store:
        keys = _keys(5)
        store.batched_put(keys, [b"x" * 1000] * 5)
        store.batched_contains(keys)
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric", "stats", "--controller", cluster.endpoint],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("kvfabric: capacity 512.0 MiB")
    assert "hit rate" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    scopes = {row[0] for row in rows}
    assert {"controller", "index", "node"} <= scopes
    index = {row[1]: row[-1] for row in rows if row[0] == "index"}
    assert int(index["entries"]) >= 5


def test_unknown_controller_makes_lookups_miss_and_puts_fail_without_raising() -> None:
    port = free_port()
    with kvfabric.connect(f"kvfabric://127.0.0.1:{port}?control_timeout=200ms") as store:
        keys = _keys(3)
        assert store.batched_contains(keys) == 0
        assert store.batched_get(keys) == [None, None, None]
        assert store.batched_put(keys, [b"a", b"b", b"c"]) == [PutOutcome.FAILED] * 3
        assert store.stats()["controller_unavailable"] >= 1
        assert store.ping() is False


def test_header_constants_match_the_documented_layout() -> None:
    frame = encode(MsgType.NODES, 42, b"", epoch=9)
    assert frame[:4] == MAGIC
    assert struct.unpack_from("<HHQQ", frame, 4) == (PROTOCOL_VERSION, MsgType.NODES, 42, 9)


def test_stats_are_available_as_prometheus_text_and_json(cluster: Cluster) -> None:
    import json

    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(3)
        store.batched_put(keys, [b"y" * 10] * 3)
        store.batched_put(keys, [b"y" * 10] * 3)  # three dedup hits
    base = [sys.executable, "-m", "kvfabric", "stats", "--controller", cluster.endpoint]
    prom = subprocess.run([*base, "--format", "prometheus"], capture_output=True, text=True)
    assert prom.returncode == 0, prom.stderr
    samples = [line for line in prom.stdout.splitlines() if not line.startswith("#")]
    metrics = dict(line.rsplit(" ", 1) for line in samples)
    dedup = 'kvfabric_index_offered_keys_total{outcome="deduplicated"}'
    assert float(metrics[dedup]) >= 3
    assert 'kvfabric_node_capacity_bytes{node="node0"}' in metrics
    as_json = subprocess.run([*base, "--format", "json"], capture_output=True, text=True)
    scopes = json.loads(as_json.stdout)
    assert scopes["index"]["dedup_hits"] == float(metrics[dedup])


_FAULTY_UPKEEP = """
import logging
from kvfabric._control.controller import Controller
from kvfabric.indexes.memory import MemoryIndex

class FaultyUpkeep(MemoryIndex):  # a third-party index with a bug in its upkeep
    def tick(self):
        raise RuntimeError("tick broke")

    def idle(self):
        raise RuntimeError("idle broke")

logging.basicConfig(level=logging.WARNING)
controller = Controller(listen="tcp://127.0.0.1:0", index=FaultyUpkeep(), tick=0.02)
controller.serve(ready=lambda endpoint: print(endpoint, flush=True))
"""


def test_an_index_whose_upkeep_raises_is_counted_and_logged_and_the_controller_serves_on() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAULTY_UPKEEP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        client = ControlClient(endpoint, timeout=5.0)
        try:
            requests = 20
            for _ in range(requests):
                assert RemoteIndex(client).nodes() == []
                time.sleep(0.01)  # time for ticks, which fail meanwhile too (counted below)
            stats = fetch_stats(client)["controller"]
        finally:
            client.close()
        # Each request's reply went out, then idle() raised; every tick raised as well.
        assert stats.get("node_rpcs", 0) + stats.get("rpcs", 0) >= requests
        assert stats["upkeep_errors"] > requests
        assert stats.get("internal_errors", 0) == 0
        assert proc.poll() is None  # still serving
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    # One log record (with its traceback) per failing step, not one per failure.
    assert err.count("controller: the index's idle() failed") == 1, err
    assert err.count("controller: the index's tick() failed") == 1, err
    assert err.count("RuntimeError: idle broke") == 1
    assert err.count("RuntimeError: tick broke") == 1
