"""The ``dram`` backend asks for 2 MiB pages unless told not to (``dram.huge_pages=false``)
and says what it got (``huge_page_bytes``, and in the node's ready line).

Whether the kernel grants them is the host's policy for shared memory
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``), which these tests read but never
change: what they assert holds under every policy (the advice is on the mappings; under
``never`` nothing is on huge pages, under a granting policy at most everything is).
"""

from __future__ import annotations

import os

from kvfabric._plugins import PluginOptions, plugin_manager
from kvfabric._runtime.huge_pages import (
    MappedPages,
    mapped_pages,
    parse_smaps,
    policy_grants_advised,
    shmem_huge_policy,
)
from kvfabric.spi import Backend, BackendConfig

_MIB = 1 << 20

_SMAPS = """\
7f0000000000-7f0000400000 rw-s 00000000 00:01 1234    /memfd:kvfabric-region-ab-0 (deleted)
Size:               4096 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
VmFlags: rd wr sh mr mw me ms sd hg
7f0000400000-7f0000600000 r--s 00000000 00:01 1235    /memfd:kvfabric-region-cd-0 (deleted)
Size:               2048 kB
ShmemPmdMapped:     2048 kB
VmFlags: rd sh mr mw me ms sd hg
7f0000600000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac hg
7f0000800000-7f0000c00000 r--s 00000000 00:01 1234    /memfd:kvfabric-region-ab-1 (deleted)
Size:               4096 kB
ShmemPmdMapped:        0 kB
VmFlags: rd sh mr mw me ms sd
"""


def test_smaps_are_summed_over_the_named_mappings_only() -> None:
    pages = parse_smaps(_SMAPS, "kvfabric-region-ab-")
    assert pages == MappedPages(mapped=8 * _MIB, huge=2 * _MIB, advised=4 * _MIB)
    assert parse_smaps(_SMAPS, "kvfabric-region-zz-") == MappedPages()


def _dram(**options: str) -> Backend:
    cls = plugin_manager().backend("dram")
    parsed = PluginOptions({"dram": options}).claim(cls) if options else cls.parse_options({})
    return cls(BackendConfig(capacity=8 * _MIB, region_size=4 * _MIB, options=parsed))


def _memfd_name(path: str | None) -> str:
    """The name smaps shows for a region's memfd (``/memfd:NAME (deleted)``)."""
    assert path is not None
    return os.readlink(path).removeprefix("/memfd:").removesuffix(" (deleted)")


def _huge_page_bytes(backend: Backend) -> int:
    # Not part of the Backend interface: what the dram backend tells the node.
    return int(getattr(backend, "huge_page_bytes")())  # noqa: B009


def test_every_region_asks_for_huge_pages_and_the_count_follows_the_kernel_policy() -> None:
    backend = _dram()
    try:
        for region in backend.regions():
            pages = mapped_pages(_memfd_name(region.path))
            assert pages.mapped == region.size
            assert pages.advised == region.size
        huge = _huge_page_bytes(backend)
        assert huge == sum(mapped_pages(_memfd_name(r.path)).huge for r in backend.regions())
        if not policy_grants_advised():
            assert huge == 0, shmem_huge_policy()
        else:
            assert 0 <= huge <= 8 * _MIB
    finally:
        backend.close()


def test_told_not_to_the_regions_do_not_ask_for_huge_pages() -> None:
    backend = _dram(huge_pages="false")
    try:
        for region in backend.regions():
            pages = mapped_pages(_memfd_name(region.path))
            assert pages.mapped == region.size
            assert pages.advised == 0
    finally:
        backend.close()
