"""Hostile control frames against a real controller: refused whole, bounded, never applied."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator

import pytest
import zmq

import kvfabric
from kvfabric import PutOutcome
from kvfabric._runtime.codec import Reader, Writer
from kvfabric._wire.protocol import (
    ErrorCode,
    MsgType,
    decode_header,
    encode,
    read_counters,
    write_counters,
    write_keys,
)
from kvfabric._wire.write_bodies import write_allocation_requests
from kvfabric.keys import chain_keys
from kvfabric.spi import AllocationRequest, NodeInfo, RegionInfo
from kvfabric.testing import Cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp",)) as cluster:
        yield cluster


def _call(cluster: Cluster, frame: bytes) -> tuple[int, Reader]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(cluster.endpoint)
    try:
        sock.send(frame)
        header, reader = decode_header(sock.recv())
        return header.type, reader
    finally:
        sock.close()


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def test_a_delete_with_trailing_bytes_deletes_nothing(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(3)
        store.batched_put(keys, [b"kept"] * 3)
        kind, reader = _call(cluster, encode(MsgType.UNPUBLISH, 1, write_keys(keys) + b"\x00"))
        assert kind == MsgType.ERROR
        assert reader.u32() == ErrorCode.BAD_FRAME
        assert store.batched_contains(keys) == 3


def test_an_allocate_with_trailing_bytes_blocks_no_key(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(2)
        body = write_allocation_requests([AllocationRequest(key=k, length=100) for k in keys])
        kind, _ = _call(cluster, encode(MsgType.ALLOCATE, 1, body + b"junk"))
        assert kind == MsgType.ERROR
        # Had it taken effect, the keys would be in flight for a whole lease.
        assert store.batched_put(keys, [b"x" * 100] * 2) == [PutOutcome.STORED] * 2


def _registration(name: str, regions: int, size: int) -> bytes:
    info = NodeInfo(
        name=name,
        regions=tuple(RegionInfo(id=i, size=size, rkey=i + 1) for i in range(regions)),
        endpoints=(),
        instance=7,
    )
    return info.to_bytes()


@pytest.mark.parametrize(
    ("regions", "size", "trailing"),
    [
        # Far more regions than a node may have, in a frame under the controller's
        # --max-frame (a larger one is dropped unread: test_frame_bounds.py).
        (150_000, 1 << 20, b""),
        (1, 1 << 60, b""),  # a region of absurd size
        (1, 1 << 20, b"\x01"),  # a good registration with trailing bytes
    ],
)
def test_a_bad_registration_is_refused_and_registers_nothing(
    cluster: Cluster, regions: int, size: int, trailing: bytes
) -> None:
    name = f"intruder-{uuid.uuid4().hex[:6]}"
    frame = encode(MsgType.REGISTER_NODE, 1, _registration(name, regions, size) + trailing)
    kind, reader = _call(cluster, frame)
    assert kind == MsgType.ERROR
    assert reader.u32() == ErrorCode.BAD_FRAME
    assert name not in cluster.node_names()
    assert cluster.stats()["index"]["capacity_bytes"] < 1 << 40


def test_a_registration_under_a_live_nodes_name_is_refused(cluster: Cluster) -> None:
    live = cluster.node_infos()[0]
    kind, reader = _call(
        cluster, encode(MsgType.REGISTER_NODE, 1, _registration(live.name, 1, 1 << 20))
    )
    assert kind == MsgType.ERROR
    assert reader.u32() == ErrorCode.NAME_IN_USE
    (still,) = cluster.node_infos()
    assert (still.instance, still.incarnation) == (live.instance, live.incarnation)


def test_counters_saturate_their_wire_form() -> None:
    body = write_counters({"huge": 1 << 70, "negative": -5, "normal": 12}).getvalue()
    assert read_counters(Reader(body)) == {"huge": (1 << 64) - 1, "negative": 0, "normal": 12}


def test_a_heartbeat_for_an_old_incarnation_is_refused(cluster: Cluster) -> None:
    live = cluster.node_infos()[0]
    body = Writer().u32(live.id).u64(live.incarnation + 1000).getvalue()
    body += struct.pack("<I", 0)  # no counters
    kind, reader = _call(cluster, encode(MsgType.HEARTBEAT, 1, body))
    assert kind == MsgType.ERROR
    assert reader.u32() == ErrorCode.UNKNOWN_NODE
    assert cluster.node_infos()[0].incarnation == live.incarnation
