"""Wire forms of extents: the lease request and reply, carved records and their outcomes.

Each round-trips field for field; a frame that lies (a count past its end, an extent that
wraps the address space, an outcome no one defined) is refused with a ProtocolError.
"""

from __future__ import annotations

import struct

import pytest

from kvfabric._runtime.codec import Reader
from kvfabric._wire import write_bodies as wb
from kvfabric.errors import ProtocolError
from kvfabric.keys import fold_key
from kvfabric.spi.index import CarvedRecord, CarveOutcome, Extent


def _extent(n: int) -> Extent:
    return Extent(
        id=n,
        node=2 + n,
        region=1,
        rkey=99,
        offset=n << 20,
        size=16 << 20,
        first_version=10_000 * n,
        versions=1 << 18,
        lease=30.0,
        evictions=n,
    )


def test_a_lease_request_round_trips() -> None:
    raw = wb.write_lease_request(4096, 1 << 26, 2, [3, 4], [7, 8, 9])
    r = Reader(raw)
    assert wb.read_lease_request(r) == (4096, 1 << 26, 2, [3, 4], [7, 8, 9])
    r.end()


def test_a_lease_reply_round_trips_with_none_or_several_extents() -> None:
    for extents in ([], [_extent(1)], [_extent(1), _extent(2)]):
        r = Reader(wb.write_extents(extents))
        assert wb.read_extents(r) == extents
        r.end()


def test_carved_records_and_the_keys_stored_again_round_trip() -> None:
    records = [
        CarvedRecord(extent=1, key=fold_key(n, b"c"), offset=64 * n, length=n, version=n, crc=n)
        for n in range(3)
    ]
    again = [fold_key(9, b"again")]
    r = Reader(wb.write_carved(records, again))
    assert wb.read_carved(r) == (records, again)
    r.end()


def test_outcomes_round_trip() -> None:
    outcomes = list(CarveOutcome)
    r = Reader(wb.write_carve_outcomes(outcomes))
    assert wb.read_carve_outcomes(r) == outcomes


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(struct.pack("<QQI", 1, 1, 1 << 20) + struct.pack("<II", 0, 0), id="count"),
        pytest.param(struct.pack("<QQI", 1, 1, 1) + struct.pack("<I", 5), id="excluded-short"),
        pytest.param(struct.pack("<QQI", 1, 1, 1) + struct.pack("<II", 0, 5), id="returned-short"),
        pytest.param(struct.pack("<QQ", 1, 1), id="truncated"),
    ],
)
def test_a_lease_request_that_lies_is_refused(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        wb.read_lease_request(Reader(frame))


def test_an_extent_that_wraps_the_address_space_is_refused() -> None:
    wrapping = Extent(
        id=1,
        node=1,
        region=1,
        rkey=1,
        offset=(1 << 64) - 4096,
        size=8192,
        first_version=1,
        versions=1,
        lease=1.0,
    )
    with pytest.raises(ProtocolError, match="extent of"):
        wb.read_extents(Reader(wb.write_extents([wrapping])))


def test_an_unknown_outcome_is_refused() -> None:
    with pytest.raises(ProtocolError, match="unknown carve outcome 9"):
        wb.read_carve_outcomes(Reader(struct.pack("<I", 2) + b"\x01\x09"))


def test_carved_records_past_the_frame_are_refused() -> None:
    raw = wb.write_carved([], [])
    with pytest.raises(ProtocolError):
        wb.read_carved(Reader(struct.pack("<I", 3) + raw[4:]))
