"""The row every part of ``kvfabric bench`` reports: one phase of one system at one chunk size.

``seconds`` is the median time of one batch (lookups: of one call; controller CPU: the CPU
seconds per lookup). The peer scripts print rows as JSON (:meth:`BenchRow.from_json` reads
them back); phase names are :class:`kvfabric._tools.bench_timing.Phase`'s.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["BenchRow"]


@attrs.frozen(kw_only=True)
class BenchRow:
    """One measurement: ``seconds`` is the median time of one batch of ``count`` chunks of
    ``size`` bytes (lookups: of one call of ``count`` keys)."""

    system: str
    phase: str
    size: int
    count: int
    seconds: float
    note: str = ""
    # Reads beside a busy thread: the share of its idle counting rate that thread kept.
    kept: float | None = None
    # Reads alone: the CPU they kept busy, in cores (this process and the servers it read
    # from together), and the CPUs this host lets them use.
    cores: float | None = None
    cpus: int | None = None

    @property
    def room(self) -> float | None:
        """Reads alone: the share of their rate a host of ``cpus`` CPUs can leave them beside
        a loop that takes one CPU, if each core's worth of work needs a core
        (``min(1, (cpus - 1) / cores)``): where it is below a goal, the host sets the ratio."""
        if self.cores is None or self.cpus is None or self.cores <= 0:
            return None
        return min(1.0, (self.cpus - 1) / self.cores)

    @property
    def gbps(self) -> float:
        return self.size * self.count / self.seconds / 1e9

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchRow:
        return cls(
            system=str(data["system"]),
            phase=str(data["phase"]),
            size=int(data["size"]),
            count=int(data["count"]),
            seconds=float(data["seconds"]),
            note=str(data.get("note") or ""),
            kept=None if data.get("kept") is None else float(data["kept"]),
            cores=None if data.get("cores") is None else float(data["cores"]),
            cpus=None if data.get("cpus") is None else int(data["cpus"]),
        )
