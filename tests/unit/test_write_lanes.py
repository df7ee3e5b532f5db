"""How a node's write is split into lanes (``TransportClient.write_lanes``): whole records,
in order, about equal bytes each, and none below ``LANE_MIN_BYTES``."""

from __future__ import annotations

import pytest

from kvfabric._client.record_io import LANE_MIN_BYTES, _split_by_bytes
from kvfabric.descriptor import Descriptor

_MIB = 1 << 20


def _descriptors(lengths: list[int]) -> list[Descriptor]:
    return [
        Descriptor(
            key=i.to_bytes(32, "little"),
            node=1,
            region=0,
            offset=0,
            length=n,
            rkey=0,
            version=1,
            crc=0,
        )
        for i, n in enumerate(lengths)
    ]


def _bytes(runs: list[list[int]], ds: list[Descriptor]) -> list[int]:
    return [sum(ds[i].length for i in run) for run in runs]


def test_equal_records_split_into_halves_in_order() -> None:
    ds = _descriptors([4 * _MIB] * 64)
    runs = _split_by_bytes(list(range(64)), ds, 2)
    assert runs == [list(range(32)), list(range(32, 64))]


def test_uneven_records_split_near_equal_bytes() -> None:
    ds = _descriptors([12 * _MIB, _MIB, _MIB, _MIB, 4 * _MIB, 4 * _MIB, _MIB])
    runs = _split_by_bytes(list(range(7)), ds, 2)
    assert [i for run in runs for i in run] == list(range(7))
    assert _bytes(runs, ds) == [12 * _MIB, 12 * _MIB]


@pytest.mark.parametrize(
    ("lengths", "lanes"),
    [
        ([LANE_MIN_BYTES // 4 - 1] * 4, 2),  # just under the minimum in all
        ([64 * _MIB], 2),  # one record: nothing to split
        ([4 * _MIB] * 64, 1),  # the transport asks for one lane
    ],
    ids=["below-minimum", "one-record", "one-lane"],
)
def test_a_write_that_should_not_split_is_one_run(lengths: list[int], lanes: int) -> None:
    ds = _descriptors(lengths)
    assert _split_by_bytes(list(range(len(ds))), ds, lanes) == [list(range(len(ds)))]


def test_more_lanes_than_records_leave_no_run_empty() -> None:
    ds = _descriptors([8 * _MIB] * 3)
    runs = _split_by_bytes([0, 1, 2], ds, 8)
    assert runs == [[0], [1], [2]]
