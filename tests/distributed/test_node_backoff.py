"""A frozen data node costs the client one deadline, not one per request: real controller and
node processes on 127.0.0.1, the node frozen with SIGSTOP.

The controller keeps the frozen node registered (a long ``--node-timeout``), so lookups keep
finding its records: the window in which, without the client holding the node off, every
request would wait the read deadline again. Each client's hold-off clock is one the test
moves by hand, so which call falls within the period is decided by the test, not by the
machine's speed; what each call did is read from the client's counters.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

import kvfabric
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster

_BACKOFF = 5.0


class _Clock:
    """Monotonic time, moved on by hand."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _value(key: bytes) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(1024)


def _delta(after: dict[str, int], before: dict[str, int], *names: str) -> dict[str, int]:
    return {name: after[name] - before[name] for name in names}


_COUNTS = ("transport_failures", "nodes_backed_off", "backoff_skips", "backoff_misses")


def _connect(cluster: Cluster) -> tuple[kvfabric.Store, _Clock]:
    store = kvfabric.connect(
        cluster.url(transport="tcp", timeout="1s", node_backoff=f"{_BACKOFF}s")
    )
    clock = _Clock()
    store.records.breaker.clock = clock
    return store, clock


@pytest.fixture
def frozen_later() -> Iterator[Cluster]:
    with Cluster(
        nodes=1, transports=("tcp", "shm"), controller_args=["--node-timeout", "600s"]
    ) as cluster:
        try:
            yield cluster
        finally:
            cluster.signal_node(0, signal.SIGCONT)


def test_a_frozen_node_costs_one_deadline_then_is_skipped_until_a_probe_finds_it_back(
    frozen_later: Cluster,
) -> None:
    cluster = frozen_later
    store, clock = _connect(cluster)
    with store:
        keys = _keys(32)
        assert (
            store.batched_put(keys, [_value(k) for k in keys]) == [kvfabric.PutOutcome.STORED] * 32
        )
        assert store.batched_contains(keys) == 32
        cluster.signal_node(0, signal.SIGSTOP)

        # The first read waits for its deadline: misses, and the node is held off.
        before = store.stats()
        assert store.batched_get(keys) == [None] * 32
        after = store.stats()
        assert _delta(after, before, *_COUNTS) == {
            "transport_failures": 1,
            "nodes_backed_off": 1,
            "backoff_skips": 0,
            "backoff_misses": 0,
        }

        # Within the period: lookups stop at the node's keys, reads and writes skip it, and
        # nothing is sent to it.
        before = store.stats()
        assert store.batched_contains(keys) == 0
        assert store.batched_get(keys) == [None] * 32
        assert store.batched_get_scattered(keys[:4], [[bytearray(1024)]] * 4) == [False] * 4
        more = _keys(8)
        assert (
            store.batched_put(more, [_value(k) for k in more]) == [kvfabric.PutOutcome.FAILED] * 8
        )
        after = store.stats()
        assert _delta(after, before, *_COUNTS) == {
            "transport_failures": 0,
            "nodes_backed_off": 0,
            "backoff_skips": 32 + 4 + 8,
            "backoff_misses": 32,
        }
        assert store.batched_exists(keys[:2]) == [True, True]  # stored, wherever

        # The period over, one call probes the node: still frozen, it fails, and the node
        # is held off twice as long.
        clock.ahead += _BACKOFF
        before = store.stats()
        assert store.batched_get(keys[:1]) == [None]
        clock.ahead += _BACKOFF  # half the doubled period
        assert store.batched_get(keys[:1]) == [None]
        after = store.stats()
        assert _delta(after, before, *_COUNTS) == {
            "transport_failures": 1,
            "nodes_backed_off": 1,
            "backoff_skips": 1,
            "backoff_misses": 0,
        }

        # Back: once the period is over the next call probes it, gets an answer, and the
        # node is in use again at once, its values right.
        cluster.signal_node(0, signal.SIGCONT)
        clock.ahead += _BACKOFF
        before = store.stats()
        got = store.batched_get(keys)
        assert [bytes(v) if v is not None else None for v in got] == [_value(k) for k in keys]
        assert store.batched_contains(keys) == 32
        assert (
            store.batched_put(more, [_value(k) for k in more]) == [kvfabric.PutOutcome.STORED] * 8
        )
        got = store.batched_get(more)
        assert [bytes(v) if v is not None else None for v in got] == [_value(k) for k in more]
        after = store.stats()
        assert _delta(after, before, *_COUNTS) == dict.fromkeys(_COUNTS, 0)


def test_with_two_copies_a_frozen_nodes_keys_are_read_from_the_other_without_waiting() -> None:
    with Cluster(
        nodes=2,
        transports=("tcp", "shm"),
        controller_args=["--node-timeout", "600s", "--replicas", "2"],
    ) as cluster:
        store, _ = _connect(cluster)
        try:
            keys = _keys(32)
            values = [_value(k) for k in keys]
            assert store.batched_put(keys, values) == [kvfabric.PutOutcome.STORED] * 32
            cluster.signal_node(0, signal.SIGSTOP)
            # The first read waits for the frozen node once, then reads the other copies.
            got = store.batched_get(keys)
            assert [bytes(v) if v is not None else None for v in got] == values
            before = store.stats()
            # Then every key still counts (its other copy is in use), and reads go straight
            # to the other copies.
            assert store.batched_contains(keys) == 32
            got = store.batched_get(keys)
            assert [bytes(v) if v is not None else None for v in got] == values
            after = store.stats()
            delta = _delta(after, before, *_COUNTS)
            assert delta["transport_failures"] == delta["nodes_backed_off"] == 0
            assert delta["backoff_misses"] == 0
            assert delta["backoff_skips"] > 0  # the frozen node's first copies
        finally:
            cluster.signal_node(0, signal.SIGCONT)
            store.close()
