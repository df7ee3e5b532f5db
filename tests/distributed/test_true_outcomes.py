"""A put's outcomes are true when its publish goes unanswered: STORED is readable, FAILED is
not published — and never comes back as stored when the controller restarts.

The controller is real; between it and the client runs a proxy process
(``control_proxy.py``) that loses what each test says: the replies to publishes (they were
served: the writer asks what became of them and reports them stored), or the publishes and
every question after them (never served: the writer reports them failed and wipes their
records, so the node's scan after a controller restart finds nothing to bring back).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits, wait_for

_PROXY = Path(__file__).with_name("control_proxy.py")


@contextmanager
def _proxy(cluster: Cluster, *, drop_requests: str = "", drop_replies: str = "") -> Iterator[str]:
    """The proxy's address, as a ``kvfabric://`` URL's HOST:PORT."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(_PROXY),
            cluster.endpoint,
            "--drop-requests",
            drop_requests,
            "--drop-replies",
            drop_replies,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        assert "listening on tcp://" in line, line
        yield line.strip().rpartition("tcp://")[2]
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _values(keys: list[bytes]) -> list[bytes]:
    return [key * 16 for key in keys]  # 512 bytes, each its key's own


@pytest.mark.parametrize("extents", ["1", "0"], ids=["carved", "allocated"])
@pytest.mark.parametrize("count", [64, 5000], ids=["one_chunk", "chunks"])
def test_a_publish_whose_reply_is_lost_is_asked_about_and_reported_stored(
    extents: str, count: int
) -> None:
    with (
        Cluster(nodes=1, transports=("tcp", "shm")) as cluster,
        _proxy(cluster, drop_replies="PUBLISH,PUBLISH_CARVED") as address,
        kvfabric.connect(f"kvfabric://{address}?control_timeout=500ms&extents={extents}") as store,
    ):
        keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
        assert store.batched_put(keys, _values(keys)) == [PutOutcome.STORED] * count
        assert exact_hits(store, keys, _values(keys)) == count
        stats = store.stats()
        assert stats["outcomes_unknown"] == 0
        assert stats["records_wiped"] == 0
        # The controller answered what the writer asked: it was never taken for down.
        assert stats["controller_unavailable"] == 0


def test_a_publish_never_answered_is_failed_and_not_restored_after_a_controller_restart() -> None:
    with Cluster(nodes=1, transports=("tcp", "shm")) as cluster:
        direct = cluster.url(retry_interval="200ms")
        kept = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
        lost = chain_keys(list(range(3000)), 1, namespace=uuid.uuid4().bytes)
        with kvfabric.connect(direct) as store:
            assert store.batched_put(kept, _values(kept)) == [PutOutcome.STORED] * 32
        with (
            _proxy(cluster, drop_requests="PUBLISH,ABORT") as address,
            kvfabric.connect(f"kvfabric://{address}?control_timeout=500ms&extents=0") as store,
        ):
            assert store.batched_put(lost, _values(lost)) == [PutOutcome.FAILED] * 3000
            stats = store.stats()
            assert stats["outcomes_unknown"] == 3000
            assert stats["records_wiped"] == 3000
        _restart_controller(cluster)
        with kvfabric.connect(direct) as store:
            wait_for("the node's records are restored", lambda: store.batched_contains(kept) == 32)
            assert exact_hits(store, kept, _values(kept)) == 32
            assert store.batched_exists(lost) == [False] * 3000


def test_carved_records_never_answered_are_failed_and_not_restored() -> None:
    """Through extents: the publish and the extent's return both go unanswered (the
    extent is still this writer's), so the records are wiped."""
    with Cluster(nodes=1, transports=("tcp", "shm")) as cluster:
        direct = cluster.url(retry_interval="200ms")
        lost = chain_keys(list(range(500)), 1, namespace=uuid.uuid4().bytes)
        with (
            _proxy(cluster, drop_requests="PUBLISH_CARVED,LEASE_EXTENTS@2,RESOLVE") as address,
            kvfabric.connect(f"kvfabric://{address}?control_timeout=500ms") as store,
        ):
            assert store.batched_put(lost, _values(lost)) == [PutOutcome.FAILED] * 500
            assert store.stats()["carved_writes"] == 500  # written into an extent
            assert store.stats()["records_wiped"] == 500
        _restart_controller(cluster)
        with kvfabric.connect(direct) as store:
            probe = chain_keys(list(range(4)), 1, namespace=uuid.uuid4().bytes)
            wait_for(
                "the restarted controller takes puts",
                lambda: store.batched_put(probe, _values(probe)) == [PutOutcome.STORED] * 4,
            )
            assert store.batched_exists(lost) == [False] * 500


def _restart_controller(cluster: Cluster) -> None:
    """kill -9 and start again: the index is rebuilt from what the node's scan finds."""
    cluster.kill_controller()
    cluster.start_controller()
    cluster.wait_nodes(1)
