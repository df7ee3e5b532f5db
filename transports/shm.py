"""The ``shm`` transport: same-host, one-sided, by mapping the node's memory.

The data node's backend gives regions another local process can map (a path such as
``/proc/<pid>/fd/<n>`` for a memfd). The client maps each region once and copies bytes
directly; the node's CPU does nothing per read or write. A batch is one native
``copy_many``: one release of the GIL for every segment, with each record's CRC32C taken in
the same pass (reads: of what landed; writes: of the caller's bytes, before the headers
follow in a second, small call).

A process's first touch of each page of a mapping traps into the kernel, even where the
node has the page already: page tables are per process. So the client populates its mapping
of a region at connect (``shm.prefault``, on by default), but only when the node's memory
is allocated in full (the node prefaulted it): populating a region the node left sparse
would allocate all of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

from kvfabric._runtime.cpus import usable_cpus
from kvfabric._runtime.native import copy_many, prefault
from kvfabric.errors import ConfigError, NotSupportedError, TransportError
from kvfabric.spi import (
    Batch,
    Capabilities,
    MemoryKind,
    NodeEndpoint,
    OptionSpec,
    PeerClient,
    Region,
    RegionHandle,
    Registry,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
    hookimpl,
    parse_bool,
)

__all__ = ["ShmTransport"]

# st_dev, st_ino, offset into the file, then the path: the client checks it mapped the very
# file the node registered, not a same-named one in another mount namespace.
_INFO = struct.Struct("<QQQ")


def host_identity() -> bytes:
    """This kernel's boot id: equal on both sides means "same host"."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename.encode()


class _ShmServer(TransportServer):
    def __init__(self) -> None:
        self._address = host_identity()

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, region: Region) -> RegionHandle:
        if region.path is None:
            raise NotSupportedError(
                f"shm needs a shareable region (a path to map); region {region.id} has none"
            )
        st = os.stat(region.path)
        info = _INFO.pack(st.st_dev, st.st_ino, region.path_offset) + region.path.encode()
        return RegionHandle(region=region.id, rkey=region.rkey, size=region.size, info=info)

    def close(self) -> None:
        pass


class _Mapped:
    """One region, mapped, and a view of it (slicing a cached view is cheaper per segment)."""

    __slots__ = ("mapping", "view")

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self.view = memoryview(mapping)

    def close(self) -> None:
        # A copy in flight on another thread still holds a slice: the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self.view.release()
            self.mapping.close()


# The client's state per node: its regions, mapped, by region id.
_Mappings = dict[int, _Mapped]


class _ShmClient(PeerClient[_Mappings]):
    # OSError: opening or mapping a region. ValueError: a copy from a view that a concurrent
    # disconnect released; either way this node cannot be used now.
    native_errors = {OSError: TransportError, ValueError: TransportError}
    checksums_writes = True

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self._host = host_identity()
        self._prefault = bool(config.options.get("prefault", True))
        # The default is "auto", handed over unparsed: parsed here, where the CPUs are.
        self._threads = parse_copy_threads(config.options.get("copy_threads", "auto"))

    def reachable(self, endpoint: NodeEndpoint) -> bool:
        if endpoint.address != self._host:
            return False
        try:
            for handle in endpoint.regions:
                _open_checked(handle).close()
        except OSError:
            return False
        return True

    def open_peer(self, endpoint: NodeEndpoint) -> _Mappings:
        if endpoint.address != self._host:
            raise TransportError(f"node {endpoint.node} is on another host; shm is local only")
        mapped: _Mappings = {}
        try:
            for handle in endpoint.regions:
                mapped[handle.region] = _map(handle, populate=self._prefault)
        except BaseException:
            self.close_peer(mapped)
            raise
        return mapped

    def close_peer(self, peer: _Mappings) -> None:
        for mapped in peer.values():
            mapped.close()

    def read_segments(self, peer: _Mappings, batch: Batch) -> None:
        pairs = []
        for seg in batch.segments:
            region = peer[seg.region].view
            pairs.append((seg.buffer, region[seg.offset : seg.offset + seg.buffer.nbytes]))
        crcs = copy_many(pairs, batch.crc_spans, threads=self._threads)
        if batch.crc_spans is not None:
            batch.crcs = crcs

    def write_segments(self, peer: _Mappings, batch: Batch) -> None:
        pairs = []
        for seg in batch.segments:
            region = peer[seg.region].view
            pairs.append((region[seg.offset : seg.offset + seg.buffer.nbytes], seg.buffer))
        crcs = copy_many(pairs, batch.crc_spans, crc_of_source=True, threads=self._threads)
        if batch.crc_spans is not None:
            batch.crcs = crcs


def _open_checked(handle: RegionHandle) -> _FileRef:
    dev, ino, offset = _INFO.unpack_from(handle.info)
    path = handle.info[_INFO.size :].decode()
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):
        os.close(fd)
        raise OSError(f"{path} is not the file the node registered")
    # st_blocks counts 512-byte units actually allocated (memfd pages, file extents).
    return _FileRef(fd, offset, allocated=st.st_blocks * 512 >= offset + handle.size)


class _FileRef:
    __slots__ = ("allocated", "fd", "offset")

    def __init__(self, fd: int, offset: int, *, allocated: bool) -> None:
        self.fd = fd
        self.offset = offset
        self.allocated = allocated
        """The region's memory is allocated in full: populating the mapping adds none."""

    def close(self) -> None:
        os.close(self.fd)


def _map(handle: RegionHandle, *, populate: bool) -> _Mapped:
    ref = _open_checked(handle)
    try:
        mapping = mmap.mmap(ref.fd, handle.size, mmap.MAP_SHARED, offset=ref.offset)
    finally:
        ref.close()
    mapped = _Mapped(mapping)
    if populate and ref.allocated:
        try:
            prefault(mapped.view)  # GIL released: other threads run while it populates
        except BaseException:
            mapped.close()
            raise
    return mapped


_COPY_THREADS_MAX = 16
# One copying thread per this many CPUs the process may keep busy, so a large read takes a
# share of a big host's cores and none extra of a small one's.
_CPUS_PER_COPY_THREAD = 4


def parse_copy_threads(text: str | int) -> int:
    """``shm.copy_threads``: ``auto`` or 1 to 16 threads copying one large batch at once.

    ``auto`` is one thread per 4 CPUs this process may keep busy (at most 8): 1 on a host of
    2 or 3, 4 on a host of 16. One core's copy with its CRC is slower than the memory a
    large host reads from; on a small one, more threads take CPU from the engine beside.
    """
    if isinstance(text, str) and text.strip().lower() == "auto":
        return max(1, min(8, usable_cpus() // _CPUS_PER_COPY_THREAD))
    try:
        threads = int(text)
    except ValueError:
        raise ConfigError(f"shm.copy_threads is auto or 1 to 16, not {text!r}") from None
    if not 1 <= threads <= _COPY_THREADS_MAX:
        raise ConfigError(f"shm.copy_threads is auto or 1 to 16, not {text!r}")
    return threads


class ShmTransport(Transport):
    name = "shm"
    # Same host only, and one-sided: the best choice wherever it reaches.
    preference = 30
    options = (
        OptionSpec(
            name="prefault",
            parse=parse_bool,
            default=True,
            help="populate the client's mapping of each region at connect (only where the "
            "node's memory is allocated in full), so the first put does not trap per page",
        ),
        OptionSpec(
            name="copy_threads",
            parse=parse_copy_threads,
            default="auto",
            help="threads that copy one read or write of 32MiB or more at once (1-16); auto is "
            "one per 4 CPUs this process may use, at most 8 (1 on a host of 2 or 3 CPUs)",
        ),
    )
    capabilities = Capabilities(
        one_sided=True,
        local_only=True,
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.FILE}),
    )

    @classmethod
    def create_server(cls, config: TransportConfig) -> TransportServer:
        return _ShmServer()

    @classmethod
    def create_client(cls, config: TransportConfig) -> TransportClient:
        return _ShmClient(config)


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(ShmTransport.name, ShmTransport)
