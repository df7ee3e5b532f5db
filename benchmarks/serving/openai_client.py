"""Requests to a ``vllm serve`` process through the OpenAI completions API, streamed and timed.

A prompt is sent as token ids (the completions endpoint takes them; no tokenizer is
involved), greedy, ``ignore_eos`` so every request generates exactly ``max_tokens``. The
response is streamed: the time to the first chunk that carries a token is the TTFT, the time
to the end of the stream the end-to-end latency; the final chunk's usage says how many prompt
tokens vLLM found cached (its own prefix cache and a connector's, together). vLLM's
Prometheus counters split those by source (:func:`prompt_token_sources`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from workloads import Request, Workload

__all__ = ["SERVED_NAME", "Sample", "prompt_token_sources", "run_workload"]

SERVED_NAME = "bench"
"""``--served-model-name`` of every engine the bench starts."""

_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\}\s+(\S+)')
_COUNTER = re.compile(r"^(vllm:[a-z_]+_total)(?:\{[^}]*\})?\s+(\S+)")


@dataclass
class Sample:
    """One request as the client saw it. Times are seconds; ``start`` counts from the pass's
    start."""

    config: str
    run: str
    workload: str
    index: int
    group: int
    step: int
    prompt_tokens: int
    start: float
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def _complete(
    session: aiohttp.ClientSession, base: str, request: Request, sample: Sample
) -> None:
    payload = {
        "model": SERVED_NAME,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    started = time.perf_counter()
    try:
        async with session.post(f"{base}/v1/completions", json=payload) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    sample.error = str(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices", ()):
                    tokens = len(choice.get("token_ids") or ()) or int(bool(choice.get("text")))
                    if tokens and sample.ttft is None:
                        sample.ttft = time.perf_counter() - started
                    sample.output_tokens += tokens
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    sample.cached_tokens = int(details.get("cached_tokens") or 0)
            sample.e2e = time.perf_counter() - started
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:300]


async def run_workload(
    base: str,
    workload: Workload,
    *,
    config: str,
    run: str,
    concurrency: int,
    t0: float,
    timeout: float,
    on_start: Callable[[], Awaitable[None]] | None = None,
) -> list[Sample]:
    """Send ``workload`` to the engine at ``base`` (``http://HOST:PORT``), at most
    ``concurrency`` requests at a time; ``t0`` (``time.perf_counter()``) is the pass's start."""
    samples: list[Sample] = []
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:

        async def sequence(requests: list[Request]) -> None:
            for request in requests:
                async with slots:
                    sample = Sample(
                        config=config,
                        run=run,
                        workload=workload.name,
                        index=request.index,
                        group=request.group,
                        step=request.step,
                        prompt_tokens=len(request.prompt),
                        start=time.perf_counter() - t0,
                    )
                    samples.append(sample)
                    await _complete(session, base, request, sample)

        if on_start is not None:
            await on_start()
        await asyncio.gather(*(sequence(s) for s in workload.sequences))
    return sorted(samples, key=lambda s: s.index)


async def fetch_metrics(base: str) -> str:
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{base}/metrics") as response,
    ):
        return await response.text()


def prompt_token_sources(metrics: str) -> dict[str, float]:
    """Prompt tokens by where they came from, summed over the engine's counters:
    ``local_compute``, ``local_cache_hit`` and ``external_kv_transfer`` (vLLM 0.32's
    ``vllm:prompt_tokens_by_source_total``); older vLLMs only have
    ``vllm:prefix_cache_hits_total`` and ``vllm:external_prefix_cache_hits_total``, which
    give the two kinds of hits."""
    sources: dict[str, float] = {}
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        if match := _SOURCE.match(line):
            sources[match[1]] = sources.get(match[1], 0.0) + float(match[2])
        elif match := _COUNTER.match(line):
            counters[match[1]] = counters.get(match[1], 0.0) + float(match[2])
    if not sources:
        sources = {
            "local_cache_hit": counters.get("vllm:prefix_cache_hits_total", 0.0),
            "external_kv_transfer": counters.get("vllm:external_prefix_cache_hits_total", 0.0),
        }
    return sources
