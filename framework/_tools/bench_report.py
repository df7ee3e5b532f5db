"""The tables ``kvfabric bench`` prints, and the targets kvfabric is held to, marked met or not.

Four tables from one round's rows: data phases in GB/s per chunk size (systems side by side,
the floors above them), lookups (time per call by keys per call, the path each took, the
controller's CPU per lookup), reads beside a busy Python thread, and the targets: each
measured ratio beside its goal. With several rounds, a last table gives each target over
them: its value in each, the median, and in how many rounds it was met.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import IO

import attrs

from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import Phase

__all__ = ["Target", "print_report", "print_rounds_summary", "size_name", "targets"]

_PEERS = ("redis", "mooncake", "infinistore")
_KVFABRIC = ("kvfabric tcp", "kvfabric shm", "kvfabric ucx")
_DATA_PHASES = (Phase.PUT_FRESH, Phase.PUT_WARM, Phase.GET, Phase.RE_PUT)
Write = Callable[[str], object]


def size_name(n: int) -> str:
    """4 MiB, 256 KiB, 64 B."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:g} {unit}"
    return f"{n} B"


class _Rows:
    def __init__(self, rows: Sequence[BenchRow]) -> None:
        self.rows = list(rows)

    def find(
        self, system: str, phase: str, size: int | None = None, count: int | None = None
    ) -> BenchRow | None:
        for row in self.rows:
            if (
                row.system == system
                and row.phase == phase
                and (size is None or row.size == size)
                and (count is None or row.count == count)
            ):
                return row
        return None

    def systems(self, candidates: Sequence[str]) -> list[str]:
        present = {row.system for row in self.rows}
        return [s for s in candidates if s in present]


@attrs.frozen
class Target:
    """One target (a ratio or a time and its goal) as one round measured it."""

    label: str
    value: float | None
    goal: float
    at_least: bool
    """The goal is a floor (else a ceiling)."""
    unit: str
    note: str = ""
    """What the value was measured against where that can change (the best peer), or what
    the host leaves it (the room for reads beside a busy loop, where below the goal)."""

    @property
    def sign(self) -> str:
        return ">=" if self.at_least else "<="

    def meets(self, value: float) -> bool:
        return value >= self.goal if self.at_least else value <= self.goal

    @property
    def met(self) -> bool:
        return self.value is not None and self.meets(self.value)


def print_report(
    rows: Sequence[BenchRow],
    *,
    sizes: Sequence[int],
    count: int,
    repeat: int,
    problems: dict[str, str],
    notes: Sequence[str],
    out: IO[str],
    heading: str = "",
) -> None:
    """``problems``: per system that has no rows (or not all), why; ``heading``: which
    round this is, when there are several."""
    found = _Rows(rows)
    w = out.write
    w(f"\nkvfabric bench{heading}: {count} chunks per batch, medians of {repeat}\n")
    for note in notes:
        w(f"  {note}\n")
    systems = [*found.systems(_PEERS), *found.systems(_KVFABRIC)]
    for size in sizes:
        _data_table(found, systems, size, count, w)
    _lookup_table(found, count, w)
    _busy_table(found, w)
    for system, problem in problems.items():
        w(f"{system}: {problem}\n")
    _targets(found, sizes, count, w)


def _cell(text: str, width: int = 13) -> str:
    return f"{text:>{width}}"


def _data_table(found: _Rows, systems: list[str], size: int, count: int, w: Write) -> None:
    memcpy = found.find("memcpy", Phase.COPY, size)
    stream = found.find("raw socket", Phase.STREAM, size)
    floors = ", ".join(
        f"{name} {row.gbps:.2f} GB/s"
        for name, row in (("memcpy", memcpy), ("raw socket", stream))
        if row
    )
    w(f"\n{count} x {size_name(size)} (GB/s; floors: {floors or 'not measured'})\n")
    w(f"{'phase':<12}" + "".join(_cell(s.replace("kvfabric ", "kvf ")) for s in systems) + "\n")
    for phase in _DATA_PHASES:
        cells = []
        for system in systems:
            row = found.find(system, phase, size)
            cells.append(_cell(f"{row.gbps:.2f}" if row else "-"))
        if any(c.strip() != "-" for c in cells):
            w(f"{phase:<12}" + "".join(cells) + "\n")


def _lookup_table(found: _Rows, count: int, w: Write) -> None:
    rtt = found.find("raw socket", Phase.RTT)
    zrtt = found.find("zeromq", Phase.RTT)
    floors = ", ".join(
        f"{name} {row.seconds * 1e6:.0f} us"
        for name, row in (("raw socket", rtt), ("zeromq", zrtt))
        if row
    )
    w(f"\nlookups (us per call by keys per call; small round trip: {floors or 'not measured'})\n")
    counts = sorted({16, 64, 1024, count})
    w(f"{'system':<14}" + "".join(f"{n:>9}" for n in counts))
    w(f"{'1024/16':>9}{'ctl CPU':>9}  path\n")
    lookup_systems = [*found.systems(_PEERS), *found.systems((*_KVFABRIC, "kvfabric rpc"))]
    for system in lookup_systems:
        by_keys = {n: found.find(system, Phase.CONTAINS, count=n) for n in counts}
        if not any(by_keys.values()):
            continue
        cells = "".join(
            f"{row.seconds * 1e6:>9.1f}" if row else f"{'-':>9}" for row in by_keys.values()
        )
        low, high = by_keys[16], by_keys[1024]
        ratio = f"{high.seconds / low.seconds:>9.2f}" if low and high else f"{'-':>9}"
        cpu = found.find(system, Phase.CONTROLLER_CPU)
        cpu_cell = f"{cpu.seconds * 1e6:>9.1f}" if cpu else f"{'-':>9}"
        path = next((row.note for row in by_keys.values() if row and row.note), "")
        if cpu and cpu.note:
            path = cpu.note
        w(f"{system:<14}{cells}{ratio}{cpu_cell}  {path}\n")
    w(f"  (ctl CPU: the controller's CPU us per lookup of {count} keys, its idle CPU taken off)\n")


def _busy_table(found: _Rows, w: Write) -> None:
    systems = [s for s in (*_PEERS, *_KVFABRIC) if found.find(s, Phase.READS_BUSY)]
    if not systems:
        return
    w("\nreads (contains + get) in a loop, alone and beside a busy pure-Python thread\n")
    w(
        f"{'system':<14}{'alone GB/s':>11}{'beside':>9}{'ratio':>8}{'busy kept':>10}"
        f"{'proc GB/s':>10}{'ratio':>8}{'thread/proc':>12}{'cores':>7}{'room':>6}\n"
    )
    for system in systems:
        alone, busy = found.find(system, Phase.READS_ALONE), found.find(system, Phase.READS_BUSY)
        if alone is None or busy is None:
            continue
        kept = f"{busy.kept:>10.2f}" if busy.kept is not None else f"{'-':>10}"
        process = found.find(system, Phase.READS_BUSY_PROCESS)
        if process is None:
            beside_process = f"{'-':>10}{'-':>8}{'-':>12}"
        else:
            beside_process = (
                f"{process.gbps:>10.2f}{alone.seconds / process.seconds:>8.2f}"
                f"{process.seconds / busy.seconds:>12.2f}"
            )
        cores = f"{alone.cores:>7.2f}" if alone.cores is not None else f"{'-':>7}"
        room = f"{alone.room:>6.2f}" if alone.room is not None else f"{'-':>6}"
        w(
            f"{system:<14}{alone.gbps:>11.2f}{busy.gbps:>9.2f}"
            f"{alone.seconds / busy.seconds:>8.2f}{kept}{beside_process}{cores}{room}\n"
        )
    cpus = next((r.cpus for r in found.rows if r.phase == Phase.READS_ALONE and r.cpus), None)
    w(
        "  (proc: beside the same loop in a process of its own, which takes a core but not the\n"
        "   GIL; thread/proc is the GIL's own share. cores: the CPU the reads kept busy alone,\n"
        "   client and servers together; room: what a host of "
        f"{cpus or '?'} CPUs can leave them beside a loop\n"
        "   that takes one, min(1, (CPUs - 1) / cores). Where room is below a ratio, the host\n"
        "   sets the ratio, not the GIL.)\n"
    )


def targets(rows: Sequence[BenchRow], sizes: Sequence[int], count: int) -> list[Target]:
    """The targets kvfabric is held to: each measured ratio (or time) beside its goal."""
    found = _Rows(rows)
    big, small = max(sizes), min(sizes)
    inf = "infinistore"

    def speed(a: BenchRow | None, b: BenchRow | None) -> float | None:
        """How many times faster ``a`` is than ``b`` (throughput ratio)."""
        return None if a is None or b is None else b.seconds / a.seconds

    def time_ratio(a: BenchRow | None, b: BenchRow | None) -> float | None:
        return None if a is None or b is None else a.seconds / b.seconds

    batch = f"{count}x{size_name(big)}"
    # Target(label, measured, goal, at least (else at most), unit[, note])
    checks: list[Target] = [
        Target(
            f"put {batch} fresh, tcp / InfiniStore",
            speed(
                found.find("kvfabric tcp", Phase.PUT_FRESH, big),
                found.find(inf, Phase.PUT_FRESH, big),
            ),
            1.0,
            True,
            "x",
        ),
        Target(
            f"put {batch} fresh, shm / memcpy",
            speed(
                found.find("kvfabric shm", Phase.PUT_FRESH, big),
                found.find("memcpy", Phase.COPY, big),
            ),
            0.6,
            True,
            "x",
        ),
    ]
    if small != big:
        checks.append(
            Target(
                f"put {count}x{size_name(small)} fresh, tcp / InfiniStore",
                speed(
                    found.find("kvfabric tcp", Phase.PUT_FRESH, small),
                    found.find(inf, Phase.PUT_FRESH, small),
                ),
                1.0,
                True,
                "x",
            )
        )
    checks.append(
        Target(
            f"contains {count}, tcp / InfiniStore (time)",
            time_ratio(
                found.find("kvfabric tcp", Phase.CONTAINS, count=count),
                found.find(inf, Phase.CONTAINS, count=count),
            ),
            1.0,
            False,
            "x",
        )
    )
    shm_contains = found.find("kvfabric shm", Phase.CONTAINS, count=count)
    checks.append(
        Target(
            f"contains {count} over shm",
            None if shm_contains is None else shm_contains.seconds * 1e6,
            20.0,
            False,
            "us",
        )
    )
    for system in found.systems(_KVFABRIC):
        cpu = found.find(system, Phase.CONTROLLER_CPU)
        if cpu is not None and cpu.note.startswith("one-sided"):
            checks.append(
                Target(
                    f"{system[9:]} controller CPU per one-sided lookup",
                    cpu.seconds * 1e6,
                    0.0,
                    False,
                    "us",
                )
            )
    peers_get = [
        r for r in (found.find(p, Phase.GET, big) for p in ("mooncake", inf, "redis")) if r
    ]
    best_peer = min(peers_get, key=lambda r: r.seconds) if peers_get else None
    for system in found.systems(_KVFABRIC):
        checks.append(
            Target(
                f"get {batch}, {system[9:]} / best peer",
                speed(found.find(system, Phase.GET, big), best_peer),
                1.0,
                True,
                "x",
                best_peer.system if best_peer else "",
            )
        )
    checks.append(
        Target(
            f"get {batch}, shm / memcpy",
            speed(
                found.find("kvfabric shm", Phase.GET, big), found.find("memcpy", Phase.COPY, big)
            ),
            0.8,
            True,
            "x",
        )
    )
    for system in found.systems(_KVFABRIC):
        alone = found.find(system, Phase.READS_ALONE)
        room = None if alone is None else alone.room
        checks.append(
            Target(
                f"reads beside busy / alone, {system[9:]}",
                speed(found.find(system, Phase.READS_BUSY), alone),
                0.8,
                True,
                "x",
                # Where the host cannot leave the reads their goal, say so beside the value.
                f"room {room:.2f}" if room is not None and room < 0.8 else "",
            )
        )
    for system in found.systems((*_KVFABRIC, "kvfabric rpc")):
        checks.append(
            Target(
                f"contains 1024 / 16, {system[9:]}",
                time_ratio(
                    found.find(system, Phase.CONTAINS, count=1024),
                    found.find(system, Phase.CONTAINS, count=16),
                ),
                3.0,
                False,
                "x",
            )
        )
    return checks


def _targets(found: _Rows, sizes: Sequence[int], count: int, w: Write) -> None:
    w("\ntargets:\n")
    for target in targets(found.rows, sizes, count):
        label = f"{target.label} ({target.note})" if target.note else target.label
        goal = f"(goal {target.sign} {target.goal:g}{target.unit})"
        if target.value is None:
            w(f"  {label:<48} {'n/a':>8}   {goal}\n")
            continue
        verdict = "met" if target.met else "NOT MET"
        w(f"  {label:<48} {target.value:>8.2f}{target.unit:<2} {goal}  {verdict}\n")


def print_rounds_summary(rounds: Sequence[Sequence[Target]], out: IO[str]) -> None:
    """Each target over the rounds of one run: its value in each, their median, and in how
    many rounds it was met. On a shared host one round can land in a slow spell that
    another misses; the median and the count say what holds across them."""
    w = out.write
    w(f"\ntargets over {len(rounds)} rounds: each round, median, rounds met\n")
    labels: dict[str, Target] = {}
    for round_targets in rounds:
        for target in round_targets:
            labels.setdefault(target.label, target)
    for label, first in labels.items():
        values = [
            next((t.value for t in round_targets if t.label == label), None)
            for round_targets in rounds
        ]
        cells = " ".join(f"{v:>7.2f}" if v is not None else f"{'n/a':>7}" for v in values)
        measured = [v for v in values if v is not None]
        goal = f"(goal {first.sign} {first.goal:g}{first.unit})"
        if not measured:
            w(f"  {label:<44} {cells}  {'n/a':>7}    {goal}\n")
            continue
        median = statistics.median(measured)
        met = sum(first.meets(v) for v in measured)
        w(f"  {label:<44} {cells}  {median:>7.2f}{first.unit:<2} {goal}  met {met}/{len(values)}\n")
