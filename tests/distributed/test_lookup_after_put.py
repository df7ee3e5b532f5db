"""A lookup right after a put costs what a steady-state one does: counted exactly, against real
controller and node processes on 127.0.0.1.

A client reading the controller's lookup image over ``tcp`` keeps a mirror of it, brought up
to date per lookup by one read of the ring of bucket rewrites. After its own put the mirror
lacks exactly the rewrites that put's publish made, and the put says how many: the next
lookup reads them all in its one read (no second read for a put larger than what a lookup
reads by default), asks the controller nothing, and answers right. Both ways a put stores
(through leased extents, and per key with ``extents=0``) say it. Other writers' rewrites are
not announced: the mirror still catches them up, in more reads where they were many, and
never answers wrong. A client on the controller's host maps the image: no read at all.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

import kvfabric
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, wait_until_stopped

# Sizes of put: one key, what a lookup reads of the ring by default (64 entries) and one
# more, and many times that.
_SIZES = [1, 64, 65, 1024]
# Deadlines no healthy call reaches on a loaded host: the counts asserted here are those of
# calls that were answered (a control call or image read past a short deadline on a busy
# machine would take another way, counted differently).
_PATIENT = {"timeout": "30s", "control_timeout": "30s"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm"), capacity="64MiB") as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _value(key: bytes, size: int = 256) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def _costs(store: kvfabric.Store, keys: list[bytes]) -> tuple[int, int, int]:
    """``(hits, image round trips, control RPCs)`` of one ``batched_contains``."""
    before = store.stats()
    hits = store.batched_contains(keys)
    after = store.stats()
    return (
        hits,
        after["image_round_trips"] - before["image_round_trips"],
        after["control_rpcs"] - before["control_rpcs"],
    )


def _put(store: kvfabric.Store, keys: list[bytes], *, carved: bool) -> None:
    before = store.stats()
    outcomes = store.batched_put(keys, [_value(k) for k in keys])
    assert outcomes == [kvfabric.PutOutcome.STORED] * len(keys)
    after = store.stats()
    if after["image_unavailable"] > before["image_unavailable"]:
        # A read of the image failed (a loaded host: past the timeout): the put allocated
        # per key instead, as it should, and said so.
        carved = False
    # The put went the way the test means it to.
    done = after.get("carved_writes", 0) - before.get("carved_writes", 0)
    assert done == (len(keys) if carved else 0), _moved(before, after)


def _moved(before: dict[str, int], after: dict[str, int]) -> str:
    """The counters that moved between two ``stats()``, said when a check fails."""
    return str(
        {
            name: after[name] - before.get(name, 0)
            for name in after
            if after[name] != before.get(name, 0)
        }
    )


@pytest.mark.parametrize("extents", ["1", "0"], ids=["extents", "per-key"])
def test_a_lookup_right_after_a_put_is_one_image_read_and_no_control_rpc(
    cluster: Cluster, extents: str
) -> None:
    carved = extents == "1"
    with kvfabric.connect(cluster.url(transport="tcp", extents=extents, **_PATIENT)) as store:
        _put(store, _keys(8), carved=carved)  # connections made, extents leased
        # Each size after each other (a small put after a large one too), then the steady
        # lookup of the same keys.
        for n in [*_SIZES, *reversed(_SIZES)]:
            keys = _keys(n)
            _put(store, keys, carved=carved)
            assert _costs(store, keys) == (n, 1, 0), f"after a put of {n}"
            assert _costs(store, keys) == (n, 1, 0), f"steady, {n} keys"
        got = store.batched_get(keys)
    assert [bytes(v) for v in got if v is not None] == [_value(k) for k in keys]


def test_puts_in_a_row_are_caught_up_by_one_read_and_so_is_an_exists(cluster: Cluster) -> None:
    with kvfabric.connect(cluster.url(transport="tcp", **_PATIENT)) as store:
        batches = [_keys(n) for n in (300, 1, 500)]
        for batch in batches:
            _put(store, batch, carved=True)
        everything = [k for batch in batches for k in batch]
        assert _costs(store, everything) == (len(everything), 1, 0)
        more = _keys(200)
        _put(store, more, carved=True)
        before = store.stats()
        assert store.batched_exists([*more, *_keys(1)]) == [True] * 200 + [False]
        after = store.stats()
    assert after["image_round_trips"] - before["image_round_trips"] == 1
    assert after["control_rpcs"] == before["control_rpcs"]


@pytest.mark.parametrize("n", _SIZES)
def test_a_mapped_lookup_after_a_put_reads_nothing(cluster: Cluster, n: int) -> None:
    with kvfabric.connect(cluster.url(**_PATIENT)) as store:
        keys = _keys(n)
        _put(store, keys, carved=True)
        assert _costs(store, keys) == (n, 0, 0)


@pytest.mark.parametrize("n", [64, 1024])
def test_other_writers_puts_and_deletes_are_caught_up_and_never_answer_wrong(
    cluster: Cluster, n: int
) -> None:
    url = cluster.url(transport="tcp", **_PATIENT)
    with kvfabric.connect(url) as reader, kvfabric.connect(url) as writer:
        mine = _keys(16)
        _put(reader, mine, carved=True)
        assert _costs(reader, mine) == (16, 1, 0)
        # Another client's puts, then this one's, unannounced to it and announced.
        theirs = _keys(n)
        _put(writer, theirs, carved=True)
        also_mine = _keys(32)
        _put(reader, also_mine, carved=True)
        hits, reads, rpcs = _costs(reader, theirs)
        assert (hits, rpcs) == (n, 0)
        assert 1 <= reads <= 3  # more than a default read's worth: caught up in more reads
        assert _costs(reader, also_mine) == (32, 1, 0)
        got = reader.batched_get(theirs)
        assert [bytes(v) for v in got if v is not None] == [_value(k) for k in theirs]
        # Another client's deletes: the next lookup misses them, at once.
        assert writer.delete(theirs[n // 2 :]) == n - n // 2
        assert _costs(reader, theirs)[::2] == (n // 2, 0)
        assert reader.batched_exists(theirs[n // 2 - 1 : n // 2 + 1]) == [True, False]
        # Both at once: this client's put and the other's, one lookup over both.
        mixed = _keys(n)
        _put(writer, mixed[: n // 2], carved=True)
        _put(reader, mixed[n // 2 :], carved=True)
        assert reader.batched_exists(mixed) == [True] * n
        assert _costs(reader, mixed)[::2] == (n, 0)


def test_a_mirror_lapped_by_its_own_or_others_puts_copies_again_and_answers_right() -> None:
    # The smallest image there is: 1,024 buckets and a ring of 256 rewrites.
    with Cluster(
        nodes=1,
        transports=("tcp",),
        capacity="64MiB",
        controller_args=["--transport", "tcp", "--index-opt", "memory.image=64KiB"],
    ) as small:
        url = small.url(transport="tcp", **_PATIENT)
        with kvfabric.connect(url) as reader, kvfabric.connect(url) as writer:
            mine = _keys(300)  # more rewrites than the ring holds
            _put(reader, mine, carved=True)
            assert _costs(reader, mine)[0] == 300
            theirs = _keys(300)
            _put(writer, theirs, carved=True)
            assert _costs(reader, theirs)[0] == 300
            got = reader.batched_get([*mine, *theirs])
            assert [bytes(v) if v is not None else None for v in got] == [
                _value(k) for k in [*mine, *theirs]
            ]
            assert writer.delete(mine) == 300
            assert reader.batched_contains(mine) == 0


def test_a_put_whose_image_read_fails_allocates_per_key_and_says_so(cluster: Cluster) -> None:
    with kvfabric.connect(
        cluster.url(transport="tcp", timeout="500ms", control_timeout="30s")
    ) as store:
        _put(store, _keys(8), carved=True)  # the mirror caught up, an extent held
        (server,) = cluster.image_server_pids()
        os.kill(server, signal.SIGSTOP)
        try:
            wait_until_stopped(server)
            keys = _keys(16)
            before = store.stats()
            outcomes = store.batched_put(keys, [_value(k) for k in keys])
            after = store.stats()
        finally:
            os.kill(server, signal.SIGCONT)
        assert outcomes == [kvfabric.PutOutcome.STORED] * 16
        moved = after["image_unavailable"] - before["image_unavailable"]
        assert moved == 1, _moved(before, after)
        assert after.get("carved_writes", 0) == before.get("carved_writes", 0)
        got = store.batched_get(keys)
    assert [bytes(v) if v is not None else None for v in got] == [_value(k) for k in keys]
