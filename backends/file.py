"""The ``file`` backend: regions in files under ``--path`` (meant for local NVMe), mapped shared.

Each region is one file, ``region-<id>.kvf``, mapped ``MAP_SHARED`` by the data node. The
``shm`` transport maps the same file from a client on the same host (one-sided); ``tcp`` and
``ucx`` serve the node's mapping. Records are self-describing, so a node restarted with the
same ``--path`` (and ``--name``) rescans its files, keeps every record that validates and
publishes them again; the rest of the space is free.

What survives what:

- **the process dying** (``kill -9``, OOM): everything written, because the bytes are in the
  kernel's page cache, which belongs to the file, not to the process;
- **the machine losing power**: only what reached the disk. With ``file.sync=0`` (the
  default) that is whatever the kernel had written back by itself (pages dirty for longer
  than ``vm.dirty_expire_centisecs``, 30 s by default); with ``file.sync=1s`` the node
  flushes its files every second (``msync``), so at most the last second is lost. Either
  way a record torn by the crash fails its CRC32C when scanned and is dropped, and a torn
  record that was already published reads as a miss: never as a value.

One node owns a directory at a time: the node holds an exclusive lock on
``<path>/kvfabric.lock`` while it runs, and a second node pointed at the same path is
refused at start.

A full disk: at start, before it takes any space, the node checks that the disk has room
for the blocks its files still need, and refuses the start naming both sizes and the path
if not. Then it allocates every block of every file (``fallocate``), with ``file.prefault``
or without, before anything maps them: a store through a mapping — the node's, or an
``shm`` client's in the engine's process — never needs a block the disk may no longer have,
which the kernel would answer with SIGBUS, and a scan never reads past a file's end. A
restarted node does the same to the files it finds (left sparse, or cut short by someone
else); where the disk has no room for that, the start is refused and the files, which may
hold records, are kept. A failed start removes what it created (files, directory) and
nothing else. A file longer than its region (the node restarted with a smaller capacity)
is kept at its length, unused past the region: a client of the previous run may still map
it. Where the filesystem cannot allocate ahead at all, the C library writes a byte into each
block instead (as safe; slow on large files); a filesystem that can do neither is refused
at start. What remains: another process truncating a region file while the node runs (its
mappings then fault on the lost pages: give the directory to the node alone), and
copy-on-write filesystems (btrfs, ZFS), which need new blocks for every overwrite, so a
full disk can still fail a store; the node warns at start on one.

At start (``file.prefault``, on by default) the node also fills its mapping's page tables
for writing, reading into the page cache what is on disk: the first puts then do not trap
per 4 KiB page. Those pages are dirty afterwards, so the kernel writes the files back once.
The time it took is in the node's ready line and its ``prefault_ms``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from kvfabric._runtime.bounds import MAX_DURATION, bounded
from kvfabric._runtime.buffers import prefault_all
from kvfabric._runtime.region_files import RegionFiles, copy_on_write_filesystem, free_bytes
from kvfabric._runtime.regions import region_sizes, release_mappings
from kvfabric._runtime.step_log import StepLog
from kvfabric.errors import ConfigError, PluginUnavailableError
from kvfabric.spi import (
    SLOT_ALIGN,
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
    parse_duration,
)

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

_LOCK_NAME = "kvfabric.lock"


def _region_file(directory: Path, region_id: int) -> Path:
    return directory / f"region-{region_id}.kvf"


class FileBackend(Backend):
    name = "file"
    memory_kind = MemoryKind.FILE
    shareable = True
    persistent = True
    options = (
        OptionSpec(
            name="sync",
            parse=bounded(parse_duration, above=0.0, at_most=MAX_DURATION, zero="off", unit="s"),
            default=0.0,
            help="flush the files to disk this often (0: leave it to the kernel)",
        ),
        OptionSpec(
            name="prefault",
            parse=parse_bool,
            default=True,
            help="map every page at start, so the first puts do not fault (false: pages are "
            "faulted as they are first written; the files' blocks are allocated either way)",
        ),
    )

    @classmethod
    def check_available(cls) -> None:
        if not hasattr(mmap, "MAP_SHARED"):
            raise PluginUnavailableError("the file backend needs shared file mappings (POSIX)")

    def __init__(self, config: BackendConfig) -> None:
        if not config.path:
            raise ConfigError(
                "the file backend needs a directory: --path DIR (path=DIR in an embedded:// "
                "URL), on local NVMe"
            )
        sizes = region_sizes(config.capacity, config.region_size, align=SLOT_ALIGN)
        self.directory = Path(config.path)
        self._sync_interval = float(config.options.get("sync", 0.0))
        prefault = bool(config.options.get("prefault", True))
        self.prefault_seconds = 0.0
        """How long preparing the memory at start took (0 with ``prefault`` off)."""
        self._maps: list[mmap.mmap] = []
        self._regions: list[Region] = []
        self._lock_fd = -1
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        files = RegionFiles(self.directory)
        try:
            files.make_directory()
            if not (self.directory / _LOCK_NAME).exists():
                files.note_created(self.directory / _LOCK_NAME)
            self._lock_fd = _lock(self.directory)
            paths = [_region_file(self.directory, i) for i in range(len(sizes))]
            _check_room(files, paths, sizes)
            _warn_if_copy_on_write(self.directory)
            total = sum(sizes)
            with StepLog(
                log, f"reserving {format_size(total)} of files in {self.directory}", total=total
            ) as step:
                for path, size in zip(paths, sizes, strict=True):
                    self._regions.append(self._open_region(files, path, size))
                    step.advance(size)
            if prefault:
                with StepLog(
                    log,
                    f"preparing {format_size(total)} of mapped files (file.prefault)",
                    total=total,
                ) as step:
                    self.prefault_seconds = prefault_all(
                        [r.view for r in self._regions], progress=step.advance
                    )
                log.debug(
                    "kvfabric file backend: %s at %s prefaulted in %.2f s",
                    format_size(sum(r.size for r in self._regions)),
                    self.directory,
                    self.prefault_seconds,
                )
        except BaseException as exc:
            self._close(undo=files)
            if isinstance(exc, OSError):
                raise ConfigError(f"file backend at {self.directory}: {exc}") from exc
            raise
        if self._sync_interval > 0:
            self._syncer = threading.Thread(
                target=self._sync_loop, name="kvfabric-file-sync", daemon=True
            )
            self._syncer.start()

    def _open_region(self, files: RegionFiles, path: Path, size: int) -> Region:
        # Every block of the file is allocated before anyone maps it, with prefault or
        # without: a page stored through a mapping later never needs a block the disk
        # may no longer have (which would be SIGBUS to the storing process, shm clients
        # included), and a scan never reads past the file's end. What the file holds is kept.
        fd = _reserved(files, path, size)
        try:
            if os.fstat(fd).st_size > size:
                # A node restarted with a smaller capacity: the file is not shrunk, since a
                # client of the previous run may still map its tail (and would fault
                # reading it); records past the region's end are not used.
                log.warning(
                    "kvfabric file backend: %s is longer than its region (%s); the rest is "
                    "kept, unused (remove the files with the node stopped to free it)",
                    path,
                    format_size(size),
                )
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps.append(mapping)
        return Region(
            id=len(self._regions),
            size=size,
            rkey=new_rkey(),
            kind=MemoryKind.FILE,
            view=memoryview(mapping),
            path=str(path),
        )

    def regions(self) -> Sequence[Region]:
        return tuple(self._regions)

    def sync(self) -> None:
        """Flush every region to disk (what ``file.sync`` does periodically)."""
        for mapping in self._maps:
            with contextlib.suppress(ValueError):  # closed meanwhile
                mapping.flush()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self._sync_interval):
            try:
                self.sync()
            except OSError:
                log.exception("kvfabric file backend: flushing %s failed", self.directory)

    def close(self) -> None:
        self._close()

    def _close(self, *, undo: RegionFiles | None = None) -> None:
        """Stop, flush and unmap; ``undo``: a failed start, whose changes to the disk go
        too (before the lock is let go, so no other node sees them half undone)."""
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join(timeout=10)
            self._syncer = None
        # A clean stop leaves the files complete on disk, whatever the sync setting.
        with contextlib.suppress(OSError):
            self.sync()
        release_mappings([region.view for region in self._regions], self._maps)
        self._regions.clear()
        self._maps.clear()
        if undo is not None:
            undo.undo()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _check_room(files: RegionFiles, paths: list[Path], sizes: list[int]) -> None:
    """Refuse, before any space is taken, a capacity the disk has no room for."""
    short = files.shortfall(paths, sizes)
    if short is not None:
        needed, free = short
        earlier = [p.name for p in paths if not files.created(p) and p.exists()]
        kept = (
            f"; {', '.join(earlier)} (records of an earlier run) kept: start again once "
            "there is room"
            if earlier
            else ""
        )
        raise ConfigError(
            f"file backend at {files.directory}: a capacity of {format_size(sum(sizes))} "
            f"needs {format_size(needed)} more disk space, but {files.directory} has "
            f"{format_size(free)} free; give a smaller capacity, or free space there{kept}"
        )


def _reserved(files: RegionFiles, path: Path, size: int) -> int:
    """``files.open``, its failures worded for the user."""
    try:
        return files.open(path, size)
    except OSError as exc:
        where = f"file backend at {files.directory}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = (
                ""
                if files.created(path)
                else f"; {path.name} (records of an earlier run) kept: start again once "
                "there is room"
            )
            raise ConfigError(
                f"{where}: no room to reserve {path.name} ({format_size(size)}); "
                f"{files.directory} has {format_size(free_bytes(files.directory))} free; "
                f"give a smaller capacity, or free space there{kept}"
            ) from None
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise ConfigError(
                f"{where}: this filesystem cannot allocate {path.name}'s blocks ahead "
                f"({exc.strerror}); the file backend needs one that can (ext4, XFS, tmpfs), "
                "so that no write into a mapping can meet a full disk"
            ) from None
        raise


def _warn_if_copy_on_write(directory: Path) -> None:
    kind = copy_on_write_filesystem(directory)
    if kind is not None:
        log.warning(
            "kvfabric file backend: %s is on %s, a copy-on-write filesystem: reserving the "
            "files' blocks does not reserve room to overwrite them, so on a full disk a "
            "store into a region can kill the storing process (SIGBUS); use ext4 or XFS "
            "(on btrfs: chattr +C %s before the node first starts)",
            directory,
            kind,
            directory,
        )


def _lock(directory: Path) -> int:
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{directory} is in use by another kvfabric node (it holds {_LOCK_NAME}); "
            "give each node its own --path"
        ) from None
    return fd


@hookimpl
def kvfabric_register_backends(registry: Registry[Backend]) -> None:
    registry.add(FileBackend.name, FileBackend)
