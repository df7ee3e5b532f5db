"""The ``ucx`` client across a fork. UCX is not fork-safe: its event thread stays in the
process that started it, and a worker made in a child would hand that thread the child's
events (a child over ``UCX_TLS=tcp`` then waits on connections that never complete). So a
process forked after UCX started does not start it: a store the child inherited moves its
bytes over its other transports, one forced onto ``ucx`` says why it cannot, and the
parent keeps its worker and every record. Run it as ``test_ucx.py`` is run (``UCX_TLS=sm``,
or ``tcp``). Real node processes; children bounded (``fork_children``)."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fork_children import check_child, holding_locks, in_children, parent_still_whole, round_trip

import kvfabric
from kvfabric import PutOutcome
from kvfabric._plugins import plugin_manager
from kvfabric.errors import PluginUnavailableError
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, exact_hits


def _ucx_missing() -> str:
    try:
        plugin_manager().transport("ucx")
    except PluginUnavailableError as exc:
        return str(exc)
    return ""


_MISSING = _ucx_missing()
pytestmark = pytest.mark.skipif(
    bool(_MISSING) and os.environ.get("KVFABRIC_REQUIRE_UCX") != "1",
    reason=f"ucx unavailable: {_MISSING}",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    tls = os.environ.get("UCX_TLS")
    # Room for every child's extents: a child exits without giving its extents back, so
    # each holds its lease (a sixteenth of the capacity at most, per node) until it runs
    # out. At 64 MiB the module's children held it all, and leases evicted the parent's
    # values to make room while the test still read them.
    with Cluster(
        nodes=2, transports=("ucx", "tcp"), capacity="256MiB", env={"UCX_TLS": tls} if tls else {}
    ) as c:
        yield c


def _in_child(forced: kvfabric.Store, shared: kvfabric.Store, keys: list[bytes]) -> Any:
    """What a child sees: the store forced onto ucx refused (why), and a round trip over the
    store that may use any transport."""
    try:
        forced.batched_get(keys[:1])
    except PluginUnavailableError as exc:
        refused = str(exc)
    else:
        refused = ""
    return round_trip(shared, keys), refused


@pytest.mark.parametrize("mechanism", ["os.fork", "multiprocessing", "forking-server"])
def test_a_child_forked_after_ucx_started_moves_its_bytes_over_tcp_and_the_parent_keeps_ucx(
    cluster: Cluster, mechanism: str
) -> None:
    with (
        kvfabric.connect(cluster.url(transport="ucx", timeout="30s")) as forced,
        kvfabric.connect(cluster.url(timeout="30s")) as shared,
    ):
        keys = chain_keys(list(range(128)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(20_000) for _ in keys]
        assert forced.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
        assert exact_hits(forced, keys, values) == len(keys)
        assert forced.records.transport_of(forced.locate(keys[:1])[0].node) == "ucx"
        results = in_children(mechanism, lambda: _in_child(forced, shared, keys), count=2)
        for report, refused in results:
            check_child(report, values)
            assert report.transports == ["tcp"]
            assert "forked" in refused
            assert "connect after the fork" in refused
        parent_still_whole(forced, keys, values)


def test_a_fork_while_a_parent_thread_holds_the_ucx_clients_lock(cluster: Cluster) -> None:
    with (
        kvfabric.connect(cluster.url(transport="ucx", timeout="30s")) as forced,
        kvfabric.connect(cluster.url(timeout="30s")) as shared,
    ):
        keys = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(5000) for _ in keys]
        assert forced.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
        mutex = forced.records._routes._clients["ucx"]._lock
        taken, release = threading.Event(), threading.Event()

        def hold_worker() -> None:
            # The worker's lock is native (the wait loop takes it without the GIL).
            with mutex:
                taken.set()
                release.wait()

        holder = threading.Thread(target=hold_worker)
        holder.start()
        taken.wait()
        try:
            with holding_locks(forced) as held:
                assert held >= 8
                results = in_children("os.fork", lambda: _in_child(forced, shared, keys), count=2)
        finally:
            release.set()
            holder.join()
        for report, refused in results:
            check_child(report, values)
            assert report.transports == ["tcp"]
            assert "forked" in refused
        parent_still_whole(forced, keys, values)
