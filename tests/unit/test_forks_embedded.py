"""An ``embedded://`` store opened before a fork, used by the child.

The index of an embedded store lives in the parent's memory and its node's regions are
shared memory: a child writing by its own copy of the index would overwrite the parent's
records. So the child gets an embedded store of its own (same options, empty; one per NAME
in the child) and the parent's is left untouched: it reads every record it stored and keeps
storing. A ``file`` store's files are the parent's: the child is refused, clearly. Children
are real processes, each bounded (``fork_children``).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from fork_children import (
    MECHANISMS,
    ChildReport,
    check_child,
    holding_locks,
    in_children,
    parent_still_whole,
    round_trip,
)

import kvfabric
from kvfabric import NotSupportedError, PutOutcome, Store
from kvfabric._client import embedded
from kvfabric.keys import chain_keys
from kvfabric.testing import exact_hits

# Room for the parent's records and the child's in the same regions: a child sharing the
# parent's memory by a copy of its index would land on the parent's records.
_URL = "embedded://{name}?capacity=8MiB&region_size=4MiB"


def _stored(store: Store, count: int = 256) -> tuple[list[bytes], list[bytes]]:
    keys = chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)
    values = [f"parent {i} ".encode().ljust(4096, b"p") for i in range(count)]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * count
    assert exact_hits(store, keys, values) == count
    return keys, values


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("named", [False, True], ids=["embedded", "embedded-NAME"])
def test_a_forked_embedded_store_gives_each_child_its_own_and_the_parent_loses_nothing(
    mechanism: str, named: bool
) -> None:
    name = uuid.uuid4().hex[:8] if named else ""
    with kvfabric.connect(_URL.format(name=name)) as store:
        keys, values = _stored(store)
        parent_node = store.local_node

        def child() -> tuple[ChildReport, bool]:
            report = round_trip(store, keys, count=256)
            return report, store.local_node is parent_node

        outcomes = in_children(mechanism, child, count=2)
        # The parent first: nothing a child did may have cost it a record.
        assert store.local_node is parent_node
        parent_still_whole(store, keys, values)
        for report, used_parents_node in outcomes:
            assert not used_parents_node  # the child's own node, never the parent's regions
            check_child(report, None)


@pytest.mark.parametrize("mechanism", ["os.fork", "multiprocessing"])
def test_a_child_filling_its_store_many_times_over_takes_nothing_of_the_parents(
    mechanism: str,
) -> None:
    """A child sharing the parent's regions by a copy of its index would evict the parent's
    records in its copy and write over them: the parent would lose every one."""
    with kvfabric.connect(_URL.format(name="")) as store:
        keys, values = _stored(store)

        def child() -> tuple[list[str], list[bytes | None], list[bytes]]:
            outcomes: list[str] = []
            for batch in range(8):  # 8 MiB, the whole capacity
                own = chain_keys(list(range(256)), 1, namespace=uuid.uuid4().bytes)
                mine = [f"child {batch} {i} ".encode().ljust(4096, b"c") for i in range(256)]
                outcomes = [o.name for o in store.batched_put(own, mine)]
            got = [None if g is None else bytes(g) for g in store.batched_get(own)]
            return outcomes, got, mine

        for outcomes, got, mine in in_children(mechanism, child, count=2):
            assert outcomes == [PutOutcome.STORED.name] * 256
            assert got == mine
        parent_still_whole(store, keys, values)


def test_stores_of_one_name_share_the_childs_own_store_there() -> None:
    name = uuid.uuid4().hex[:8]
    url = _URL.format(name=name)
    with kvfabric.connect(url) as first, kvfabric.connect(url) as second:
        keys, values = _stored(first)
        assert exact_hits(second, keys, values) == len(keys)

        def child() -> tuple[list[bytes | None], list[bytes | None], list[bytes | None]]:
            own = chain_keys(list(range(16)), 1, namespace=uuid.uuid4().bytes)
            mine = [b"child %d" % i for i in range(16)]
            assert first.batched_put(own, mine) == [PutOutcome.STORED] * 16
            # The other inherited store of the name, and one opened in the child, share the
            # child's store of that name.
            with kvfabric.connect(url) as third:
                by_third = [None if g is None else bytes(g) for g in third.batched_get(own)]
            by_second = [None if g is None else bytes(g) for g in second.batched_get(own)]
            theirs = [None if g is None else bytes(g) for g in second.batched_get(keys)]
            assert by_second == mine
            assert by_third == mine
            return by_second, by_third, theirs

        for _, _, theirs in in_children("os.fork", child, count=2):
            assert theirs == [None] * len(keys)
        parent_still_whole(first, keys, values)
        assert exact_hits(second, keys, values) == len(keys)


def test_a_fork_while_parent_threads_hold_the_locks_does_not_deadlock_the_child() -> None:
    name = uuid.uuid4().hex[:8]
    with kvfabric.connect(_URL.format(name=name)) as store:
        keys, values = _stored(store)
        with holding_locks(store, embedded._shared_lock) as held:
            assert embedded._shared_lock.locked()
            assert held >= 8
            reports = in_children("os.fork", lambda: round_trip(store, keys), count=2)
        for report in reports:
            check_child(report, None)
        parent_still_whole(store, keys, values)


def test_an_async_embedded_store_works_in_the_child() -> None:
    async def parent() -> tuple[kvfabric.AsyncStore, list[bytes]]:
        astore = await kvfabric.connect_async(_URL.format(name=""))
        keys = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
        assert await astore.batched_put(keys, [b"p"] * 32) == [PutOutcome.STORED] * 32
        return astore, keys

    astore, keys = asyncio.run(parent())

    async def child() -> list[bytes | None]:
        assert await astore.batched_put(keys[:4], [b"c"] * 4) == [PutOutcome.STORED] * 4
        return [None if g is None else bytes(g) for g in await astore.batched_get(keys)]

    for got in in_children("multiprocessing", lambda: asyncio.run(child()), count=2):
        assert got == [b"c"] * 4 + [None] * 28

    async def parent_after() -> None:
        got = await astore.batched_get(keys)
        assert [bytes(g) if g is not None else None for g in got] == [b"p"] * 32
        await astore.close()

    asyncio.run(parent_after())


def test_a_forked_file_store_refuses_the_child_and_the_parent_keeps_its_files(
    tmp_path: Path,
) -> None:
    url = f"embedded://?backend=file&path={tmp_path}&capacity=8MiB&file.prefault=false"
    with kvfabric.connect(url) as store:
        keys, values = _stored(store, count=64)
        files = sorted(p.name for p in tmp_path.iterdir())

        def child() -> str:
            try:
                store.batched_get(keys)
            except NotSupportedError as exc:
                message = str(exc)
            else:
                return "no error"
            # Every call says so, and closing touches nothing of the parent's.
            with pytest.raises(NotSupportedError):
                store.batched_put(keys[:1], values[:1])
            store.close()
            return message

        for mechanism in ("os.fork", "multiprocessing"):
            for message in in_children(mechanism, child, count=1):
                assert "belong to the process that opened it" in message
                assert "path=" in message
        assert sorted(p.name for p in tmp_path.iterdir()) == files
        parent_still_whole(store, keys, values)
