"""Huge pages for shared-memory regions: asking for them, and seeing whether they came.

A region mapped with 4 KiB pages needs 2 MiB of page tables per GiB in every process that
maps it, and a TLB miss per 4 KiB read; with 2 MiB pages, 4 KiB of page tables per GiB.
Shared memory (memfd, tmpfs) gets 2 MiB pages only where the kernel's policy for it allows:
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` set to ``advise`` (pages for mappings
that ask with ``madvise(MADV_HUGEPAGE)``, as the ``dram`` backend's regions do with
``dram.huge_pages=true``), ``within_size`` or ``always``. Many distributions ship
``never``: then asking changes nothing, and the host's operator decides
(``docs/architecture.md``, "Huge pages are the host's choice").

A client that maps the same memfd (``shm``) is given the node's 2 MiB pages as they are; it
needs to ask for nothing.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import attrs

__all__ = [
    "SHMEM_POLICY",
    "MappedPages",
    "advise_huge_pages",
    "mapped_pages",
    "parse_smaps",
    "policy_grants_advised",
    "shmem_huge_policy",
]

SHMEM_POLICY = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
"""The kernel's policy for huge pages in shared memory; the word in brackets is in force."""

_GRANTING = frozenset({"advise", "within_size", "always", "force"})


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask the kernel to back ``mapping`` with huge pages (before its pages are touched);
    False where the platform or the kernel has no such advice. Asking is not getting: see
    :func:`shmem_huge_policy` and :func:`mapped_pages`."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # EINVAL: a kernel built without transparent huge pages
        return False
    return True


def shmem_huge_policy() -> str | None:
    """The policy in force for shared memory (``never``, ``advise``, ...); None where the
    kernel does not say (not Linux, no transparent huge pages)."""
    with contextlib.suppress(OSError):
        for word in SHMEM_POLICY.read_text().split():
            if word.startswith("[") and word.endswith("]"):
                return word[1:-1]
    return None


def policy_grants_advised() -> bool:
    """Whether a mapping that asks (:func:`advise_huge_pages`) may get huge pages."""
    return shmem_huge_policy() in _GRANTING


@attrs.frozen
class MappedPages:
    """What this process maps of some files: bytes in all, on huge pages, and advised."""

    mapped: int = 0
    huge: int = 0
    advised: int = 0


def parse_smaps(text: str, name: str) -> MappedPages:
    """Sum ``/proc/<pid>/smaps`` over the mappings whose path contains ``name``: their size,
    what huge pages map of it (``ShmemPmdMapped``, ``FilePmdMapped``, ``AnonHugePages``), and
    the size of those advised (``hg`` among their ``VmFlags``)."""
    mapped = huge = advised = 0
    size = 0
    inside = False
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end ...
            fields = line.split(None, 5)
            inside = len(fields) == 6 and name in fields[5]
            if inside:
                start, end = (int(part, 16) for part in head.split("-"))
                size = end - start
                mapped += size
            continue
        if not inside:
            continue
        if head in ("ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:"):
            huge += int(rest.split()[0]) * 1024
        elif head == "VmFlags:" and "hg" in rest.split():
            advised += size
    return MappedPages(mapped=mapped, huge=huge, advised=advised)


def mapped_pages(name: str) -> MappedPages:
    """:func:`parse_smaps` of this process (empty where ``/proc`` has no smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return MappedPages()
    return parse_smaps(text, name)
