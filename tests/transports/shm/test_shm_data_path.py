"""The data path over ``shm`` as a store drives it: the GIL taken back a bounded number of
times per batch, every record still validated, memory ready before the first put, and
records landing payload first, header last.

GIL returns are counted by ``kvfabric._runtime.native`` in the calling thread; the stores here
are embedded (the index in this process, so a control call costs no native call) unless a
test needs the node in a process of its own. Timings are printed, never asserted.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

import kvfabric
from kvfabric import Store, chain_keys
from kvfabric._plugins import plugin_manager
from kvfabric._runtime import native
from kvfabric._runtime.record import checksum
from kvfabric.spi import (
    HEADER_SIZE,
    MemoryKind,
    NodeEndpoint,
    Region,
    Segment,
    TransportConfig,
    new_rkey,
)
from kvfabric.testing import BusyThread, Cluster, wait_for

_COUNT = 64
_SIZE = 4 << 20
_PAGE = 4096


def _keys(count: int = _COUNT) -> list[bytes]:
    return chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)


def _values(count: int = _COUNT, size: int = _SIZE) -> list[np.ndarray[Any, Any]]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]


@pytest.fixture(scope="module")
def values() -> list[np.ndarray[Any, Any]]:
    return _values()


@pytest.fixture
def store() -> Iterator[Store]:
    name = f"shm-data-path-{uuid.uuid4().hex[:8]}"
    # The timeout bounds a hang, not the machine's speed.
    with kvfabric.connect(f"embedded://{name}?capacity=640MiB&transport=shm&timeout=60s") as s:
        yield s


def _dests(count: int = _COUNT, size: int = _SIZE) -> list[np.ndarray[Any, Any]]:
    return [np.ones(size, dtype=np.uint8) for _ in range(count)]  # touched: no faults


def _returns(fn: Any) -> tuple[Any, int, float]:
    """``fn()``'s result, the GIL returns it took (native count), and its seconds."""
    before = native.gil_reacquisitions()
    started = time.perf_counter()
    result = fn()
    return result, native.gil_reacquisitions() - before, time.perf_counter() - started


# -- the GIL ------------------------------------------------------------------------------


@pytest.mark.usefixtures("long_switch_interval")
def test_a_64_record_put_and_read_take_the_gil_back_once_each(
    store: Store, values: list[np.ndarray[Any, Any]]
) -> None:
    keys = _keys()
    handoffs = native.gil_handoffs()
    outcomes, put_returns, put_s = _returns(lambda: store.batched_put(keys, values))
    assert {o.value for o in outcomes} == {"stored"}
    put_handoffs = native.gil_handoffs() - handoffs
    found, contains_returns, _ = _returns(lambda: store.batched_contains(keys))
    assert found == _COUNT
    dests = _dests()
    handoffs = native.gil_handoffs()
    got, get_returns, get_s = _returns(lambda: store.batched_get(keys, into=dests))
    get_handoffs = native.gil_handoffs() - handoffs
    batch = _COUNT * _SIZE
    print(
        f"put {batch / put_s / 1e9:.2f} GB/s, get {batch / get_s / 1e9:.2f} GB/s; GIL returns: "
        f"put {put_returns}, contains {contains_returns}, get {get_returns}"
    )
    # Put: one copy of every payload with its CRC (the 64 headers after it are 4 KiB and
    # keep the GIL). Read: one copy of every header and payload with each payload's CRC.
    assert (put_returns, contains_returns, get_returns) == (1, 0, 1)
    # Each copy's tail ran on a helper thread while the GIL came back.
    assert (put_handoffs, get_handoffs) == (1, 1)
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))


def test_a_read_over_two_nodes_copies_one_node_on_the_callers_thread_the_other_on_the_pool(
    values: list[np.ndarray[Any, Any]],
) -> None:
    """Nodes are read in parallel: the calling thread copies one node's batch itself (one
    native call, one return of the GIL) while a pool thread copies the other's."""
    with (
        Cluster(nodes=2, transports=("shm",), capacity="384MiB") as cluster,
        kvfabric.connect(cluster.url(transport="shm", timeout="60s")) as store,
    ):
        keys = _keys()
        assert {o.value for o in store.batched_put(keys, values)} == {"stored"}
        descriptors = store.locate(keys)
        nodes = {d.node for d in descriptors if d is not None}
        assert len(nodes) == 2
        store.remember([d for d in descriptors if d is not None])
        dests = _dests()
        got, returns, _ = _returns(lambda: store.batched_get(keys, into=dests))
    # One node's copy ran here; the other's on a pool thread (counted there, not here).
    assert returns == 1
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))


def test_a_busy_python_thread_keeps_running_beside_large_reads_and_every_read_validates(
    store: Store, values: list[np.ndarray[Any, Any]]
) -> None:
    keys = _keys()
    store.batched_put(keys, values)
    dests = _dests()
    rounds = 5

    def read_rounds() -> float:
        started = time.perf_counter()
        for _ in range(rounds):
            store.batched_contains(keys)
            got = store.batched_get(keys, into=dests)
            assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))
        return time.perf_counter() - started

    alone = read_rounds()
    with BusyThread() as busy:
        before = busy.count
        beside = read_rounds()
        counted = busy.count - before
    print(
        f"{rounds} x 64 x 4 MiB reads: alone {alone * 1e3:.0f} ms, beside a busy thread "
        f"{beside * 1e3:.0f} ms ({alone / beside:.2f}x); the thread counted {counted}"
    )
    assert counted > 0
    assert store.stats()["get_hits"] == 2 * rounds * _COUNT
    assert store.stats()["validation_failures"] == 0


def test_a_corrupted_payload_is_a_counted_miss_and_the_rest_of_the_batch_validates(
    store: Store, values: list[np.ndarray[Any, Any]]
) -> None:
    keys = _keys()
    store.batched_put(keys, values)
    [bad] = store.locate([keys[17]])
    assert bad is not None
    flipped = bytes([values[17][1000] ^ 0xFF])
    store.records.write_slot(bad, HEADER_SIZE + 1000, flipped)
    store.batched_contains(keys)
    dests = _dests()
    got, returns, _ = _returns(lambda: store.batched_get(keys, into=dests))
    assert got[17] is None
    assert all(
        np.array_equal(g, v) for i, (g, v) in enumerate(zip(got, values, strict=True)) if i != 17
    )
    stats = store.stats()
    assert (stats["validation_failures"], stats["get_misses"], stats["get_hits"]) == (1, 1, 63)
    assert returns == 1  # the CRC came with the copy: no second pass over the payloads


# -- write order --------------------------------------------------------------------------


def test_a_reader_spinning_on_a_slot_while_records_land_sees_misses_or_the_exact_value(
    store: Store,
) -> None:
    """A writer overwrites one slot with two records in turn (as a reused slot is); readers
    spin on it with either record's descriptor. Payload first, header last, and the CRC of
    what landed: a read is a miss or exactly the record it asked for, never a mix."""
    [key] = _keys(1)
    a, b = _values(2)
    store.batched_put([key], [a])
    [slot] = store.locate([key])
    assert slot is not None
    records = {
        "a": (attrs.evolve(slot, version=slot.version + 1, crc=checksum(a.data)), a),
        "b": (attrs.evolve(slot, version=slot.version + 2, crc=checksum(b.data)), b),
    }
    stop = threading.Event()
    wrong: list[str] = []
    hits = {"a": 0, "b": 0}
    misses = 0
    writes = 0

    def write() -> None:
        nonlocal writes
        while not stop.is_set():
            for descriptor, value in records.values():
                report = store.records.write([descriptor], [[value.data]])
                if report.crcs != [descriptor.crc]:
                    wrong.append(f"write reported {report.crcs}")
                writes += 1
                # A pause between writes, as between puts: reads then also land whole.
                time.sleep(0.003)

    def read() -> None:
        nonlocal misses
        dest = np.empty(_SIZE, dtype=np.uint8)
        while not stop.is_set():
            for name, (descriptor, value) in records.items():
                [got] = store.records.read([key], [descriptor], into=[dest]).values
                if got is None:
                    misses += 1
                elif np.array_equal(np.frombuffer(got, dtype=np.uint8), value):
                    hits[name] += 1
                else:
                    wrong.append(name)

    def races() -> tuple[int, int]:
        return writes, hits["a"] + hits["b"] + misses

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    try:
        # The race runs for a count of writes and reads, not for a time: a busy machine
        # makes it take longer, never prove less.
        wait_for("300 writes raced by 300 reads", races, until=lambda n: min(n) >= 300)
    finally:
        stop.set()
    for t in threads:
        t.join()
    print(f"{writes} writes; reads: {hits} hits, {misses} misses, {len(wrong)} wrong")
    assert wrong == []
    # Once the writes stop, the last record written reads back whole.
    descriptor, value = records["b"]
    [got] = store.records.read([key], [descriptor]).values
    assert got is not None
    assert np.array_equal(np.frombuffer(got, dtype=np.uint8), value)


# -- memory ready before the first put ----------------------------------------------------


def _minor_faults() -> int:
    # The whole process: a large copy ends on a helper thread (native.gil_handoffs), whose
    # faults a count of this thread's would miss.
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize(
    ("query", "populated"),
    [({}, True), ({"shm.prefault": "false"}, False)],
    ids=["prefaulted", "client-prefault-off"],
)
def test_the_first_put_into_a_fresh_node_faults_no_page_of_the_region_in_the_client(
    query: dict[str, str], populated: bool
) -> None:
    """Page tables are per process: the node's prefault readies its own mapping, and the
    client populates its mapping at connect."""
    count, size = 16, 4 << 20
    values = _values(count, size)
    pages = count * size // _PAGE
    with (
        Cluster(nodes=1, transports=("shm",), capacity="128MiB") as cluster,
        kvfabric.connect(cluster.url(transport="shm", timeout="60s", **query)) as store,
    ):
        keys = _keys(count)
        before = _minor_faults()
        started = time.perf_counter()
        outcomes = store.batched_put(keys, values)
        elapsed = time.perf_counter() - started
        faults = _minor_faults() - before
        assert {o.value for o in outcomes} == {"stored"}
        got = store.batched_get(keys)
    print(f"first put: {count * size / elapsed / 1e9:.2f} GB/s, {faults} minor faults")
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))
    if populated:
        assert faults < pages // 8
    else:
        assert faults >= pages


@pytest.mark.parametrize("allocated", [True, False])
def test_a_client_populates_a_region_only_where_the_node_allocated_all_of_it(
    allocated: bool,
) -> None:
    """Populating a region the node left sparse would allocate every page of it from a
    client: only a region allocated in full (st_blocks) is populated at connect."""
    size = 16 << 20
    fd = os.memfd_create("kvfabric-test-region", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if allocated:
            os.posix_fallocate(fd, 0, size)
        with mmap.mmap(fd, size) as mapping:
            region = Region(
                id=0,
                size=size,
                rkey=new_rkey(),
                kind=MemoryKind.DRAM,
                view=memoryview(mapping),
                path=f"/proc/{os.getpid()}/fd/{fd}",
            )
            shm = plugin_manager().transport("shm")
            server = shm.create_server(TransportConfig())
            endpoint = NodeEndpoint(
                node=1, transport="shm", address=server.address, regions=(server.register(region),)
            )
            client = shm.create_client(TransportConfig(options=shm.parse_options({})))
            try:
                client.connect(endpoint)
                blocks = os.fstat(fd).st_blocks * 512
                handle = endpoint.regions[0]
                data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
                before = _minor_faults()
                segment = Segment(handle.region, handle.rkey, 0, memoryview(data))
                assert client.write(1, [segment]) == [None]
                faults = _minor_faults() - before
            finally:
                client.close()
                server.close()
                region.view.release()
    finally:
        os.close(fd)
    if allocated:
        assert faults < (4 << 20) // _PAGE // 8
    else:
        assert blocks == 0  # connecting allocated nothing
        assert faults >= (4 << 20) // _PAGE
