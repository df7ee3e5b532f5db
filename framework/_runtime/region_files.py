"""Region files on a local disk: space checked before any is taken, every block reserved
before anyone maps a file, and what a failed start made removed again (the ``file``
backend's; it words the errors).

A region file is mapped shared, by its data node and by every ``shm`` client on the host.
A store through such a mapping into a page the filesystem holds no block for allocates one
there and then; on a full disk the kernel's only answer is SIGBUS, to whichever process
stored — the engine included — and a scan that reads pages of a file cut short faults the
same way. So :class:`RegionFiles` allocates every byte of each file before it is mapped
(``posix_fallocate``: blocks reserved, reading as zeros, no data written; where the
filesystem cannot, the C library writes a byte into each block, which allocates it just
the same), whether the file is new, was left sparse, or was cut short by someone else; and
before it takes any, it tells whether the disk has the room at all.

A start that fails leaves the disk as it found it: the files and directories it created
are removed, and files that existed (they may hold records) are kept, shrunk back to the
size they had if it grew them. A file longer than its region (the node restarted with a
smaller capacity) is never shrunk: a client of the node's previous run may still map its
tail, and would fault reading it.

What reserving cannot cover: another process truncating or punching a hole in a region
file while the node runs (a mapping of the lost pages faults; give the directory to the
node alone), and copy-on-write filesystems (btrfs, ZFS, bcachefs), which need a fresh
block for every overwrite, so a full disk can still fail a store into a reserved page
(:func:`copy_on_write_filesystem` tells them, so the backend can warn).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "COPY_ON_WRITE",
    "RegionFiles",
    "copy_on_write_filesystem",
    "free_bytes",
    "unallocated_bytes",
]

COPY_ON_WRITE = frozenset({"btrfs", "zfs", "bcachefs"})
"""Filesystems that write every change to a new block: reserving a file's blocks does not
reserve room for overwriting them."""


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still allocate on ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def unallocated_bytes(path: Path, size: int) -> int:
    """About how many of the first ``size`` bytes of ``path`` hold no block yet (all of
    them for a file that does not exist). An estimate from the blocks the file holds —
    reserving is what decides."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return size
    return max(0, size - st.st_blocks * 512)


def copy_on_write_filesystem(directory: Path) -> str | None:
    """The type of ``directory``'s filesystem if it is copy-on-write (``btrfs``...), else
    None (also where it cannot be told)."""
    try:
        target = os.path.realpath(directory)
        best, kind = "", ""
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind if kind in COPY_ON_WRITE else None


class RegionFiles:
    """The region files one start of a node opens under ``directory``, and undoing what
    that start did to the disk if it fails."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made: list[Path] = []
        """Directories and files this start created, in creation order."""
        self._grown: dict[Path, int] = {}
        """Files that existed and that this start made longer: their size before."""

    def make_directory(self) -> None:
        """Create the directory (and its missing parents), remembering which were new."""
        missing: list[Path] = []
        at = self.directory
        while not at.exists():
            missing.append(at)
            if at.parent == at:
                break
            at = at.parent
        self.directory.mkdir(parents=True, exist_ok=True)
        self._made += reversed(missing)

    def note_created(self, path: Path) -> None:
        """``path`` was created by this start (so a failed start removes it)."""
        self._made.append(path)

    def shortfall(self, paths: Sequence[Path], sizes: Sequence[int]) -> tuple[int, int] | None:
        """``(needed, free)`` bytes when the disk lacks room for the blocks the files still
        need (checked before any is taken), else None."""
        needed = sum(unallocated_bytes(p, s) for p, s in zip(paths, sizes, strict=True))
        if needed == 0:
            return None
        free = free_bytes(self.directory)
        return (needed, free) if needed > free else None

    def created(self, path: Path) -> bool:
        """Whether this start created ``path`` (else it held what an earlier run left)."""
        return path in self._made

    def open(self, path: Path, size: int) -> int:
        """A read-write descriptor of ``path`` with every one of its first ``size`` bytes
        allocated on disk; created if missing. The ``OSError`` of the allocation where the
        disk cannot give them (ENOSPC; EOPNOTSUPP where the filesystem cannot allocate
        ahead at all); what this start created is recorded either way, for :meth:`undo`."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._made.append(path)
        try:
            length = os.fstat(fd).st_size
            if length < size and path not in self._made:
                self._grown[path] = length
            # Extends a shorter file to ``size``; a longer one keeps its length.
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def undo(self) -> None:
        """Remove what this start created and shrink back what it grew (best effort)."""
        for path, length in self._grown.items():
            with contextlib.suppress(OSError):
                os.truncate(path, length)
        for path in reversed(self._made):
            with contextlib.suppress(OSError):
                if path.is_dir():
                    path.rmdir()  # only if empty: never anything this start did not make
                else:
                    path.unlink()
        self._made.clear()
        self._grown.clear()
