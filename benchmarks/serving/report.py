"""What the serving bench prints and writes: the table, the frozen-node timeline, the projection,
the plot and the raw samples.

Ratios are against the recompute row of the same workload (``x faster``: recompute's TTFT over
this row's). Hit rates are vLLM's own counters of the measured pass: prompt tokens found in
the engine's prefix cache (``local``) and loaded through its KV connector (``ext``), over all
prompt tokens.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from model_shape import Gpu, ModelShape
from openai_client import Sample
from tier import LoadBandwidth

__all__ = ["Measured", "Projection", "format_table", "freeze_report", "plot", "projection"]


@dataclass
class Measured:
    """One configuration's measured pass over one workload."""

    config: str
    label: str
    workload: str
    samples: list[Sample]
    wall_seconds: float
    sources: dict[str, float] = field(default_factory=dict)
    """Prompt tokens by source in this pass (a delta of vLLM's counters)."""

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None and s.ttft is not None]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    def _share(self, *names: str) -> float | None:
        total = sum(self.sources.values())
        if not total:
            return None
        return sum(self.sources.get(n, 0.0) for n in names) / total

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens not computed (either cache), over all prompt tokens."""
        share = self._share("local_cache_hit", "external_kv_transfer")
        if share is not None:
            return share
        ok = self.ok
        prompt = sum(s.prompt_tokens for s in ok)
        return sum(s.cached_tokens or 0 for s in ok) / prompt if prompt else None

    @property
    def external_rate(self) -> float | None:
        return self._share("external_kv_transfer")

    def ttft(self, q: float) -> float | None:
        return _percentile([s.ttft for s in self.ok if s.ttft is not None], q)

    def e2e(self, q: float) -> float | None:
        return _percentile([s.e2e for s in self.ok if s.e2e is not None], q)

    @property
    def output_tokens_per_second(self) -> float | None:
        if self.wall_seconds <= 0:
            return None
        return sum(s.output_tokens for s in self.ok) / self.wall_seconds


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(base: float | None, value: float | None) -> str:
    if base is None or value is None or value <= 0:
        return "-"
    return f"{base / value:.1f}x"


_HEADER = (
    "workload",
    "configuration",
    "reqs",
    "hit",
    "ext",
    "TTFT p50",
    "TTFT p99",
    "p50 vs (a)",
    "p99 vs (a)",
    "e2e p50",
    "e2e p99",
    "out tok/s",
)


def format_table(
    rows: Sequence[Measured],
    failed: dict[str, str],
    labels: dict[str, str],
    workloads: Sequence[str],
) -> str:
    """One table: per workload, one row per configuration; configurations that did not run
    get a row that says why."""
    table: list[tuple[str, ...]] = [_HEADER]
    for workload in workloads:
        mine = [r for r in rows if r.workload == workload]
        base = next((r for r in mine if r.config == "recompute"), None)
        for row in mine:
            errors = f" ({row.errors} failed)" if row.errors else ""
            p50, p99 = row.ttft(50), row.ttft(99)
            tokens = row.output_tokens_per_second
            table.append(
                (
                    workload,
                    row.label,
                    f"{len(row.samples)}{errors}",
                    _percent(row.hit_rate),
                    _percent(row.external_rate),
                    _seconds(p50),
                    _seconds(p99),
                    _ratio(base.ttft(50) if base else None, p50),
                    _ratio(base.ttft(99) if base else None, p99),
                    _seconds(row.e2e(50)),
                    _seconds(row.e2e(99)),
                    "-" if tokens is None else f"{tokens:.1f}",
                )
            )
        for config, reason in failed.items():
            table.append((workload, labels[config], "did not run: " + reason))
    widths = [max(len(r[i]) for r in table if len(r) == len(_HEADER)) for i in range(len(_HEADER))]
    lines = []
    for i, cells_in in enumerate(table):
        if len(cells_in) < len(_HEADER):
            name, label, why = cells_in
            lines.append(f"{name:<{widths[0]}}  {label:<{widths[1]}}  {why}")
        else:
            cells = [
                f"{c:<{w}}" if j < 2 else f"{c:>{w}}"
                for j, (c, w) in enumerate(zip(cells_in, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def freeze_report(samples: Sequence[Sample], freeze: dict[str, Any], deadline: float) -> str:
    """Per-request TTFT around the frozen node: which requests it cost, and how much."""
    stopped, continued = freeze.get("stopped_at"), freeze.get("continued_at")
    if stopped is None:
        return (
            "frozen node: the pass ended before the freeze began (use a smaller --freeze-node-at)"
        )
    end = continued if continued is not None else math.inf
    lines = [
        f"frozen node: SIGSTOP at {stopped:.1f}s, SIGCONT at "
        + (f"{continued:.1f}s" if continued is not None else "the end of the pass")
        + f" (deadline: the client timeout, {deadline:g}s)",
        "  requests by when they started: p50 / max TTFT",
    ]
    phases = {
        "before": [s for s in samples if s.start + (s.e2e or 0) < stopped],
        "overlapping": [
            s for s in samples if s.start < end and s.start + (s.e2e or math.inf) >= stopped
        ],
        "after": [s for s in samples if s.start >= end],
    }
    for name, chosen in phases.items():
        ttfts = [s.ttft for s in chosen if s.ttft is not None]
        failed = sum(1 for s in chosen if s.error)
        lines.append(
            f"    {name:<12} {len(chosen):>4} requests  "
            f"{_seconds(_percentile(ttfts, 50))} / {_seconds(max(ttfts) if ttfts else None)}"
            + (f"  ({failed} failed)" if failed else "")
        )
    lines.append("  each request near the freeze (start, TTFT, prompt tokens, cached):")
    window = (stopped - 5.0, end + deadline + 5.0)
    for s in sorted(samples, key=lambda s: s.start):
        if window[0] <= s.start <= window[1] or (
            s.start < stopped and s.start + (s.e2e or 0) >= stopped
        ):
            cached = "-" if s.cached_tokens is None else str(s.cached_tokens)
            lines.append(
                f"    {s.start:7.2f}s  {_seconds(s.ttft):>7}  {s.prompt_tokens:>6}  {cached:>6}"
                f"  {s.workload} #{s.index}" + (f"  {s.error}" if s.error else "")
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class Projection:
    model: ModelShape
    gpu: Gpu
    mfu: float
    prompt_tokens: int
    measured: LoadBandwidth
    """kvfabric's load bandwidth measured here, with values shaped as this model's blocks."""

    @property
    def measured_bandwidth(self) -> float:
        return self.measured.bytes_per_second

    @property
    def flops_per_token(self) -> float:
        return self.model.prefill_flops_per_token(self.prompt_tokens)

    @property
    def bandwidth(self) -> float:
        return min(self.measured_bandwidth, self.gpu.host_link_bytes_per_s)

    @property
    def recompute_seconds(self) -> float:
        return self.prompt_tokens * self.flops_per_token / (self.gpu.peak_flops * self.mfu)

    @property
    def load_seconds(self) -> float:
        return self.prompt_tokens * self.model.kv_bytes_per_token / self.bandwidth

    @property
    def break_even_bandwidth(self) -> float:
        """The load bandwidth above which loading the prefix beats recomputing it."""
        return self.model.kv_bytes_per_token * self.gpu.peak_flops * self.mfu / self.flops_per_token

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "mfu": self.mfu,
            "prompt_tokens": self.prompt_tokens,
            "flops_per_token": self.flops_per_token,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "measured_bandwidth": self.measured.to_json(),
            "bandwidth_used": self.bandwidth,
            "recompute_seconds": self.recompute_seconds,
            "load_seconds": self.load_seconds,
            "speedup": self.recompute_seconds / self.load_seconds,
            "break_even_bandwidth": self.break_even_bandwidth,
        }


def projection(p: Projection) -> str:
    m, g, b = p.model, p.gpu, p.measured
    flops, kv = p.flops_per_token, m.kv_bytes_per_token
    return "\n".join(
        [
            f"projection, not a measurement: a {p.prompt_tokens}-token cached prefix of "
            f"{m.name} on one {g.name}",
            f"  F = prefill FLOPs/token = 2 * {m.dense_params / 1e9:.2f}e9 params + attention "
            f"= {flops / 1e9:.1f} GFLOP",
            f"  K = KV bytes/token = {kv >> 10} KiB ({flops / kv:,.0f} FLOP per KV byte)",
            f"  recompute = P*F / (peak*MFU) = {p.prompt_tokens}*F / "
            f"({g.peak_flops / 1e12:.0f} TFLOP/s * {p.mfu:g}) = {_seconds(p.recompute_seconds)}",
            f"  load      = P*K / min(B, host link) = {p.prompt_tokens}*K / "
            f"min({b.bytes_per_second / 1e9:.2f}, {g.host_link_bytes_per_s / 1e9:.0f} GB/s) "
            f"= {_seconds(p.load_seconds)}",
            f"    B: kvfabric's load bandwidth measured here over {b.transport}, {b.blocks} "
            f"values of {b.value_bytes >> 10} KiB, each one block of {m.name} "
            f"({m.layers} pages of {b.value_bytes // m.layers >> 10} KiB)",
            f"  -> recompute / load = {p.recompute_seconds / p.load_seconds:.1f}x; loading wins "
            f"above B* = K*peak*MFU/F = {p.break_even_bandwidth / 1e9:.2f} GB/s",
        ]
    )


def host_projection(
    shape: ModelShape,
    bandwidth: LoadBandwidth,
    prefill_tokens_per_second: float,
    prompt_tokens: int,
) -> str:
    """The same formula on this host, from its measured prefill rate, to set beside the table."""
    rate = prefill_tokens_per_second
    load_rate = bandwidth.bytes_per_second / shape.kv_bytes_per_token
    flops = rate * shape.prefill_flops_per_token(prompt_tokens)
    return (
        f"this host: prefill alone {rate:,.0f} tokens/s at {prompt_tokens} tokens "
        f"({flops / 1e9:,.0f} GFLOP/s); load {bandwidth.bytes_per_second / 1e9:.2f} GB/s "
        f"= {load_rate:,.0f} tokens/s:\n  loading a prefix is {load_rate / rate:.1f}x faster than "
        "computing it, before the request's own tokens, queueing and the engine's step overhead"
    )


def _binned(samples: Sequence[Sample], edges: np.ndarray) -> tuple[list[float], list[float]]:
    """Median TTFT of the samples in each prompt-length bin, at the bin's median length."""
    x, y = [], []
    for i, (lo, hi) in enumerate(itertools.pairwise(edges)):
        last = i == len(edges) - 2
        inside = [s for s in samples if lo <= s.prompt_tokens and (s.prompt_tokens < hi or last)]
        ttfts = [s.ttft for s in inside if s.ttft is not None]
        if ttfts:
            x.append(float(np.median([s.prompt_tokens for s in inside])))
            y.append(float(np.median(ttfts)))
    return x, y


def _edges(lengths: Sequence[int], bins: int) -> np.ndarray:
    values = np.asarray(sorted(set(lengths)), dtype=float)
    if len(values) == 1:
        return np.array([values[0], values[0] + 1])
    return np.unique(np.quantile(values, np.linspace(0, 1, min(bins, len(values)) + 1)))


def plot(rows: Sequence[Measured], workloads: Sequence[str], path: Path) -> None:
    """TTFT by prompt length, one line per configuration: every workload together, then one
    panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    measured = [r for r in rows if r.ok]
    if not measured:
        return
    panels = ["all workloads"] + [w for w in workloads if any(r.workload == w for r in measured)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    labels = list(dict.fromkeys(r.label for r in measured))
    for ax, panel in zip(axes[0], panels, strict=True):
        mine = [r for r in measured if panel == "all workloads" or r.workload == panel]
        edges = _edges(
            [s.prompt_tokens for r in mine for s in r.ok], 12 if panel == panels[0] else 8
        )
        for label in labels:
            samples = [s for r in mine if r.label == label for s in r.ok]
            if samples:
                x, y = _binned(samples, edges)
                ax.plot(x, y, marker="o", label=label)
        ax.set_title(panel)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("median TTFT")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _seconds(v)))
        low, high = ax.get_ylim()
        # Within one decade there may be no major tick: label the minor ones then.
        minor = (lambda v, _: _seconds(v)) if high < 10 * low else (lambda v, _: "")
        ax.yaxis.set_minor_formatter(FuncFormatter(minor))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))
