"""One vLLM engine with the kvfabric connector, driven over stdin/stdout (a test helper).

    python engine.py --make-model DIR        write a tiny random-weight Llama to DIR
    python engine.py CONFIG_JSON             start an engine, then serve requests

CONFIG_JSON: ``{"url": kvfabric URL, "model": DIR, "multiprocessing": false}``.

Each request is one JSON line on stdin; each reply is one line on stdout starting with
``REPLY `` (vLLM logs to stderr, and anything else on stdout is ignored by the test).
Requests: ``generate`` (token ids in, greedy tokens, logprobs, cached tokens, seconds and
what both connector instances counted out), ``keys`` (the kvfabric keys of a prompt's full
blocks, computed the way the connector computes them), ``flush`` (wait for background
saves) and ``quit``. One engine per process: vLLM keeps the worker-side connector in a
process global, and the test reuses each engine for several prompts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

BLOCK_SIZE = 32


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
        from vllm import LLM

        kv_transfer_config = {
            "kv_connector": "KVFabricConnector",
            "kv_connector_module_path": "kvfabric.adapters.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"url": config["url"]},
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
        )
        self.start_seconds = time.perf_counter() - started

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

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if request.get("reset_prefix_cache"):
            # Forget this engine's own copy of earlier prompts, so hits can only be external.
            assert self.llm.reset_prefix_cache()
        prompt = TokensPrompt(prompt_token_ids=request["prompt"])
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_tokens"], logprobs=1, ignore_eos=True
        )
        before = self.counters()
        started = time.perf_counter()
        output = self.llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        after = self.counters()
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
            "seconds": seconds,
            "counters": {
                side: {k: v - before[side].get(k, 0) for k, v in after[side].items()}
                for side in after
            },
        }

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
        try:
            reply(getattr(engine, request["op"])(request))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
    del engine


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write("REPLY " + json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
