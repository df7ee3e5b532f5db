"""kill -9 of a Redis master under load: the index recovers once its replica takes over.

Writer threads allocate and publish new keys, reader threads resolve keys published earlier
and check every descriptor against the one its publish returned, while a master holding some
of the arenas is killed with SIGKILL. The cluster promotes that master's replica (node timeout
1 s). Meanwhile calls on the dead master's keys fail with ControllerUnavailableError or read
as misses (other masters keep serving); afterwards they hit again, and never is a descriptor
other than the published one returned.

Replication is asynchronous: a publish the master acknowledged but had not yet streamed to its
replica is lost in the failover. With ``wait_replicas=0`` the test bounds that loss by the
publishes acknowledged in the last second before the kill (on 127.0.0.1 the replica lags by
well under a millisecond, so it is 0 or a handful); with ``wait_replicas=1`` a publish reports
success only once the replica has it, and not one is lost.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator

import attrs
import pytest
from redis_fixtures import redis_index
from redis_servers import RedisDeployment

from kvfabric.descriptor import Descriptor
from kvfabric.errors import ControllerUnavailableError
from kvfabric.indexes.redis import RedisIndex
from kvfabric.keys import fold_key
from kvfabric.spi import (
    AllocationKind,
    AllocationRequest,
    GrantRef,
    IndexConfig,
    NodeInfo,
    RegionInfo,
    record_size,
)
from kvfabric.testing import wait_for

pytestmark = pytest.mark.slow

_MIB = 1 << 20
_LOAD_BEFORE = 1.0
_LOAD_AFTER = 1.0
_RECOVERY_LIMIT = 60.0


class _Load:
    """What the threads saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.published: dict[bytes, tuple[Descriptor, float]] = {}
        self.wrong: list[tuple[Descriptor, Descriptor]] = []
        self.errors: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.failed_puts = 0
        self.victim_read_ok_at: float | None = None
        self.victim_write_ok_at: float | None = None
        self.stop = threading.Event()

    def error(self, exc: BaseException) -> None:
        with self.lock:
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + 1


@pytest.fixture
def loaded(redis_cluster: RedisDeployment) -> Iterator[RedisIndex]:
    index = redis_index(
        redis_cluster, IndexConfig(grace=0.0, headroom=0.0), node_ttl="300s", timeout="1s"
    )
    assert isinstance(index, RedisIndex)
    # Six arenas, two per master.
    index.register_node(
        NodeInfo(
            name="n1",
            regions=tuple(RegionInfo(id=i, size=8 * _MIB, rkey=100 + i) for i in range(6)),
            endpoints=(),
        )
    )
    yield index
    try:
        index.purge()
    finally:
        index.close()


def _victim(deployment: RedisDeployment, index: RedisIndex, keys: list[bytes]) -> int:
    """A master that holds some of ``keys`` and still has a replica in sync."""
    holding = {index.shard_of(k) for k in keys}
    for port in deployment.masters():
        if f"127.0.0.1:{port}" not in holding:
            continue
        info = deployment.client(port).info("replication")
        if int(info.get("connected_slaves", 0)) >= 1:
            return port
    raise AssertionError("no master with a replica holds any key")


def _writer(
    index: RedisIndex, keys: list[bytes], victim_keys: set[bytes], load: _Load, killed: list[float]
) -> None:
    position = 0
    while not load.stop.is_set() and position < len(keys):
        batch = keys[position : position + 8]
        position += 8
        try:
            result = index.allocate([AllocationRequest(key=k, length=1000) for k in batch])
            grants = [
                a.descriptor
                for a in result.allocations
                if a.kind is AllocationKind.GRANTED and a.descriptor is not None
            ]
            flags = index.publish([GrantRef.of(d, crc=d.version & 0xFFFF) for d in grants])
        except ControllerUnavailableError as exc:
            load.error(exc)
            continue
        except Exception as exc:
            load.error(exc)
            raise
        now = time.monotonic()
        with load.lock:
            load.failed_puts += len(batch) - sum(flags)
            for descriptor, ok in zip(grants, flags, strict=True):
                if not ok:
                    continue
                load.published[descriptor.key] = (_as_published(descriptor), now)
                if killed and descriptor.key in victim_keys and load.victim_write_ok_at is None:
                    load.victim_write_ok_at = now
        time.sleep(0.002)  # the pace of the load


def _reader(index: RedisIndex, victim_keys: set[bytes], load: _Load, killed: list[float]) -> None:
    rng = random.Random()
    while not load.stop.is_set():
        with load.lock:
            known = list(load.published)
        batch = rng.sample(known, min(16, len(known)))
        try:
            found = index.resolve(batch)
        except ControllerUnavailableError as exc:
            load.error(exc)
            continue
        except Exception as exc:
            load.error(exc)
            raise
        now = time.monotonic()
        with load.lock:
            for key, descriptor in zip(batch, found, strict=True):
                if descriptor is None:
                    load.misses += 1
                    continue
                load.hits += 1
                expected, _ = load.published[key]
                if descriptor != expected:
                    load.wrong.append((descriptor, expected))
                if killed and key in victim_keys and load.victim_read_ok_at is None:
                    load.victim_read_ok_at = now
        time.sleep(0.002)  # the pace of the load


def _as_published(descriptor: Descriptor) -> Descriptor:
    """The descriptor as published, with the crc the writers use."""
    return attrs.evolve(descriptor, crc=descriptor.version & 0xFFFF)


def _overlaps(descriptors: list[Descriptor]) -> int:
    by_region: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for d in descriptors:
        by_region.setdefault((d.node, d.region), []).append((d.offset, record_size(d.length)))
    overlaps = 0
    for extents in by_region.values():
        extents.sort()
        for (a, size), (b, _) in itertools.pairwise(extents):
            overlaps += a + size > b
    return overlaps


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_a_master_killed_under_load_fails_over_with_no_wrong_descriptor(
    redis_cluster: RedisDeployment, loaded: RedisIndex, wait_replicas: int
) -> None:
    writer_index = RedisIndex.create(
        IndexConfig(
            grace=0.0,
            headroom=0.0,
            options={
                "url": redis_cluster.url,
                "namespace": loaded.namespace,
                "timeout": "1s",
                "wait_replicas": str(wait_replicas),
            },
        )
    )
    salt = str(time.monotonic_ns()).encode()
    preload = [fold_key(i, b"pre" + salt) for i in range(400)]
    fresh = [fold_key(i, b"new" + salt) for i in range(20000)]
    load = _Load()
    killed: list[float] = []
    try:
        result = writer_index.allocate([AllocationRequest(key=k, length=1000) for k in preload])
        grants = [a.descriptor for a in result.allocations if a.descriptor is not None]
        assert len(grants) == len(preload)
        assert all(writer_index.publish([GrantRef.of(d, crc=d.version & 0xFFFF) for d in grants]))
        for d in grants:
            load.published[d.key] = (_as_published(d), 0.0)
        victim = _victim(redis_cluster, loaded, preload)
        address = f"127.0.0.1:{victim}"
        victim_keys = {k for k in preload + fresh if loaded.shard_of(k) == address}
        threads = [
            threading.Thread(
                target=_writer, args=(writer_index, fresh[:10000], victim_keys, load, killed)
            ),
            threading.Thread(
                target=_writer, args=(writer_index, fresh[10000:], victim_keys, load, killed)
            ),
            threading.Thread(target=_reader, args=(loaded, victim_keys, load, killed)),
            threading.Thread(target=_reader, args=(loaded, victim_keys, load, killed)),
        ]
        for thread in threads:
            thread.start()
        time.sleep(_LOAD_BEFORE)  # the load runs a while: the kill lands in its midst
        redis_cluster.kill(victim)
        killed.append(time.monotonic())
        failover = redis_cluster.wait_healthy(timeout=_RECOVERY_LIMIT)
        wait_for(
            "reads and puts of the killed master's keys resumed",
            lambda: (load.victim_read_ok_at, load.victim_write_ok_at),
            _RECOVERY_LIMIT,
            until=lambda resumed: None not in resumed,
        )
        time.sleep(_LOAD_AFTER)  # and a while on the promoted replica
        load.stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in threads)

        # Every error was the index saying Redis could not be reached.
        assert set(load.errors) <= {"ControllerUnavailableError"}, load.errors
        assert load.wrong == []
        assert load.victim_read_ok_at is not None
        assert load.victim_write_ok_at is not None

        # After the failover: what was acknowledged is there, exactly as published.
        with load.lock:
            published = dict(load.published)
        keys = list(published)
        found = loaded.resolve(keys)
        lost = [k for k, d in zip(keys, found, strict=True) if d is None]
        wrong = [d for d in found if d is not None and d != published[d.key][0]]
        assert wrong == []
        assert _overlaps([d for d in found if d is not None]) == 0
        window = [k for k in lost if killed[0] - 1.0 <= published[k][1] <= killed[0]]
        print(
            f"wait_replicas={wait_replicas}: failover {failover:.2f}s after the kill; "
            f"reads of its keys hit again after {load.victim_read_ok_at - killed[0]:.2f}s, "
            f"puts resumed after {load.victim_write_ok_at - killed[0]:.2f}s; "
            f"{len(published)} acknowledged publishes, {len(lost)} lost "
            f"({len(window)} of them acknowledged in the last second before the kill); "
            f"{load.hits} hits, {load.misses} misses, {load.failed_puts} puts not stored, "
            f"errors {load.errors}"
        )
        if wait_replicas:
            assert lost == []
        else:
            assert lost == window
    finally:
        load.stop.set()
        writer_index.close()
