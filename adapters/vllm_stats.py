"""The vLLM connector's statistics in vLLM's own format: its logs and its ``/metrics``.

Each step vLLM asks both roles of the connector for what they did since the last ask
(``get_kv_connector_stats``), merges the answers (``aggregate``), and hands the merged data to
its log line (``reduce``: "KV Transfer metrics: ...") and to its Prometheus exporter
(:class:`KVFabricPromMetrics`, built by ``build_prom_metrics``). :class:`IntervalStats` turns
a role's cumulative counters into those per-interval answers: the difference since the last
one, plus each load's duration for the load-time histogram.

What is counted, per block where a block is the unit: hits and misses of the requests vLLM
admitted (the scheduler), blocks and bytes loaded and saved, blocks that failed to load,
loads abandoned at their deadline, and saves dropped because the store was behind (the
workers). With tensor parallelism every rank's worker counts its own shard of a block.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Typed where vLLM is installed; Any where it is not (kvfabric's lint env).
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvfabric.spi import Counters

__all__ = [
    "COUNTED",
    "LOAD_SECONDS",
    "IntervalStats",
    "KVFabricConnectorStats",
    "KVFabricPromMetrics",
]

COUNTED = {
    # stats key: the connector counter it is the interval's difference of
    "hit_blocks": "hit_blocks",
    "miss_blocks": "miss_blocks",
    "loaded_blocks": "loaded_blocks",
    "loaded_bytes": "loaded_bytes",
    "load_error_blocks": "load_errors",
    "load_timeouts": "load_timeouts",
    "saved_blocks": "saved_blocks",
    "saved_bytes": "saved_bytes",
    "save_deduplicated_blocks": "save_deduplicated_blocks",
    "save_failed_blocks": "save_failed_blocks",
    "save_dropped_blocks": "save_skipped_blocks",
}
"""The counts the stats carry, and the connector counter each one comes from."""

LOAD_SECONDS = "load_seconds"
"""The stats key of the loads' durations (seconds, one per request's load)."""

_LOAD_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class IntervalStats:
    """One role's statistics since vLLM last asked, from its cumulative counters."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._last = counters.snapshot()
        self._lock = threading.Lock()
        self._load_seconds: list[float] = []

    def load_took(self, seconds: float) -> None:
        """A request's load finished (landed, failed or abandoned) after ``seconds``."""
        with self._lock:
            self._load_seconds.append(seconds)

    def take(self) -> KVFabricConnectorStats | None:
        """What was counted since the last call; None when nothing was."""
        now = self._counters.snapshot()
        data: dict[str, Any] = {}
        for key, counter in COUNTED.items():
            if counter in now and now[counter] != self._last.get(counter, 0):
                data[key] = now[counter] - self._last.get(counter, 0)
        self._last = now
        with self._lock:
            seconds, self._load_seconds = self._load_seconds, []
        if seconds:
            data[LOAD_SECONDS] = seconds
        return KVFabricConnectorStats(data=data) if data else None


@dataclass
class KVFabricConnectorStats(KVConnectorStats):  # type: ignore[misc, unused-ignore]
    """The connector's statistics over an interval (``data``: counts and load durations).

    Plain ints and a list of floats, so that vLLM can send them between its processes.
    """

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVFabricConnectorStats:
        """Add ``other``'s counts and durations to these (vLLM merges roles and steps)."""
        for key, value in other.data.items():
            if key == LOAD_SECONDS:
                self.data[key] = [*self.data.get(key, ()), *value]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in one line: every count, the hit rate and the load time."""
        reduced: dict[str, int | float] = {key: self.data.get(key, 0) for key in COUNTED}
        looked_up = reduced["hit_blocks"] + reduced["miss_blocks"]
        reduced["hit_rate"] = round(reduced["hit_blocks"] / looked_up, 4) if looked_up else 0.0
        seconds = sorted(self.data.get(LOAD_SECONDS, ()))
        reduced["loads"] = len(seconds)
        if seconds:
            reduced["load_avg_ms"] = round(sum(seconds) / len(seconds) * 1e3, 3)
            reduced["load_p90_ms"] = round(seconds[int(0.9 * (len(seconds) - 1))] * 1e3, 3)
            reduced["load_max_ms"] = round(seconds[-1] * 1e3, 3)
        return reduced


class KVFabricPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc, unused-ignore]
    """The connector's statistics as Prometheus metrics in vLLM's registry (``/metrics``).

    One metric per quantity, what varies in a label: blocks looked up by ``result`` (hit,
    miss), blocks loaded by ``outcome`` (loaded, error), blocks saved by ``outcome``
    (stored, deduplicated, failed, dropped), bytes loaded and saved, loads abandoned at their
    deadline, and a histogram of load time.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, histogram = self._counter_cls, self._histogram_cls
        self._lookup_blocks = counter(
            name="vllm:kvfabric_lookup_blocks_total",
            documentation="Blocks of admitted requests looked up in kvfabric, by result "
            "(hit: loaded from kvfabric instead of computed; miss: not there).",
            labelnames=[*labelnames, "result"],
        )
        self._load_blocks = counter(
            name="vllm:kvfabric_load_blocks_total",
            documentation="Blocks loaded from kvfabric, by outcome (error: not landed intact "
            "or not within the load deadline; vLLM recomputed them).",
            labelnames=[*labelnames, "outcome"],
        )
        self._save_blocks = counter(
            name="vllm:kvfabric_save_blocks_total",
            documentation="Full blocks offered to kvfabric, by outcome (deduplicated: already "
            "stored, no bytes moved; dropped: not saved because saves were behind).",
            labelnames=[*labelnames, "outcome"],
        )
        self._load_bytes = counter(
            name="vllm:kvfabric_load_bytes_total",
            documentation="Bytes of KV loaded from kvfabric into the paged cache.",
            labelnames=labelnames,
        )
        self._save_bytes = counter(
            name="vllm:kvfabric_save_bytes_total",
            documentation="Bytes of KV stored into kvfabric.",
            labelnames=labelnames,
        )
        self._load_timeouts = counter(
            name="vllm:kvfabric_load_timeouts_total",
            documentation="Requests whose load did not finish within the load deadline "
            "(their blocks were recomputed).",
            labelnames=labelnames,
        )
        self._load_time = histogram(
            name="vllm:kvfabric_load_time_seconds",
            documentation="Time from a request's load being started to its blocks being "
            "in the paged cache (or the load failing or reaching its deadline).",
            buckets=list(_LOAD_TIME_BUCKETS),
            labelnames=labelnames,
        )
        # stats key -> (metric, extra label value or None)
        self._counts: dict[str, tuple[Any, str | None]] = {
            "hit_blocks": (self._lookup_blocks, "hit"),
            "miss_blocks": (self._lookup_blocks, "miss"),
            "loaded_blocks": (self._load_blocks, "loaded"),
            "load_error_blocks": (self._load_blocks, "error"),
            "saved_blocks": (self._save_blocks, "stored"),
            "save_deduplicated_blocks": (self._save_blocks, "deduplicated"),
            "save_failed_blocks": (self._save_blocks, "failed"),
            "save_dropped_blocks": (self._save_blocks, "dropped"),
            "loaded_bytes": (self._load_bytes, None),
            "saved_bytes": (self._save_bytes, None),
            "load_timeouts": (self._load_timeouts, None),
        }
        self._children: dict[tuple[int, str], Any] = {}

    def _child(self, engine_idx: int, key: str) -> Any:
        child = self._children.get((engine_idx, key))
        if child is None:
            labels = list(self.per_engine_labelvalues[engine_idx])
            if key == LOAD_SECONDS:
                child = self._load_time.labels(*labels)
            else:
                metric, extra = self._counts[key]
                child = metric.labels(*labels, *([extra] if extra else []))
            self._children[engine_idx, key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key == LOAD_SECONDS:
                histogram = self._child(engine_idx, key)
                for seconds in value:
                    histogram.observe(seconds)
            elif key in self._counts and value:
                self._child(engine_idx, key).inc(value)
