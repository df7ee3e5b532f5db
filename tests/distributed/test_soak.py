"""A bounded soak with real processes: churn, kill -9 faults and fuzzers (the long run is
``python benchmarks/soak.py --minutes 20 --fuzz 100000``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

# The harness is the soak benchmark itself; its client processes (spawned) import it by name
# too, so its folder goes on sys.path, which they inherit.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak import SoakConfig, print_report, run_soak


def test_churn_faults_and_fuzzers_never_produce_a_wrong_value_or_a_hang() -> None:
    report = run_soak(SoakConfig(seconds=45, fault_rounds=6, fuzz_frames=3000), log=print)
    print_report(report)
    assert report.ops > 0
    assert report.wrong_values == 0
    assert report.outlived == 0
    assert len(report.recoveries) == 6
    assert all(math.isfinite(seconds) for _, seconds in report.recoveries)
    assert report.fuzzed_control > 0
    assert report.fuzzed_data > 0
    for name, before in report.rss_before.items():
        if name in report.rss_after:
            assert report.rss_after[name] < before + (256 << 20), name


def test_a_full_store_under_churn_refuses_under_one_percent_of_puts() -> None:
    report = run_soak(SoakConfig(seconds=20, faults=False, fuzz_frames=0))
    print_report(report)
    assert report.puts_after_full > 1000  # the store did fill and evict
    assert report.no_space_share < 0.01
    assert report.wrong_values == 0
