"""`kvfabric bench` runs end to end and measures every row it promises (no timing asserts)."""

from __future__ import annotations

import io

from kvfabric._tools.bench import run_bench


def test_bench_measures_floors_kvfabric_over_both_transports_and_redis() -> None:
    out = io.StringIO()
    rows = run_bench(sizes=(64 * 1024,), count=8, repeat=1, out=out)
    measured = {(r.system, r.phase) for r in rows}
    phases = {"put", "contains", "get", "naive exists+get", "re-put"}
    for system in ("kvfabric tcp", "kvfabric shm", "redis"):
        assert {(system, phase) for phase in phases} <= measured
    assert {("memcpy", "copy"), ("raw socket", "stream"), ("raw socket", "small RTT")} <= measured
    assert all(r.seconds > 0 for r in rows)
    text = out.getvalue()
    assert "targets:" in text
    assert "tcp get / redis get" in text
