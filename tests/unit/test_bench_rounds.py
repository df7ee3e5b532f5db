"""`kvfabric bench --rounds N`: each target over the rounds, its median and rounds met."""

from __future__ import annotations

import io

from kvfabric._tools.bench_report import Target, print_rounds_summary


def _put(value: float | None, note: str = "") -> Target:
    return Target("put, tcp / InfiniStore", value, 1.0, True, "x", note)


def _contains(value: float | None) -> Target:
    return Target("contains 64 over shm", value, 20.0, False, "us")


def _summary(rounds: list[list[Target]]) -> list[str]:
    out = io.StringIO()
    print_rounds_summary(rounds, out)
    return out.getvalue().splitlines()


def test_each_target_shows_every_round_its_median_and_the_rounds_it_met() -> None:
    lines = _summary(
        [
            [_put(0.9), _contains(25.0)],
            [_put(1.1), _contains(12.0)],
            [_put(1.2), _contains(9.0)],
        ]
    )
    assert lines[1] == "targets over 3 rounds (issue 12): each round, median, rounds met"
    put, contains = lines[2], lines[3]
    assert put.split("InfiniStore")[1].split() == [
        *("0.90", "1.10", "1.20", "1.10x"),
        *("(goal", ">=", "1x)", "met", "2/3"),
    ]
    # A ceiling: 25 us misses it, 12 and 9 meet it.
    assert contains.split("shm")[1].split() == [
        *("25.00", "12.00", "9.00", "12.00us"),
        *("(goal", "<=", "20us)", "met", "2/3"),
    ]


def test_a_round_without_a_value_shows_na_and_counts_against_the_rounds_met() -> None:
    lines = _summary([[_put(1.5, "mooncake")], [_put(None)], [_put(1.4, "infinistore")]])
    row = lines[2]
    assert "1.50     n/a    1.40" in row
    assert row.endswith("met 2/3")
    # The best peer may differ by round: one row per target all the same.
    assert len(lines) == 3


def test_a_target_never_measured_has_no_median_and_no_count() -> None:
    lines = _summary([[_put(None)], [_put(None)]])
    assert lines[2].split("InfiniStore")[1].split() == ["n/a", "n/a", "n/a", "(goal", ">=", "1x)"]
