"""Wire forms of replicas: allocations with further grants, lookups with alternates.

Frames of a store without replicas stay byte for byte what they were (no flag, no section);
the additions round-trip, and a reply that names copies of a key it did not find is refused.
"""

from __future__ import annotations

import struct

import pytest

from kvfabric._runtime.codec import Reader
from kvfabric._wire import protocol as p
from kvfabric._wire import write_bodies as wb
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import ProtocolError
from kvfabric.keys import fold_key
from kvfabric.spi.index import AllocateResult, Allocation, AllocationKind, Copies


def _d(n: int, node: int = 1) -> Descriptor:
    return Descriptor(
        key=fold_key(n, b"wire"),
        node=node,
        region=0,
        offset=4096 * n,
        length=100,
        rkey=7,
        version=1000 + n,
        crc=n,
    )


def test_an_allocation_without_replicas_is_written_as_before() -> None:
    result = AllocateResult(
        allocations=(
            Allocation(kind=AllocationKind.GRANTED, descriptor=_d(1)),
            Allocation(kind=AllocationKind.NO_SPACE),
        ),
        lease=30.0,
    )
    raw = wb.write_allocate_result(result)
    assert raw == struct.pack("<III", 0, 30000, 2) + b"\x01" + _d(1).to_bytes() + b"\x04"
    assert wb.read_allocate_result(Reader(raw)) == result


def test_allocations_with_further_grants_round_trip() -> None:
    result = AllocateResult(
        allocations=(
            Allocation(
                kind=AllocationKind.GRANTED, descriptor=_d(1), replicas=(_d(2, 2), _d(3, 3))
            ),
            Allocation(kind=AllocationKind.EXISTS, descriptor=_d(4), replicas=(_d(5, 2),)),
            Allocation(kind=AllocationKind.IN_FLIGHT),
        ),
        evictions=3,
        lease=1.5,
    )
    r = Reader(wb.write_allocate_result(result))
    assert wb.read_allocate_result(r) == result
    r.end()


def test_replicas_on_an_allocation_without_a_descriptor_are_refused() -> None:
    raw = struct.pack("<III", 0, 0, 1) + bytes([AllocationKind.NO_SPACE.value | wb.WITH_REPLICAS])
    with pytest.raises(ProtocolError, match="cannot carry replicas"):
        wb.read_allocate_result(Reader(raw + b"\x00"))


@pytest.mark.parametrize("optional", [False, True])
def test_lookups_without_other_copies_are_written_as_before(optional: bool) -> None:
    found: list[Descriptor | None] = [_d(1), _d(2)]
    raw = p.write_copies(Copies(descriptors=found), optional=optional)
    plain = p.write_optional_descriptors(found) if optional else p.write_descriptors(found)  # type: ignore[arg-type]
    assert raw == plain
    assert p.read_copies(Reader(raw), optional=optional) == Copies(descriptors=found)


def test_resolve_replies_carry_the_other_copies_of_the_keys_found() -> None:
    found = Copies(
        descriptors=[_d(1), None, _d(3)], alternates={0: (_d(11, 2),), 2: (_d(13, 2), _d(23, 3))}
    )
    r = Reader(p.write_copies(found, optional=True))
    assert p.read_copies(r, optional=True) == found
    r.end()


def test_alternates_of_a_key_not_found_are_refused() -> None:
    found = Copies(descriptors=[_d(1), None], alternates={0: (_d(11, 2),)})
    raw = bytearray(p.write_copies(found, optional=True))
    # Point the section at position 1, which holds no descriptor.
    section = len(raw) - DESCRIPTOR_SIZE - 1 - 4
    raw[section : section + 4] = struct.pack("<I", 1)
    with pytest.raises(ProtocolError, match="holds no copy"):
        p.read_copies(Reader(bytes(raw)), optional=True)
