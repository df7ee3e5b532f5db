"""Checks on a data node's capacity before any memory is allocated.

A capacity that cannot hold one record, more DRAM than this machine (or its container) has,
or more regions than the process may hold file descriptors for, is refused with a line that
says what to give instead, rather than failing halfway through allocation with a traceback
(``--capacity 100TiB`` would otherwise end in ``OSError: Too many open files``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
from pathlib import Path

from kvfabric._runtime.record import record_size
from kvfabric.errors import ConfigError
from kvfabric.spi import Backend, MemoryKind
from kvfabric.spi.units import format_size

__all__ = ["check_capacity", "memory_limit"]

log = logging.getLogger("kvfabric._node.capacity")

# File descriptors left for sockets, logs and libraries once every region holds one.
_SPARE_FDS = 256


def memory_limit() -> int | None:
    """Bytes of memory this process can have: the machine's, or its cgroup's if lower."""
    limits: list[int] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(ValueError, OSError):
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():  # "max" means no limit
            limits.append(int(text))
    return min(limits) if limits else None


def _available_memory() -> int | None:
    with contextlib.suppress(ValueError, OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_capacity(
    capacity: int,
    region_size: int,
    backend: type[Backend],
    *,
    option: str = "--capacity",
    region_option: str = "--region-size",
) -> None:
    """Raise :class:`ConfigError` for a capacity this node cannot or should not allocate."""
    smallest = record_size(1)
    if capacity < smallest:
        # A size without a unit is bytes: "16" likely meant 16GiB (no such hint for 0).
        hint = f"; a size without a unit is bytes: write e.g. {capacity}GiB" if capacity else ""
        raise ConfigError(
            f"{option} {capacity} bytes is smaller than one slot ({smallest} bytes: a "
            f"record header and one payload block){hint}"
        )
    if region_size < smallest:
        raise ConfigError(
            f"{region_option} {region_size} bytes is smaller than one slot ({smallest} bytes); "
            "give it with a unit, e.g. 1GiB"
        )
    if backend.memory_kind is not MemoryKind.DRAM:
        return
    limit = memory_limit()
    if limit is not None and capacity > limit:
        raise ConfigError(
            f"{option} {format_size(capacity)} is more than this machine's memory "
            f"({format_size(limit)}); give at most that, less what the system needs"
        )
    available = _available_memory()
    if available is not None and capacity > available:
        # Pages are taken as records land, not at start-up, so this can still work.
        log.warning(
            "capacity %s is more than the memory available now (%s): the node may be "
            "killed for memory once it fills",
            format_size(capacity),
            format_size(available),
        )
    regions = -(-capacity // max(region_size, 1))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and regions + _SPARE_FDS > soft:
        raise ConfigError(
            f"{option} {format_size(capacity)} in regions of {format_size(region_size)} is "
            f"{regions} regions, each holding a file descriptor, but this process may open "
            f"{soft} (ulimit -n); use a larger {region_option} or raise the limit"
        )
