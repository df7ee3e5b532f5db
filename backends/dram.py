"""The ``dram`` backend: regions in shareable anonymous memory (Linux ``memfd``).

Each region is a memfd mapped by the data node. Another process on the same host (the
``shm`` transport's client) maps the very same pages through ``/proc/<pid>/fd/<fd>``, so
reads are one-sided: the node does nothing per read. Nothing is left behind in ``/dev/shm``
when the node dies, because a memfd lives only as long as someone holds it.

At start the node allocates every page and fills its page tables (``dram.prefault``, on by
default; several threads, the GIL released), as registering memory for RDMA would: a put
into fresh memory otherwise traps once per 4 KiB page, in the node and in every client
mapping it. It takes time in proportion to the capacity (the node's ready line and its
``prefault_ms`` say how long); turn it off for capacities the machine should only commit as
they fill.

Each region asks for 2 MiB pages (``madvise``; ``dram.huge_pages``, on by default), which
the kernel grants where its policy for shared memory allows (``kvfabric._runtime.huge_pages``;
many distributions ship ``never``, where asking changes nothing). Page tables then take
4 KiB per GiB instead of 2 MiB, in the node and in every shm client mapping its regions,
and every 4 KiB a read touches no longer costs a TLB miss. How much that buys, in reads and
in the time preparing the regions takes, depends on the host (docs/performance.md, "Backends
and prefaulting"). Turn it off (``dram.huge_pages=false``) where the start matters more and
huge pages come slowly (a fragmented host). The node's ready line and its
``huge_page_bytes`` say what it got (under the kernel policy ``always`` regions get huge
pages without asking).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import time
from collections.abc import Sequence

from kvfabric._runtime.buffers import prefault_all
from kvfabric._runtime.huge_pages import (
    SHMEM_POLICY,
    advise_huge_pages,
    mapped_pages,
    policy_grants_advised,
    shmem_huge_policy,
)
from kvfabric._runtime.regions import region_sizes, release_mappings
from kvfabric._runtime.step_log import StepLog
from kvfabric.errors import ConfigError, PluginUnavailableError
from kvfabric.spi import (
    Backend,
    BackendConfig,
    MemoryKind,
    OptionSpec,
    Region,
    Registry,
    format_size,
    hookimpl,
    new_rkey,
    parse_bool,
)

__all__ = ["DramBackend"]

log = logging.getLogger(__name__)

# huge_page_bytes() reads /proc/self/smaps, too slow to repeat on each heartbeat (every
# second), and what the kernel maps changes only by compaction or a split.
_PAGES_STALE_AFTER = 30.0


class DramBackend(Backend):
    name = "dram"
    memory_kind = MemoryKind.DRAM
    shareable = True
    options = (
        OptionSpec(
            name="prefault",
            parse=parse_bool,
            default=True,
            help="allocate and map every page at start, so the first puts do not fault "
            "(false: memory is committed as it fills)",
        ),
        OptionSpec(
            name="huge_pages",
            parse=parse_bool,
            default=True,
            help="ask for 2 MiB pages (madvise), granted where the kernel's "
            "transparent_hugepage/shmem_enabled allows: fewer page tables and TLB misses "
            "(faster shm reads); false on a fragmented host where they come slowly",
        ),
    )

    @classmethod
    def check_available(cls) -> None:
        if not hasattr(os, "memfd_create"):
            raise PluginUnavailableError("the dram backend needs Linux (os.memfd_create)")

    def __init__(self, config: BackendConfig) -> None:
        sizes = region_sizes(config.capacity, config.region_size)
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._regions: list[Region] = []
        self.prefault_seconds = 0.0
        """How long preparing the memory at start took (0 with ``prefault`` off)."""
        # Names unique to this backend, so that smaps tells its mappings from another's
        # (several embedded stores may live in one process).
        self._name = f"kvfabric-region-{secrets.token_hex(4)}-"
        self._advise = bool(config.options.get("huge_pages", True))
        self._pages: tuple[float, int] | None = None  # (when, huge_page_bytes)
        try:
            for size in sizes:
                self._regions.append(self._make_region(len(self._regions), size))
            if config.options.get("prefault", True):
                self._prefault()
        except BaseException:
            self.close()
            raise
        if self._advise and not policy_grants_advised():
            # Debug, not info: asking is the default, so on a host that grants nothing this
            # is the usual case, and a node's start says nothing it need not (the ready line
            # and huge_page_bytes say what it got).
            log.debug(
                "kvfabric dram backend: regions on 4 KiB pages (the kernel's shared-memory "
                "huge page policy is %r; 'advise' in %s lets them have 2 MiB pages)",
                shmem_huge_policy(),
                SHMEM_POLICY,
            )

    def huge_page_bytes(self) -> int:
        """How many bytes of the regions huge pages map now (at most 30 s old)."""
        now = time.monotonic()
        if self._pages is None or now - self._pages[0] > _PAGES_STALE_AFTER:
            self._pages = (now, mapped_pages(self._name).huge)
        return self._pages[1]

    def _prefault(self) -> None:
        total = sum(r.size for r in self._regions)
        try:
            with StepLog(
                log, f"preparing {format_size(total)} of memory (dram.prefault)", total=total
            ) as step:
                self.prefault_seconds = prefault_all(
                    [r.view for r in self._regions], progress=step.advance
                )
        except OSError as exc:
            raise ConfigError(
                f"dram backend: cannot allocate {format_size(sum(r.size for r in self._regions))}"
                f" ({exc}); lower --capacity, or set dram.prefault=false to commit memory as "
                "it fills"
            ) from exc
        log.debug(
            "kvfabric dram backend: %s prefaulted in %.2f s",
            format_size(sum(r.size for r in self._regions)),
            self.prefault_seconds,
        )

    def _make_region(self, region_id: int, size: int) -> Region:
        fd = os.memfd_create(f"{self._name}{region_id}", os.MFD_CLOEXEC)
        self._fds.append(fd)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mapping)
        if self._advise:
            advise_huge_pages(mapping)  # before the first touch: pages come whole
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
        release_mappings([region.view for region in self._regions], self._maps)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._regions.clear()
        self._maps.clear()
        self._fds.clear()


@hookimpl
def kvfabric_register_backends(registry: Registry[Backend]) -> None:
    registry.add(DramBackend.name, DramBackend)
