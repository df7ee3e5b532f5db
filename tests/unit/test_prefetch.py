from __future__ import annotations

import threading

from kvfabric._client.prefetch import PrefetchCache
from kvfabric.descriptor import Descriptor
from kvfabric.keys import fold_key


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _d(n: int) -> Descriptor:
    return Descriptor(
        key=fold_key(n), node=1, region=0, offset=n * 128, length=10, rkey=1, version=n, crc=0
    )


def test_remembers_and_returns_descriptors_in_key_order() -> None:
    cache = PrefetchCache(max_entries=10, ttl=5)
    cache.remember([_d(1), _d(2)])
    assert cache.take([fold_key(2), fold_key(3), fold_key(1)]) == [_d(2), None, _d(1)]


def test_bounded_by_entries_oldest_first() -> None:
    cache = PrefetchCache(max_entries=3, ttl=5)
    cache.remember([_d(1), _d(2)])
    cache.remember([_d(3), _d(4)])
    assert len(cache) == 3
    assert cache.take([fold_key(1)]) == [None]
    assert cache.take([fold_key(4)]) == [_d(4)]


def test_entries_expire_after_ttl() -> None:
    clock = Clock()
    cache = PrefetchCache(max_entries=10, ttl=2.0, clock=clock)
    cache.remember([_d(1)])
    clock.now = 1.9
    assert cache.take([fold_key(1)]) == [_d(1)]
    clock.now = 2.1
    assert cache.take([fold_key(1)]) == [None]
    assert len(cache) == 0


def test_drop_forgets_keys() -> None:
    cache = PrefetchCache()
    cache.remember([_d(1), _d(2)])
    cache.drop([fold_key(1)])
    assert cache.take([fold_key(1), fold_key(2)]) == [None, _d(2)]


def test_zero_entries_disables_it() -> None:
    cache = PrefetchCache(max_entries=0)
    cache.remember([_d(1)])
    assert cache.take([fold_key(1)]) == [None]


def test_concurrent_use_keeps_the_bound() -> None:
    cache = PrefetchCache(max_entries=100, ttl=60)

    def work(base: int) -> None:
        for i in range(200):
            cache.remember([_d(base + i), _d(base + i + 1)])
            cache.take([fold_key(base + i)])
            cache.drop([fold_key(base + i - 5)])

    threads = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) <= 100
