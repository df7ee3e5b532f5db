"""`kvfabric bench` runs end to end and measures every row it promises (no timing asserts).

The peers (Mooncake Store, InfiniStore) run only where their venv is named by
``KVFABRIC_PEERS_PYTHON``; elsewhere their rows must say how to install them.
"""

from __future__ import annotations

import io
import os

from kvfabric._runtime.cpus import usable_cpus
from kvfabric._tools.bench import run_bench
from kvfabric._tools.bench_timing import Phase

_PEERS = ("mooncake", "infinistore")


def test_bench_measures_floors_kvfabric_redis_and_says_where_the_peers_stand() -> None:
    out = io.StringIO()
    rows = run_bench(
        sizes=(64 * 1024,),
        count=8,
        repeat=1,
        out=out,
        transports=("tcp", "shm"),
        busy_seconds=0.2,
        cpu_lookups=20,
        rounds=2,
    )
    text = out.getvalue()
    print(text)
    # Two rounds, each its own report, then every target over both.
    assert "kvfabric bench round 1 of 2:" in text
    assert "kvfabric bench round 2 of 2:" in text
    summary = text.split("targets over 2 rounds: each round, median, rounds met\n")[1]
    assert "contains 8 over shm" in summary
    assert "reads beside busy / alone, tcp" in summary
    assert all(line.rstrip().endswith(("/2", ")")) for line in summary.splitlines() if line)
    kvfabric_puts = [r for r in rows if r.phase == Phase.PUT_FRESH and r.system == "kvfabric tcp"]
    assert len(kvfabric_puts) == 2
    measured = {(r.system, r.phase) for r in rows}
    data = {
        Phase.PUT_FRESH,
        Phase.PUT_WARM,
        Phase.GET,
        Phase.RE_PUT,
        Phase.READS_ALONE,
        Phase.READS_BUSY,
        Phase.READS_BUSY_PROCESS,
        Phase.CONTROLLER_CPU,
    }
    for system in ("kvfabric tcp", "kvfabric shm"):
        assert {(system, phase) for phase in data} <= measured
        assert {r.count for r in rows if (r.system, r.phase) == (system, Phase.CONTAINS)} == {
            8,
            16,
            64,
            1024,
        }
    assert {
        ("redis", p) for p in (Phase.PUT_FRESH, Phase.CONTAINS, Phase.GET, Phase.RE_PUT)
    } <= measured
    assert {
        ("memcpy", Phase.COPY),
        ("raw socket", Phase.STREAM),
        ("raw socket", Phase.RTT),
    } <= measured
    assert all(r.seconds > 0 for r in rows if r.phase != Phase.CONTROLLER_CPU)
    assert all(r.kept is not None and r.kept > 0 for r in rows if r.phase == Phase.READS_BUSY)
    # The CPU reads kept busy alone (client and servers), and the CPUs the room is of.
    for row in rows:
        if row.phase == Phase.READS_ALONE and row.system.startswith("kvfabric"):
            assert row.cores is not None
            assert row.cores > 0, row
            assert row.cpus == usable_cpus(), row
    # Every lookup went one way, as the client's counters say, and its RPCs match it.
    for row in rows:
        if row.phase == Phase.CONTAINS and row.system.startswith("kvfabric"):
            assert row.note in ("one-sided", "control RPC"), row
        if row.phase == Phase.CONTROLLER_CPU:
            # Where the controller serves its image over tcp, a child process of its own
            # does: that process's CPU is shown apart.
            path, served, served_cpu = row.note.partition("; image server process ")
            assert path in (
                "one-sided; 0 control RPCs per lookup",
                "control RPC; 1 control RPCs per lookup",
            ), row
            assert served_cpu.endswith(" us") or not served, row
            if row.system == "kvfabric tcp":
                assert served, row
    assert "\ntargets:\n" in text
    assert "reads beside busy / alone, tcp" in text
    assert "thread/proc" in text
    assert "room: what a host of" in text
    if os.environ.get("KVFABRIC_PEERS_PYTHON"):
        for peer in _PEERS:
            assert {
                (peer, p) for p in (Phase.PUT_FRESH, Phase.CONTAINS, Phase.GET, Phase.READS_BUSY)
            } <= measured
    else:
        for peer in _PEERS:
            assert f"{peer}: not installed: pip install" in text
            assert not any(r.system == peer for r in rows)
