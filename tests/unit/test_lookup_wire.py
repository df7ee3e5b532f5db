"""A lookup's wire forms as the client keeps them: the keys a controller reads (any byte
values, NULs included) and a reply's leading run kept packed until a read asks for one."""

from __future__ import annotations

import struct

import pytest

from kvfabric._runtime.codec import Reader
from kvfabric._wire import protocol as p
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.errors import ProtocolError
from kvfabric.keys import KEY_SIZE, fold_key
from kvfabric.spi.index import Copies


def _d(n: int) -> Descriptor:
    return Descriptor(
        key=fold_key(n, b"lookup"),
        node=1 + n % 3,
        region=n % 2,
        offset=4096 * n,
        length=100 + n,
        rkey=7,
        version=1000 + n,
        crc=n,
    )


def test_keys_of_any_bytes_round_trip_including_trailing_nuls() -> None:
    keys = [bytes(KEY_SIZE), b"\x01" + bytes(KEY_SIZE - 1), bytes(range(KEY_SIZE))]
    got = p.read_keys(Reader(p.write_keys(keys)))
    assert got == keys
    assert {type(k) for k in got} == {bytes}


def test_a_leading_run_reads_back_packed_and_equal_to_what_was_written() -> None:
    found: list[Descriptor | None] = [_d(i) for i in range(5)]
    got = p.read_copies(
        Reader(p.write_copies(Copies(descriptors=found), optional=False)), optional=False
    )
    assert isinstance(got.descriptors, PackedDescriptors)
    assert got == Copies(descriptors=found)
    packed = got.descriptors
    assert len(packed) == 5
    assert packed[0] == _d(0)
    assert packed[-1] == _d(4)
    assert packed[1:3] == [_d(1), _d(2)]
    assert list(packed) == found
    with pytest.raises(IndexError):
        packed[5]


def test_a_leading_run_keeps_its_other_copies() -> None:
    found = Copies(descriptors=[_d(1), _d(2)], alternates={1: (_d(12), _d(22))})
    r = Reader(p.write_copies(found, optional=False))
    assert p.read_copies(r, optional=False) == found
    r.end()


def test_other_copies_past_the_run_are_refused() -> None:
    found = Copies(descriptors=[_d(1)], alternates={0: (_d(11),)})
    raw = bytearray(p.write_copies(found, optional=False))
    section = len(raw) - DESCRIPTOR_SIZE - 1 - 4
    raw[section : section + 4] = struct.pack("<I", 1)  # position 1: past the one found
    with pytest.raises(ProtocolError, match="holds no copy"):
        p.read_copies(Reader(bytes(raw)), optional=False)


def test_packed_descriptors_refuse_a_partial_wire_form() -> None:
    with pytest.raises(ProtocolError, match="units"):
        PackedDescriptors(bytes(DESCRIPTOR_SIZE + 1))
