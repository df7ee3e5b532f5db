"""`kvfabric bench --rounds N`: each target over the rounds, its median and rounds met; the
room a host leaves reads beside a busy loop."""

from __future__ import annotations

import io

from kvfabric._tools.bench_report import Target, print_report, print_rounds_summary, targets
from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import Phase


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
    assert lines[1] == "targets over 3 rounds: each round, median, rounds met"
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


def _reads(system: str, cores: float | None, cpus: int | None) -> list[BenchRow]:
    common = {"system": system, "size": 4 << 20, "count": 64}
    return [
        BenchRow(phase=Phase.READS_ALONE, seconds=0.05, cores=cores, cpus=cpus, **common),
        BenchRow(phase=Phase.READS_BUSY, seconds=0.08, kept=0.9, **common),
    ]


def test_reads_beside_a_busy_loop_say_what_room_the_host_leaves_them() -> None:
    """Reads that kept 1.65 cores busy alone (client and node) on a 2-CPU host have one CPU
    left beside a busy loop: room 1 / 1.65 = 0.61, shown beside the ratio, which the host
    and not the reads sets. On 8 CPUs the room is whole and nothing is added."""
    rows = [*_reads("kvfabric tcp", 1.65, 2), *_reads("kvfabric shm", 1.0, 8)]
    [tcp_alone, _, shm_alone, _] = rows
    assert tcp_alone.room is not None
    assert round(tcp_alone.room, 2) == 0.61
    assert shm_alone.room == 1.0
    assert BenchRow.from_json(tcp_alone.to_json()) == tcp_alone
    by_label = {t.label: t for t in targets(rows, [4 << 20], 64)}
    tcp, shm = (
        by_label["reads beside busy / alone, tcp"],
        by_label["reads beside busy / alone, shm"],
    )
    assert (tcp.value, tcp.met, tcp.note) == (0.625, False, "room 0.61")
    assert (shm.value, shm.note) == (0.625, "")
    out = io.StringIO()
    print_report(rows, sizes=[4 << 20], count=64, repeat=3, problems={}, notes=[], out=out)
    table = out.getvalue().split("reads (contains + get)")[1]
    assert "room" in table
    assert "a host of 2 CPUs" in table
    tcp_line = next(line for line in table.splitlines() if line.startswith("kvfabric tcp"))
    assert tcp_line.split()[-2:] == ["1.65", "0.61"]


def test_reads_measured_without_their_cores_have_no_room() -> None:
    rows = _reads("kvfabric tcp", None, None)
    assert rows[0].room is None
    [target] = [t for t in targets(rows, [4 << 20], 64) if t.label.startswith("reads")]
    assert target.note == ""
