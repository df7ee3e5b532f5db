"""How a large tcp read is cut into lanes (``tcp.read_lanes``): about equal bytes each, never
inside a CRC span, each lane one frame; and the option itself."""

from __future__ import annotations

import itertools
import os
import uuid

import numpy as np
import pytest

import kvfabric
from kvfabric import chain_keys
from kvfabric.errors import ConfigError
from kvfabric.spi import Segment
from kvfabric.transports.tcp.batches import READ_LANE_MIN, lane_cuts
from kvfabric.transports.tcp.tuning import MAX_READ_LANES, parse_read_lanes
from kvfabric.transports.tcp.wire import MAX_COUNT

_MIB = 1 << 20


def _segments(sizes: list[int]) -> list[Segment]:
    # Views of one shared buffer: only their sizes matter to a cut.
    buf = memoryview(bytearray(max(sizes)))
    return [Segment(0, 0, 0, buf[:n]) for n in sizes]


def _lane_bytes(sizes: list[int], cuts: list[int]) -> list[int]:
    bounds = [0, *cuts, len(sizes)]
    return [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]


def test_equal_records_are_cut_into_equal_lanes_between_records() -> None:
    # A record as a store reads it: a 64-byte header, then its payload (the span).
    sizes = [64, 4 * _MIB] * 64
    spans = [(i + 1, i + 2) for i in range(0, len(sizes), 2)]
    assert lane_cuts(_segments(sizes), spans, 2) == [64]
    assert lane_cuts(_segments(sizes), spans, 4) == [32, 64, 96]


def test_a_cut_never_falls_inside_a_span() -> None:
    sizes = [4 * _MIB] * 8
    spans = [(0, 5), (5, 8)]  # the middle (4) is inside the first span
    cuts = lane_cuts(_segments(sizes), spans, 2)
    assert cuts == [5]
    assert _lane_bytes(sizes, cuts) == [20 * _MIB, 12 * _MIB]


@pytest.mark.parametrize(
    ("sizes", "spans", "lanes"),
    [
        ([READ_LANE_MIN // 4 - 1] * 4, None, 2),  # just under the minimum in all
        ([64 * _MIB], None, 2),  # one segment: nothing to cut
        ([4 * _MIB] * 8, [(0, 8)], 2),  # one span over the whole read
        ([4 * _MIB] * 8, None, 1),  # one lane asked for
        ([READ_LANE_MIN] + [1] * (2 * MAX_COUNT), None, 2),  # a lane past one frame
    ],
    ids=["below-minimum", "one-segment", "one-span", "one-lane", "lane-past-a-frame"],
)
def test_a_read_that_should_not_be_cut_has_no_cuts(
    sizes: list[int], spans: list[tuple[int, int]] | None, lanes: int
) -> None:
    assert lane_cuts(_segments(sizes), spans, lanes) is None


def test_uneven_segments_are_cut_where_half_the_bytes_are_reached() -> None:
    sizes = [12 * _MIB, _MIB, _MIB, _MIB, 4 * _MIB, 4 * _MIB, _MIB]
    cuts = lane_cuts(_segments(sizes), None, 2)
    assert cuts == [1]
    assert _lane_bytes(sizes, cuts) == [12 * _MIB, 12 * _MIB]


def test_read_lanes_auto_is_two_on_four_cpus_or_more_else_one() -> None:
    expected = 2 if len(os.sched_getaffinity(0)) >= 4 else 1
    assert parse_read_lanes("auto") == parse_read_lanes(" AUTO ") == expected
    assert parse_read_lanes("3") == parse_read_lanes(3) == 3


@pytest.mark.parametrize("text", ["0", str(MAX_READ_LANES + 1), "two", "-1"])
def test_read_lanes_outside_1_to_8_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"tcp\.read_lanes is auto or 1 to 8"):
        parse_read_lanes(text)


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_stores_get_goes_in_as_many_frames_as_its_url_asks_lanes(lanes: int) -> None:
    values = [np.random.default_rng(i).integers(0, 256, 4 * _MIB, dtype=np.uint8) for i in range(4)]
    keys = chain_keys(list(range(4)), 1, namespace=uuid.uuid4().bytes)
    url = f"embedded://?capacity=64MiB&transport=tcp&timeout=60s&tcp.read_lanes={lanes}"
    with kvfabric.connect(url) as store:
        assert {o.value for o in store.batched_put(keys, values)} == {"stored"}
        assert store.local_node is not None
        server = store.local_node.servers["tcp"]
        frames = server.stats()["frames"]
        got = store.batched_get(keys)
        assert server.stats()["frames"] - frames == lanes
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))


def test_a_store_refuses_read_lanes_outside_1_to_8_in_its_url() -> None:
    with pytest.raises(ConfigError, match=r"tcp\.read_lanes"):
        kvfabric.connect("embedded://?capacity=64MiB&transport=tcp&tcp.read_lanes=9")
