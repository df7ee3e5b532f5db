"""Batches of any size over ``kvfabric://``: outcomes that are true, and neighbours served.

A put of 100,000 keys is sent to the controller in bounded chunks, pipelined, with a
deadline that grows with its size: every key is STORED and readable, the writer never takes
the controller for down, and another client process — calling the controller all the while
— sees every one of its calls answered. Lookups, resolves, existence checks and deletes of
as many keys are chunked the same way. (Both clients' ``control_timeout`` is a few seconds:
the bound tells a starved neighbour from a busy host, not a timing to meet.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster

_N = 100_000
_CONTROL_TIMEOUT = "3s"

# Calls the controller by RPC (no lookup image) until its stdin closes; then prints, per
# call, when it started (CLOCK_MONOTONIC, the same clock in every process of the host), how
# long it took (printed, never asserted) and whether it was answered.
_NEIGHBOUR = textwrap.dedent(
    """
    import json, sys, threading, time, uuid
    import kvfabric
    from kvfabric.keys import chain_keys

    url = sys.argv[1]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    calls = []
    with kvfabric.connect(url) as store:
        keys = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
        store.batched_put(keys, [b"n" * 256] * 16)
        print("ready", flush=True)
        while not stop.is_set():
            started = time.monotonic()
            found = store.locate(keys)
            fresh = chain_keys([len(calls)], 1, namespace=uuid.uuid4().bytes)
            stored = store.batched_put(fresh, [b"m" * 256])
            ok = all(d is not None for d in found) and stored[0].value == "stored"
            calls.append((started, time.monotonic() - started, ok))
        unavailable = store.stats()["controller_unavailable"]
    print(json.dumps({"calls": calls, "unavailable": unavailable}), flush=True)
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm"), capacity="512MiB") as cluster:
        yield cluster


@pytest.mark.parametrize("extents", ["1", "0"], ids=["carved", "allocated"])
def test_a_put_of_100k_keys_is_stored_whole_while_a_neighbour_is_served(
    cluster: Cluster, extents: str
) -> None:
    neighbour = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _NEIGHBOUR,
            cluster.url(lookup_image="0", control_timeout=_CONTROL_TIMEOUT),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert neighbour.stdout is not None
        assert neighbour.stdin is not None
        assert neighbour.stdout.readline().strip() == b"ready"
        keys = chain_keys(list(range(_N)), 1, namespace=uuid.uuid4().bytes)
        values = [key[:8] * 64 for key in keys]
        with kvfabric.connect(
            cluster.url(extents=extents, control_timeout=_CONTROL_TIMEOUT)
        ) as store:
            started = time.monotonic()
            outcomes = store.batched_put(keys, values)
            ended = time.monotonic()
            assert Counter(outcomes) == {PutOutcome.STORED: _N}, store.stats()
            assert store.batched_contains(keys) == _N
            got = store.batched_get(keys)
            assert [bytes(g) if g is not None else None for g in got] == values
            assert store.stats()["controller_unavailable"] == 0
        neighbour.stdin.close()
        report = json.loads(neighbour.stdout.readline())
    finally:
        if neighbour.poll() is None:
            neighbour.kill()
        neighbour.wait()
    during = [(took, ok) for when, took, ok in report["calls"] if started <= when <= ended]
    print(
        f"\nput of {_N} keys: {ended - started:.1f}s; the neighbour's locate+put meanwhile: "
        f"{len(during)}, the slowest {max((t for t, _ in during), default=0) * 1000:.0f} ms"
    )
    assert during, "the neighbour made no call while the put ran"
    assert all(ok for _, ok in during)
    assert report["unavailable"] == 0


def test_lookups_and_deletes_of_100k_keys_are_answered_whole(cluster: Cluster) -> None:
    keys = chain_keys(list(range(_N)), 1, namespace=uuid.uuid4().bytes)
    absent = chain_keys(list(range(10)), 1, namespace=uuid.uuid4().bytes)
    with kvfabric.connect(cluster.url(lookup_image="0", control_timeout=_CONTROL_TIMEOUT)) as store:
        assert set(store.batched_put(keys, [b"x" * 64] * _N)) == {PutOutcome.STORED}
        # By RPC (no image): a leading run across many chunks, and one that ends early.
        assert store.batched_contains(keys) == _N
        assert store.batched_contains([*keys[:5000], absent[0], *keys[5000:]]) == 5000
        assert store.batched_exists([*keys, *absent]) == [True] * _N + [False] * 10
        located = store.locate(keys)
        assert [d.key if d is not None else None for d in located] == keys
        assert store.delete(keys) == _N
        assert store.batched_exists(keys) == [False] * _N
        assert store.stats()["controller_unavailable"] == 0
