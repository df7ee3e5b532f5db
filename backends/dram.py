"""The ``dram`` backend: regions in shareable anonymous memory (Linux ``memfd``).

Each region is a memfd mapped by the data node. Another process on the same host (the
``shm`` transport's client) maps the very same pages through ``/proc/<pid>/fd/<fd>``, so
reads are one-sided: the node does nothing per read. Nothing is left behind in ``/dev/shm``
when the node dies, because a memfd lives only as long as someone holds it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

from kvfabric.errors import ConfigError, PluginUnavailableError
from kvfabric.spi import Backend, BackendConfig, MemoryKind, Region, Registry, hookimpl, new_rkey

__all__ = ["DramBackend"]


class DramBackend(Backend):
    name = "dram"
    memory_kind = MemoryKind.DRAM
    shareable = True

    @classmethod
    def check_available(cls) -> None:
        if not hasattr(os, "memfd_create"):
            raise PluginUnavailableError("the dram backend needs Linux (os.memfd_create)")

    def __init__(self, config: BackendConfig) -> None:
        if config.options:
            raise ConfigError(f"dram backend takes no options, got {sorted(config.options)}")
        if config.capacity <= 0 or config.region_size <= 0:
            raise ConfigError("capacity and region_size must be positive")
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._regions: list[Region] = []
        remaining = config.capacity
        try:
            while remaining > 0:
                size = min(remaining, config.region_size)
                self._regions.append(self._make_region(len(self._regions), size))
                remaining -= size
        except BaseException:
            self.close()
            raise

    def _make_region(self, region_id: int, size: int) -> Region:
        fd = os.memfd_create(f"kvfabric-region-{region_id}", os.MFD_CLOEXEC)
        self._fds.append(fd)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mapping)
        return Region(
            id=region_id,
            size=size,
            rkey=new_rkey(),
            kind=MemoryKind.DRAM,
            view=memoryview(mapping),
            path=f"/proc/{os.getpid()}/fd/{fd}",
        )

    def regions(self) -> Sequence[Region]:
        return tuple(self._regions)

    def close(self) -> None:
        # A caller still holding a numpy view of a region keeps its pages alive until it
        # lets go; the mapping is then unmapped by the garbage collector instead.
        for region in self._regions:
            with contextlib.suppress(BufferError):
                region.view.release()
        for mapping in self._maps:
            with contextlib.suppress(BufferError):
                mapping.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._regions.clear()
        self._maps.clear()
        self._fds.clear()


@hookimpl
def kvfabric_register_backends(registry: Registry[Backend]) -> None:
    registry.add(DramBackend.name, DramBackend)
