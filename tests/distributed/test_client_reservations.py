"""What one client holds reserved is bounded: a greedy client cannot hold the store.

The greedy client is a real process that allocates without ever publishing (a writer stuck
after its allocate, or a hostile one); the honest client puts all the while. The greedy one
gets NO_SPACE once it holds its bound (``--max-client-bytes``, ``--max-client-grants``); the
honest one's puts are stored throughout, and what the greedy one held is released when its
lease runs out.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections import Counter

import kvfabric
from kvfabric import PutOutcome
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_for

_VALUE = 64 << 10

# Allocates 64 keys of 64 KiB at a time, never publishing, until a whole allocate is
# refused; prints what it was granted and refused, then holds it until its stdin closes.
_GREEDY = textwrap.dedent(
    """
    import json, sys, uuid
    from kvfabric._control.client import ControlClient
    from kvfabric._control.remote_index import RemoteIndex
    from kvfabric.keys import chain_keys
    from kvfabric.spi import AllocationKind, AllocationRequest

    client = ControlClient(sys.argv[1], timeout=10.0)
    index = RemoteIndex(client)
    kinds = {}
    for _ in range(1000):
        keys = chain_keys(list(range(64)), 1, namespace=uuid.uuid4().bytes)
        result = index.allocate([AllocationRequest(key=k, length=65536) for k in keys])
        for a in result.allocations:
            kinds[a.kind.name] = kinds.get(a.kind.name, 0) + 1
        if all(a.kind is AllocationKind.NO_SPACE for a in result.allocations):
            break
    print(json.dumps(kinds), flush=True)
    sys.stdin.read()
    client.close()
    """
)


def _greedy(cluster: Cluster) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", _GREEDY, cluster.endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, "the greedy client died"
    return process, json.loads(line)


def _stop(process: subprocess.Popen[bytes]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    process.wait(timeout=30)


def _honest_puts(store: kvfabric.Store, rounds: int) -> Counter[PutOutcome]:
    outcomes: Counter[PutOutcome] = Counter()
    for _ in range(rounds):
        keys = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
        outcomes.update(store.batched_put(keys, [bytes(_VALUE)] * 16))
    return outcomes


def test_a_greedy_client_is_held_to_its_share_and_an_honest_client_keeps_storing() -> None:
    with (
        Cluster(nodes=1, transports=("tcp", "shm"), capacity="64MiB") as cluster,
        kvfabric.connect(cluster.url()) as honest,
    ):
        greedy, kinds = _greedy(cluster)
        try:
            # At most half the store (the default bound), in 64 KiB grants.
            assert 0 < kinds["GRANTED"] <= (32 << 20) // _VALUE
            assert kinds["NO_SPACE"] >= 64
            # The honest client stores twice the capacity meanwhile, one put after another.
            outcomes = _honest_puts(honest, 64)
            print(f"\ngreedy client: {kinds}; honest client: {dict(outcomes)}")
            assert outcomes == {PutOutcome.STORED: 64 * 16}
            controller = cluster.stats()["controller"]
            assert controller["reservations_refused"] >= 64
            assert controller["reserving_clients"] >= 1
        finally:
            _stop(greedy)


def test_the_bounds_are_options_and_a_lease_running_out_releases_what_was_held() -> None:
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity="64MiB",
        controller_args=["--max-client-grants", "100", "--lease", "2s"],
    ) as cluster:
        greedy, kinds = _greedy(cluster)
        _stop(greedy)  # gone without publishing or aborting anything
        assert kinds["GRANTED"] == 100
        wait_for(
            "the greedy client's grants are released when their lease runs out",
            lambda: cluster.stats()["controller"]["reserved_grants"] == 0,
        )
        again, kinds = _greedy(cluster)
        _stop(again)
        assert kinds["GRANTED"] == 100


def test_a_bound_in_bytes_refuses_only_past_it() -> None:
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity="64MiB",
        controller_args=["--max-client-bytes", "4MiB"],
    ) as cluster:
        greedy, kinds = _greedy(cluster)
        try:
            # 4 MiB in records of 64 KiB and a 64-byte header each.
            assert kinds["GRANTED"] == (4 << 20) // (_VALUE + 64)
        finally:
            _stop(greedy)


def test_one_put_larger_than_a_clients_bound_is_stored_whole() -> None:
    """An honest put of more than one client may hold reserved at once: what did not fit
    comes back NO_SPACE from the controller, and the client stores it in further passes once
    the first is published (its reservation released), so every key is stored."""
    with (
        Cluster(
            nodes=1,
            transports=("tcp",),
            capacity="64MiB",
            controller_args=["--max-client-bytes", "1MiB"],
        ) as cluster,
        kvfabric.connect(cluster.url(transport="tcp", lookup_image="0")) as store,
    ):
        keys = chain_keys(list(range(48)), 1, namespace=uuid.uuid4().bytes)
        values = [bytes([i]) * _VALUE for i in range(48)]  # 3 MiB in all
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 48
        assert store.stats()["no_space"] == 0
        got = store.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == values
