"""The controller's per-client reservations: what a client holds, its bound, its release."""

from __future__ import annotations

from collections import Counter
from typing import Any

from manual_clock import Clock

from kvfabric._control.reservations import ReservationLimits, Reservations
from kvfabric._runtime.record import record_size
from kvfabric.descriptor import Descriptor
from kvfabric.spi import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    Extent,
    GrantRef,
)

_CAPACITY = 1 << 20
_LENGTH = 4096 - 64  # one record: 4 KiB with its header


def _key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def _requests(first: int, count: int) -> list[AllocationRequest]:
    return [AllocationRequest(key=_key(first + i), length=_LENGTH) for i in range(count)]


def _granted(requests: list[AllocationRequest], lease: float = 10.0) -> AllocateResult:
    return AllocateResult(
        allocations=tuple(
            Allocation(
                kind=AllocationKind.GRANTED,
                descriptor=Descriptor(
                    key=r.key, node=1, region=0, offset=0, length=r.length, rkey=1, version=7, crc=0
                ),
            )
            for r in requests
        ),
        lease=lease,
    )


def _reservations(**limits: Any) -> tuple[Reservations, Counter[str], Clock]:
    counters: Counter[str] = Counter()
    clock = Clock()
    return (
        Reservations(ReservationLimits(**limits), lambda: _CAPACITY, counters, clock),
        counters,
        clock,
    )


def test_a_client_is_admitted_up_to_its_share_of_the_capacity_and_no_further() -> None:
    reservations, counters, _ = _reservations(share=0.25)
    requests = _requests(0, 100)
    admitted = reservations.admit(5, requests)
    assert admitted == (_CAPACITY // 4) // record_size(_LENGTH) == 64
    reservations.granted(5, _granted(requests[:admitted]))
    assert reservations.admit(5, _requests(1000, 1)) == 0
    assert counters["reservations_refused"] == 36 + 1
    # Another client is not affected.
    assert reservations.admit(6, _requests(2000, 10)) == 10


def test_publish_abort_and_expiry_release_what_was_held() -> None:
    reservations, _, clock = _reservations(grants=10)
    first, second, third = _requests(0, 10), _requests(100, 10), _requests(200, 10)
    reservations.granted(1, _granted(first))
    assert reservations.admit(1, _requests(900, 1)) == 0
    reservations.published([GrantRef(key=r.key, version=7) for r in first[:4]], [True] * 4)
    reservations.aborted([GrantRef(key=r.key, version=7) for r in first[4:7]])
    # A refused publish (the grant's lease ran out) is gone too; a stranger's version is not.
    reservations.published([GrantRef(key=first[7].key, version=7)], [False])
    reservations.published([GrantRef(key=first[8].key, version=99)], [False])
    assert reservations.admit(1, second) == 8
    clock.now += 5.0
    reservations.granted(1, _granted(second[:8]))
    assert reservations.stats()["reserved_grants"] == 10
    clock.now += 5.0
    reservations.expire()
    assert reservations.stats()["reserved_grants"] == 8  # the second lease still runs
    clock.now += 5.0
    reservations.expire()
    assert reservations.stats() == {
        "reserving_clients": 0,
        "reserved_bytes": 0,
        "reserved_grants": 0,
        "reserved_extents": 0,
    }
    assert reservations.admit(1, third) == 10


def test_extents_count_against_the_same_bound_until_returned_or_expired() -> None:
    reservations, _, clock = _reservations(bytes=64 << 10, grants=100)
    assert reservations.extent_room(3) == (64 << 10, 100)
    extent = Extent(
        id=11,
        node=1,
        region=0,
        rkey=1,
        offset=0,
        size=48 << 10,
        first_version=1,
        versions=100,
        lease=10.0,
    )
    reservations.leased(3, [extent])
    assert reservations.extent_room(3) == (16 << 10, 99)
    assert reservations.admit(3, _requests(0, 8)) == 4
    reservations.returned([11, 12])  # an id it never held is nothing to release
    assert reservations.extent_room(3) == (64 << 10, 100)
    reservations.leased(3, [extent])
    clock.now += 10.0
    reservations.expire()
    assert reservations.extent_room(3) == (64 << 10, 100)
