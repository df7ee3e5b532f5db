"""The controller's port bounds a frame's memory before it trusts it, authenticated or not.

A frame larger than ``--max-frame`` is refused by ZeroMQ as its size arrives: the peer is
disconnected and nothing is allocated for it, so hostile frames cost the controller no
memory however large they claim to be, and honest clients are served throughout. Memory is
the controller process's peak resident set (``VmHWM``), before and after; the bound is far
above what the controller needs and far below what the frames would take (2 GiB).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import kvfabric
from kvfabric import PutOutcome
from kvfabric._control.security import Credentials
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_for

_GROWTH_BOUND_MIB = 64.0
_FRAME = 256 << 20  # each hostile frame: 256 MiB, 64 times the default --max-frame
_SECRET = b"frame-bounds-secret"


def _peak_mib(pid: int) -> float:
    """The process's peak resident memory (``VmHWM`` in /proc), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.fixture(params=[None, _SECRET], ids=["no_secret", "secret"])
def cluster(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    secret = request.param
    with Cluster(nodes=1, transports=("tcp",), secret=secret) as cluster:
        if secret is not None:
            monkeypatch.setenv("KVFABRIC_SECRET", secret.decode())
        yield cluster


def _hostile(
    cluster: Cluster, context: zmq.Context[zmq.Socket[bytes]]
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER that holds the secret where there is one (authenticated), and a monitor
    that sees the controller drop it."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if cluster.secret is not None:
        Credentials.from_secret(cluster.secret).secure_client(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(cluster.endpoint)
    return sock, monitor


def test_oversize_frames_cost_the_controller_no_memory_and_clients_are_served(
    cluster: Cluster,
) -> None:
    keys = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with kvfabric.connect(cluster.url()) as store:
        assert store.batched_put(keys, [b"kept"] * 16) == [PutOutcome.STORED] * 16
        pid = cluster.controller_pid()
        before = _peak_mib(pid)
        frame = zmq.Frame(os.urandom(1 << 20) * (_FRAME >> 20))
        hostile = [_hostile(cluster, context) for _ in range(4)]
        try:
            for sock, _ in hostile:
                for _ in range(2):
                    sock.send(frame, copy=False)
            dropped = [0]

            def all_dropped() -> bool:
                for _, monitor in hostile:
                    while monitor.poll(0):
                        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                            dropped[0] += 1
                return dropped[0] >= len(hostile)

            wait_for("the controller drops every hostile connection", all_dropped)
            # Served while the hostile peers keep reconnecting and sending.
            assert store.batched_contains(keys) == 16
            fresh = chain_keys(list(range(4)), 1, namespace=uuid.uuid4().bytes)
            assert store.batched_put(fresh, [b"new"] * 4) == [PutOutcome.STORED] * 4
            after = _peak_mib(pid)
        finally:
            for sock, monitor in hostile:
                monitor.close(linger=0)
                sock.close(linger=0)
            context.term()
        assert store.stats()["controller_unavailable"] == 0
    print(f"\ncontroller peak RSS {before:.0f} MiB -> {after:.0f} MiB under 8 x 256 MiB frames")
    assert after - before < _GROWTH_BOUND_MIB


def test_a_controller_refuses_a_max_frame_too_small_for_its_clients() -> None:
    with pytest.raises(RuntimeError, match="--max-frame"):
        Cluster(nodes=0, controller_args=["--max-frame", "64KiB"])
