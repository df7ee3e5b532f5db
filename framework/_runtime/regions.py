"""A backend's capacity carved into regions, and the regions' mappings let go of at close.

The built-in backends (``dram``, ``file``) split ``--capacity`` the same way and unmap
the same way; the memory each region lives in (a memfd, a file) is theirs.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable

from kvfabric.errors import ConfigError

__all__ = ["region_sizes", "release_mappings"]


def region_sizes(capacity: int, region_size: int, *, align: int = 1) -> list[int]:
    """The sizes of the regions ``capacity`` bytes make: ``region_size`` each and the rest
    in the last, each rounded down to a multiple of ``align`` (what is left under ``align``
    makes no region). ConfigError unless both sizes are positive."""
    if capacity <= 0 or region_size <= 0:
        raise ConfigError("capacity and region_size must be positive")
    sizes: list[int] = []
    remaining = capacity
    while remaining > 0:
        size = min(remaining, region_size)
        size -= size % align
        if size <= 0:
            break
        sizes.append(size)
        remaining -= size
    return sizes


def release_mappings(views: Iterable[memoryview], mappings: Iterable[mmap.mmap]) -> None:
    """Release the regions' views, then close their mappings. A caller still holding a view
    of one (a numpy array, say) keeps its pages alive until it lets go; that mapping is then
    unmapped by the garbage collector instead."""
    for view in views:
        with contextlib.suppress(BufferError):
            view.release()
    for mapping in mappings:
        with contextlib.suppress(BufferError):
            mapping.close()
