"""The vLLM connector's statistics in vLLM's format, without an engine.

The stats objects are driven the way vLLM drives them: each role's ``take_stats`` per step,
``to_dict`` across processes and ``build_kv_connector_stats`` back, ``aggregate`` over roles
and steps, ``reduce`` for the log line, and ``KVFabricPromMetrics.observe`` into a
Prometheus registry of the test's own.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    # vllm.v1: a plain "vllm" would import this directory's vllm/ (the engine helper) as a
    # namespace package where vLLM is not installed.
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric.adapters.vllm import KVFabricConnector
from kvfabric.adapters.vllm_stats import COUNTED, IntervalStats, KVFabricPromMetrics
from kvfabric.spi import Counters


def test_interval_stats_are_the_counters_difference_since_the_last_take() -> None:
    counters = Counters(["hit_blocks", "miss_blocks", "loaded_bytes", "lookups"])
    counters.update(hit_blocks=5, lookups=9)  # before vLLM's first ask: not in the interval
    stats = IntervalStats(counters)
    assert stats.take() is None
    counters.update(hit_blocks=3, miss_blocks=1, lookups=2)
    stats.load_took(0.25)
    taken = stats.take()
    assert taken is not None
    assert taken.data == {"hit_blocks": 3, "miss_blocks": 1, "load_seconds": [0.25]}
    assert stats.take() is None  # nothing new


def test_stats_survive_vllms_round_trip_and_aggregate_over_roles_and_steps() -> None:
    scheduler = {"hit_blocks": 6, "miss_blocks": 2}
    worker_step_1 = {"loaded_blocks": 6, "loaded_bytes": 6 * 1024, "load_seconds": [0.5]}
    worker_step_2 = {
        "saved_blocks": 2,
        "saved_bytes": 2048,
        "save_dropped_blocks": 3,
        "load_error_blocks": 1,
        "load_timeouts": 1,
        "load_seconds": [0.1, 0.2],
    }
    build = KVFabricConnector.build_kv_connector_stats
    merged = build(dict(worker_step_1)).aggregate(build(scheduler))
    merged = build(merged.to_dict()).aggregate(build(worker_step_2))  # as the logger does
    reduced = merged.reduce()
    assert set(reduced) == {*COUNTED, "hit_rate", "loads", "load_avg_ms", "load_p90_ms"} | {
        "load_max_ms"
    }
    assert {k: reduced[k] for k in COUNTED} == {
        "hit_blocks": 6,
        "miss_blocks": 2,
        "loaded_blocks": 6,
        "loaded_bytes": 6 * 1024,
        "load_error_blocks": 1,
        "load_timeouts": 1,
        "saved_blocks": 2,
        "saved_bytes": 2048,
        "save_deduplicated_blocks": 0,
        "save_failed_blocks": 0,
        "save_dropped_blocks": 3,
    }
    assert reduced["hit_rate"] == 0.75
    assert reduced["loads"] == 3
    assert reduced["load_avg_ms"] == pytest.approx(266.667, abs=1e-3)
    assert (reduced["load_p90_ms"], reduced["load_max_ms"]) == (200.0, 500.0)
    assert build().is_empty()
    assert not merged.is_empty()


def test_prometheus_metrics_follow_the_naming_conventions_and_count_exactly() -> None:
    registry = CollectorRegistry()
    kinds = (Counter, Gauge, Histogram)
    types = {kind: functools.partial(kind, registry=registry) for kind in kinds}
    metrics = KVFabricPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,  # type: ignore[arg-type]
        labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["m", "0"]},
    )
    for _ in range(2):
        metrics.observe(
            {
                "hit_blocks": 6,
                "miss_blocks": 2,
                "loaded_blocks": 5,
                "load_error_blocks": 1,
                "loaded_bytes": 5 * 1024,
                "saved_blocks": 2,
                "save_dropped_blocks": 3,
                "saved_bytes": 2048,
                "load_timeouts": 1,
                "load_seconds": [0.003, 0.2],
            }
        )
    engine = {"model_name": "m", "engine": "0"}

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**engine, **labels})

    assert value("vllm:kvfabric_lookup_blocks_total", result="hit") == 12
    assert value("vllm:kvfabric_lookup_blocks_total", result="miss") == 4
    assert value("vllm:kvfabric_load_blocks_total", outcome="loaded") == 10
    assert value("vllm:kvfabric_load_blocks_total", outcome="error") == 2
    assert value("vllm:kvfabric_save_blocks_total", outcome="stored") == 4
    assert value("vllm:kvfabric_save_blocks_total", outcome="dropped") == 6
    assert value("vllm:kvfabric_load_bytes_total") == 10 * 1024
    assert value("vllm:kvfabric_save_bytes_total") == 4096
    assert value("vllm:kvfabric_load_timeouts_total") == 2
    assert value("vllm:kvfabric_load_time_seconds_count") == 4
    assert value("vllm:kvfabric_load_time_seconds_bucket", le="0.005") == 2
    assert value("vllm:kvfabric_load_time_seconds_sum") == pytest.approx(0.406)
