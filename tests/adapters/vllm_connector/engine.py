"""One vLLM engine with the kvfabric connector, driven over stdin/stdout (a test helper).

    python engine.py --make-model DIR        write a tiny random-weight Llama to DIR
    python engine.py CONFIG_JSON             start an engine, then serve requests

CONFIG_JSON: ``{"url": kvfabric URL, "model": DIR, "multiprocessing": false, "extra": {more
kv_connector_extra_config}, "module": the connector's module (default kvfabric.adapters.vllm)}``.

Each request is one JSON line on stdin; each reply is one line on stdout starting with
``REPLY `` (vLLM logs to stderr, and anything else on stdout is ignored by the test).
Requests: ``generate`` (token ids in, greedy tokens, logprobs, cached tokens, seconds and
what both connector instances counted out), ``race`` (two prompts in one batch, the second
added once the first is waiting for its load: which finished first), ``batch`` (requests
added at given steps, each one's time to first token, finish and longest gap between
tokens; for benchmarks), ``keys`` (the kvfabric
keys of a prompt's full blocks, computed the way the connector computes them),
``block_hashes`` (the prompt's full blocks as vLLM's KV events name them), ``flush``
(wait for background saves), ``stats`` (what vLLM's stat loggers got from the connector
since the last ``stats``: its "KV Transfer metrics" log lines and its Prometheus metrics),
``counters`` (both connectors' counters now), ``set_load_timeout`` and ``quit``. One engine
per process: vLLM keeps the worker-side connector in a process global, and the test reuses
each engine for several prompts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

BLOCK_SIZE = 32
KV_TRANSFER_METRICS = "KV Transfer metrics: "


class _Captured(logging.Handler):
    """Keeps vLLM's "KV Transfer metrics: k=v, ..." log lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(KV_TRANSFER_METRICS):
            self.lines.append(message[len(KV_TRANSFER_METRICS) :])


def make_model(model_dir: str) -> None:
    """A seeded random-weight Llama, saved as safetensors; nothing is downloaded.

    Random weights with initializer_range 0.05 make the output depend on the KV: with
    near-zero ("dummy") weights any KV would give the same tokens and hide a bad transfer.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,  # head_dim 64: one the CPU attention backend supports
        num_key_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    partial = f"{model_dir}.partial"
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(partial, safe_serialization=True)
    os.rename(partial, model_dir)  # whole or absent: a model kept for reuse is never half written


class Engine:
    def __init__(self, config: dict[str, Any]) -> None:
        # By default one process for the engine core and the worker, so that both connector
        # instances are reachable from here for their counters and keys.
        self.multiprocessing = bool(config.get("multiprocessing"))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.multiprocessing else "0"
        # vLLM's stat loggers run, but log only when asked (``stats``).
        os.environ["VLLM_LOG_STATS_INTERVAL"] = "1000000"
        from vllm import LLM

        kv_transfer_config = {
            "kv_connector": "KVFabricConnector",
            "kv_connector_module_path": config.get("module", "kvfabric.adapters.vllm"),
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": config["url"], **config.get("extra", {})},
        }
        started = time.perf_counter()
        # sha256_cbor: block hashes that every instance (any Python) computes alike.
        self.llm = LLM(
            model=config["model"],
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            prefix_caching_hash_algo="sha256_cbor",
            block_size=BLOCK_SIZE,
            dtype="float32",
            max_model_len=4096,
            max_num_seqs=4,
            max_num_batched_tokens=4096,
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=True,
            seed=0,
            kv_transfer_config=kv_transfer_config,
            disable_log_stats=False,
        )
        self.start_seconds = time.perf_counter() - started
        self.captured = _Captured()
        logging.getLogger("vllm").addHandler(self.captured)
        # An idle engine logs its stats at DEBUG: keep them too.
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.DEBUG)
        self.races = 0

    @property
    def scheduler_connector(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    @property
    def worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def counters(self) -> dict[str, dict[str, int]]:
        if self.multiprocessing:
            return {}  # the connectors live in the engine-core and worker processes
        return {
            "scheduler": self.scheduler_connector.counters(),
            "worker": self.worker_connector.counters(),
        }

    @staticmethod
    def _prompt_and_params(request: dict[str, Any]) -> tuple[Any, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=request["prompt"])
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_tokens"], logprobs=1, ignore_eos=True
        )
        return prompt, params

    @staticmethod
    def _result(output: Any) -> dict[str, Any]:
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob
            for step, token in zip(completion.logprobs or [], completion.token_ids, strict=True)
        ]
        return {
            "tokens": list(completion.token_ids),
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "num_cached_tokens": output.num_cached_tokens,
        }

    def _counted(self, before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        after = self.counters()
        return {
            side: {k: v - before[side].get(k, 0) for k, v in after[side].items()} for side in after
        }

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("reset_prefix_cache"):
            # Forget this engine's own copy of earlier prompts, so hits can only be external.
            assert self.llm.reset_prefix_cache()
        prompt, params = self._prompt_and_params(request)
        before = self.counters()
        started = time.perf_counter()
        output = self.llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        return {**self._result(output), "seconds": seconds, "counters": self._counted(before)}

    def race(self, request: dict[str, Any]) -> dict[str, Any]:
        """``first`` and ``second`` (each a generate request) in one batch: ``second`` is
        added once ``first`` waits for its load. Steps the engine until both are done and
        replies which finished first, each one's output and what the connectors counted.
        Needs the connectors in this process."""
        assert not self.multiprocessing
        if request.get("reset_prefix_cache"):
            assert self.llm.reset_prefix_cache()
        engine = self.llm.llm_engine
        self.races += 1
        ids = {f"race{self.races}-{name}": name for name in ("first", "second")}
        bound = time.monotonic() + request.get("timeout", 120)
        before = self.counters()
        outputs: dict[str, Any] = {}
        order: list[str] = []
        loads_before = self.worker_connector.worker.loads_in_flight

        def step() -> None:
            assert time.monotonic() < bound, f"race not done: {order}"
            for output in engine.step():
                if output.finished:
                    name = ids[output.request_id]
                    order.append(name)
                    outputs[name] = self._result(output)

        for req_id, name in list(ids.items()):
            added = engine.add_request(req_id, *self._prompt_and_params(request[name]))
            ids[added] = name
            if name == "first":
                while self.worker_connector.worker.loads_in_flight == loads_before and not order:
                    step()
        while len(order) < 2:
            step()
        return {"order": order, **outputs, "counters": self._counted(before)}

    def batch(self, request: dict[str, Any]) -> dict[str, Any]:
        """``requests`` (generate requests, each with ``at_step``: added before that step of
        this batch, 0 first) run together; per request the seconds from the batch's start to
        when it was added, to its first token and to its end, and its longest gap between two
        tokens (how long other work stalled it)."""
        if request.get("reset_prefix_cache"):
            assert self.llm.reset_prefix_cache()
        engine = self.llm.llm_engine
        self.races += 1
        pending = sorted(enumerate(request["requests"]), key=lambda item: item[1]["at_step"])
        names: dict[str, int] = {}
        times: dict[int, list[float]] = {}
        added: dict[int, float] = {}
        finished: dict[int, float] = {}
        results: dict[int, dict[str, Any]] = {}
        before = self.counters()
        started = time.perf_counter()
        steps = 0
        while len(finished) < len(request["requests"]):
            while pending and pending[0][1]["at_step"] <= steps:
                i, spec = pending.pop(0)
                req_id = f"batch{self.races}-{i}"
                # Outputs may carry the id given or the one vLLM made of it.
                names[req_id] = names[
                    engine.add_request(req_id, *self._prompt_and_params(spec))
                ] = i
                added[i] = time.perf_counter() - started
                times[i] = []
            outputs = engine.step()
            steps += 1
            now = time.perf_counter() - started
            for output in outputs:
                i = names[output.request_id]
                produced = len(output.outputs[0].token_ids)
                times[i] += [now] * (produced - len(times[i]))
                if output.finished:
                    finished[i] = now
                    results[i] = self._result(output)
        return {
            "seconds": time.perf_counter() - started,
            "steps": steps,
            "requests": [
                {
                    "added": added[i],
                    "first_token": times[i][0] - added[i],
                    "finished": finished[i] - added[i],
                    "max_gap": max(
                        (b - a for a, b in zip(times[i], times[i][1:], strict=False)), default=0.0
                    ),
                    **results[i],
                }
                for i in range(len(request["requests"]))
            ],
            "counters": self._counted(before),
        }

    def stats(self, request: dict[str, Any]) -> dict[str, Any]:
        """What vLLM's stat loggers got from the connector since the last ``stats``: each
        "KV Transfer metrics" line as a dict, and kvfabric's Prometheus metrics (counters
        and histogram counts, by name and labels)."""
        from vllm.v1.metrics.reader import Counter, Histogram

        self.captured.lines.clear()
        self.llm.llm_engine.do_log_stats()
        lines = [
            {k: float(v) for k, v in (part.split("=") for part in line.split(", "))}
            for line in self.captured.lines
        ]
        metrics: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if not metric.name.startswith("vllm:kvfabric_"):
                continue
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(metric.labels.items()) if k in ("result", "outcome")
            )
            # Named as /metrics shows them: a counter's samples end in _total.
            if isinstance(metric, Counter):
                name = f"{metric.name}_total" + (f"{{{labels}}}" if labels else "")
                metrics[name] = metrics.get(name, 0) + metric.value
            elif isinstance(metric, Histogram):
                name = f"{metric.name}_count"
                metrics[name] = metrics.get(name, 0) + metric.count
        return {"lines": lines, "metrics": metrics}

    def _request(self, request: dict[str, Any]) -> Any:
        """A vLLM request for a prompt, with the block hashes vLLM itself computes."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(
            request_id=f"probe-{time.monotonic_ns()}",
            prompt_token_ids=request["prompt"],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt=request.get("cache_salt"),
            block_hasher=self.llm.llm_engine.engine_core.engine_core.request_block_hasher,
        )

    def keys(self, request: dict[str, Any]) -> dict[str, Any]:
        """The kvfabric keys of the prompt's full blocks, as the connector computes them."""
        probe = self._request(request)
        keys = self.scheduler_connector.keys_for(probe.block_hashes, probe.cache_salt)
        assert keys == self.worker_connector.keys_for(probe.block_hashes, probe.cache_salt)
        return {"keys": [k.hex() for k in keys]}

    def block_hashes(self, request: dict[str, Any]) -> dict[str, Any]:
        """The prompt's full blocks as vLLM's own KV events name them (hex of the bytes, or
        the integer under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = [maybe_convert_block_hash(h) for h in self._request(request).block_hashes]
        return {"hashes": [h.hex() if isinstance(h, bytes) else h for h in hashes]}

    def lookup(self, request: dict[str, Any]) -> dict[str, Any]:
        """Ask the scheduler-side connector about a prompt ``repeat`` times, as vLLM may."""
        probe = self._request(request)
        connector = self.scheduler_connector
        before = connector.counters()
        answers = [
            connector.get_num_new_matched_tokens(probe, request["num_computed_tokens"])
            for _ in range(request["repeat"])
        ]
        after = connector.counters()
        connector.request_finished(probe, [])
        return {
            "answers": answers,
            "counters": {k: v - before.get(k, 0) for k, v in after.items()},
        }

    def flush(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"flushed": self.worker_connector.flush(timeout=30.0)}

    def counters_now(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.counters()

    def set_load_timeout(self, request: dict[str, Any]) -> dict[str, Any]:
        """Loads started from now on may take ``seconds`` (the worker's load deadline)."""
        assert not self.multiprocessing
        self.worker_connector.worker.load_timeout = request["seconds"]
        return {}


def main() -> None:
    if sys.argv[1] == "--make-model":
        make_model(sys.argv[2])
        return
    engine = Engine(json.loads(sys.argv[1]))
    kv_transfer_config = engine.llm.llm_engine.vllm_config.kv_transfer_config
    reply(
        {
            "start_seconds": engine.start_seconds,
            # The connector sets it in the engine core's copy of the config, which is this
            # process's only without multiprocessing.
            "kv_load_failure_policy": None
            if engine.multiprocessing
            else kv_transfer_config.kv_load_failure_policy,
            "layouts": {}
            if engine.multiprocessing
            else {str(k): v for k, v in engine.scheduler_connector.layouts.items()},
        }
    )
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        op = "counters_now" if request["op"] == "counters" else request["op"]
        try:
            reply(getattr(engine, op)(request))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    del engine


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write("REPLY " + json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
