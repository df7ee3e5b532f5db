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

At start (``file.prefault``, on by default) the node allocates each file's blocks
(``fallocate``: a write into the mapping can no longer fail for want of disk space) and
fills its mapping's page tables for writing, reading into the page cache what is on disk:
the first puts then do not trap per 4 KiB page. Those pages are dirty afterwards, so the
kernel writes the files back once. The time it took is in the node's ready line and its
``prefault_ms``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from kvfabric._runtime.buffers import prefault_all
from kvfabric._runtime.regions import region_sizes, release_mappings
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
            parse=parse_duration,
            default=0.0,
            help="flush the files to disk this often (0: leave it to the kernel)",
        ),
        OptionSpec(
            name="prefault",
            parse=parse_bool,
            default=True,
            help="allocate the files' blocks and map every page at start, so the first puts "
            "do not fault (false: pages are faulted as they are first written)",
        ),
    )

    @classmethod
    def check_available(cls) -> None:
        if not hasattr(mmap, "MAP_SHARED"):
            raise PluginUnavailableError("the file backend needs shared file mappings (POSIX)")

    def __init__(self, config: BackendConfig) -> None:
        if not config.path:
            raise ConfigError("the file backend needs a directory: --path DIR (on local NVMe)")
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
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.directory)
            for size in sizes:
                self._regions.append(self._open_region(len(self._regions), size, prefault))
            if prefault:
                self.prefault_seconds = prefault_all([r.view for r in self._regions])
                log.debug(
                    "kvfabric file backend: %s at %s prefaulted in %.2f s",
                    format_size(sum(r.size for r in self._regions)),
                    self.directory,
                    self.prefault_seconds,
                )
        except OSError as exc:
            self.close()
            raise ConfigError(f"file backend at {self.directory}: {exc}") from exc
        except BaseException:
            self.close()
            raise
        if self._sync_interval > 0:
            self._syncer = threading.Thread(
                target=self._sync_loop, name="kvfabric-file-sync", daemon=True
            )
            self._syncer.start()

    def _open_region(self, region_id: int, size: int, allocate: bool) -> Region:
        path = _region_file(self.directory, region_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                # A node restarted with another capacity: records past the new end are lost
                # (the rescan finds the rest); new space reads as zeros, holding no record.
                os.ftruncate(fd, size)
            if allocate:
                # Blocks for the whole file now: a page written through the mapping later
                # never fails (SIGBUS) for want of space. Keeps what the file holds.
                os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._maps.append(mapping)
        return Region(
            id=region_id,
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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


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
