"""The ``ucx`` client across a fork: UCX contexts and workers are not fork-safe, so a store
the child inherited makes a context and a worker of its own (the parent's are left alone,
never destroyed from the child) and moves its bytes over UCX; the parent keeps its own.
Run it as ``test_ucx.py`` is run (``UCX_TLS=sm``, or ``tcp``). Real node processes; children
bounded (``fork_children``)."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

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


@pytest.mark.parametrize("mechanism", ["os.fork", "multiprocessing", "forking-server"])
def test_a_store_over_ucx_forked_gets_a_worker_of_its_own_in_each_child(
    cluster: Cluster, mechanism: str
) -> None:
    with kvfabric.connect(cluster.url(transport="ucx", timeout="30s")) as store:
        keys = chain_keys(list(range(128)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(20_000) for _ in keys]
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
        assert exact_hits(store, keys, values) == len(keys)
        for report in in_children(mechanism, lambda: round_trip(store, keys), count=2):
            check_child(report, values)
            assert report.transports == ["ucx"]
        parent_still_whole(store, keys, values)


def test_a_fork_while_a_parent_thread_holds_the_ucx_clients_lock(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="ucx", timeout="30s")) as store:
        keys = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
        values = [os.urandom(5000) for _ in keys]
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * len(keys)
        mutex = store.records._routes._clients["ucx"]._lock
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
            with holding_locks(store) as held:
                assert held >= 8
                reports = in_children("os.fork", lambda: round_trip(store, keys), count=2)
        finally:
            release.set()
            holder.join()
        for report in reports:
            check_child(report, values)
        parent_still_whole(store, keys, values)
