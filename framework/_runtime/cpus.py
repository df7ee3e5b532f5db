"""How many CPUs this process can keep busy: the CPUs it may run on, capped by the CPU quota
of its control groups.

A container's CPU limit (``docker run --cpus``, a Kubernetes pod's ``limits.cpu``) is a
quota of CPU time, not a set of CPUs: ``os.sched_getaffinity`` still shows every CPU of the
host, and a choice sized by it (threads that each want a core) overcommits the container.
The quota is read from cgroup v2's ``cpu.max`` or cgroup v1's ``cpu.cfs_quota_us`` and
``cpu.cfs_period_us``, in this process's group and each group above it (the tightest
wins), rounded up to whole CPUs. Where no quota can be read, the affinity stands.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["usable_cpus"]


def usable_cpus(
    *, cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> int:
    """CPUs this process may run on, capped by its cgroups' CPU quota (at least 1)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _quota_cpus(Path(cgroup_root), Path(self_cgroup))
    return cpus if quota is None else max(1, min(cpus, quota))


def _quota_cpus(root: Path, self_cgroup: Path) -> int | None:
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            # cgroup v2: mounted at the root, or beside v1 under "unified" (hybrid hosts).
            for mount in (root, root / "unified"):
                limits += _along(mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu"):
                if mount.is_dir():
                    limits += _along(mount, path, _v1_quota)
                    break
    return min(limits) if limits else None


def _along(mount: Path, path: str, quota: Callable[[Path], int | None]) -> list[int]:
    """The quota of the group at ``path`` and of each group above it, where one is set."""
    found = []
    group = mount / path.strip("/")
    while True:
        limit = quota(group)
        if limit is not None:
            found.append(limit)
        if group == mount or group.parent == group:
            return found
        group = group.parent


def _v2_quota(group: Path) -> int | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
        return _cpus(int(quota), int(period)) if quota != "max" else None
    except (OSError, ValueError):
        return None


def _v1_quota(group: Path) -> int | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _cpus(quota, period) if quota > 0 else None


def _cpus(quota: int, period: int) -> int | None:
    return math.ceil(quota / period) if period > 0 else None
