"""The kvfabric side of the serving bench: its processes, the load bandwidth, a frozen node.

The tier is a real ``kvfabric controller`` and one ``kvfabric node`` on 127.0.0.1
(:class:`kvfabric.testing.Cluster`, the same commands an operator runs), so the node can be
stopped alone with SIGSTOP. The load bandwidth is measured on it before any engine runs, the
way the connector loads: values of one block (the block's page of every layer) read with
``batched_get_scattered`` into per-layer pages, after one ``batched_contains``.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import kvfabric
from kvfabric.testing import Cluster

__all__ = ["Freeze", "LoadBandwidth", "Tier"]


@dataclass(frozen=True)
class LoadBandwidth:
    transport: str
    blocks: int
    value_bytes: int
    lookup_seconds: float
    load_seconds: float
    memcpy_seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.blocks * self.value_bytes / self.load_seconds

    @property
    def memcpy_bytes_per_second(self) -> float:
        return self.blocks * self.value_bytes / self.memcpy_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "bytes_per_second": self.bytes_per_second,
            "memcpy_bytes_per_second": self.memcpy_bytes_per_second,
        }


class Tier:
    """A controller and one data node; :meth:`url` is what the engines' connectors open.

    With ``url``, an existing deployment instead: nothing is started (and nothing can be
    frozen or counted from here).
    """

    def __init__(
        self,
        *,
        capacity: str,
        transport: str,
        timeout: str,
        node_timeout: str,
        url: str | None = None,
    ) -> None:
        self.transport = transport
        self.timeout = timeout
        self._url = url
        self.cluster = None
        if url is None:
            self.cluster = Cluster(
                nodes=1,
                capacity=capacity,
                transports=("tcp", "shm"),
                controller_args=["--node-timeout", node_timeout],
            )

    def url(self) -> str:
        if self._url is not None:
            return self._url
        assert self.cluster is not None
        options = {"timeout": self.timeout}
        if self.transport != "auto":
            options["transport"] = self.transport
        return str(self.cluster.url(**options))

    @property
    def node_pid(self) -> int:
        if self.cluster is None:
            raise RuntimeError("the tier was not started here: no node to freeze")
        return int(self.cluster.node_pid(0))

    def stats(self) -> dict[str, dict[str, int]]:
        if self.cluster is None:
            return {}
        try:
            stats: dict[str, dict[str, int]] = self.cluster.stats()
        except kvfabric.KvfabricError:
            return {}
        return stats

    def wait_saves_settled(self, timeout: float = 60.0) -> None:
        """Until nothing is in flight and the entry count has held still for a second: an
        engine's background saves are in before it is stopped."""
        deadline = time.monotonic() + timeout
        last: tuple[int, int] | None = None
        still_since = time.monotonic()
        while time.monotonic() < deadline:
            index = self.stats().get("index", {})
            now = (index.get("entries", 0), index.get("in_flight", 0) + index.get("pending", 0))
            if now != last:
                last, still_since = now, time.monotonic()
            elif now[1] == 0 and time.monotonic() - still_since >= 1.0:
                return
            time.sleep(0.2)

    def measure_load(
        self, *, layers: int, page_bytes: int, blocks: int = 64, repeat: int = 5
    ) -> LoadBandwidth:
        """Lookup and load of ``blocks`` block values as the connector does them, median of
        ``repeat``; memcpy of the same bytes beside it."""
        value_bytes = layers * page_bytes
        rng = np.random.default_rng(0)
        values = [rng.integers(0, 255, value_bytes, dtype=np.uint8) for _ in range(blocks)]
        keys = [os.urandom(32) for _ in range(blocks)]
        pages = [[np.empty(page_bytes, np.uint8) for _ in range(layers)] for _ in range(blocks)]
        flat = np.concatenate(values)
        flat_copy = np.empty_like(flat)
        lookups, loads, copies = [], [], []
        with kvfabric.connect(self.url()) as store:
            store.batched_put(keys, values)
            for _ in range(repeat):
                started = time.perf_counter()
                hits = store.batched_contains(keys)
                looked_up = time.perf_counter()
                landed = store.batched_get_scattered(keys, pages)
                done = time.perf_counter()
                if hits != blocks or not all(landed):
                    raise RuntimeError(
                        f"load probe: {hits} of {blocks} found, {sum(landed)} landed"
                    )
                lookups.append(looked_up - started)
                loads.append(done - looked_up)
                started = time.perf_counter()
                np.copyto(flat_copy, flat)
                copies.append(time.perf_counter() - started)
            store.delete(keys)
        return LoadBandwidth(
            transport=self.transport,
            blocks=blocks,
            value_bytes=value_bytes,
            lookup_seconds=statistics.median(lookups),
            load_seconds=statistics.median(loads),
            memcpy_seconds=statistics.median(copies),
        )

    def save_logs(self, directory: Path) -> None:
        if self.cluster is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        for log in self.cluster.logs.glob("*.log"):
            (directory / f"kvfabric-{log.name}").write_bytes(log.read_bytes())

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


class Freeze:
    """SIGSTOP the data node ``at`` seconds after :meth:`start`, SIGCONT ``seconds`` later."""

    def __init__(self, pid: int, at: float, seconds: float) -> None:
        self.pid = pid
        self.at = at
        self.seconds = seconds
        self.stopped_at: float | None = None
        self.continued_at: float | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        """``t0``: the pass's start (``time.perf_counter()``); times are reported from it."""
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, name="freeze-node", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cancel.wait(max(0.0, self._t0 + self.at - time.perf_counter())):
            return
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped_at = time.perf_counter() - self._t0
        self._cancel.wait(self.seconds)
        os.kill(self.pid, signal.SIGCONT)
        self.continued_at = time.perf_counter() - self._t0

    def finish(self) -> None:
        """End the freeze now if it is still on (the node always runs again afterwards)."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "at": self.at,
            "seconds": self.seconds,
            "stopped_at": self.stopped_at,
            "continued_at": self.continued_at,
        }
