"""The ``shm`` transport: same-host, one-sided, by mapping the node's memory.

The data node's backend gives regions another local process can map (a path such as
``/proc/<pid>/fd/<n>`` for a memfd). The client maps each region once and copies bytes
directly; the node's CPU does nothing per read or write. Copies of 64 KiB and more go through
``ctypes.memmove`` so the GIL is released while they run.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Sequence

from kvfabric.errors import NotSupportedError, TransportError
from kvfabric.spi import (
    Capabilities,
    MemoryKind,
    NodeEndpoint,
    Region,
    RegionHandle,
    Registry,
    Segment,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
    check_segment_bounds,
    copy_into,
    hookimpl,
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
    __slots__ = ("handle", "mapping", "view")

    def __init__(self, handle: RegionHandle, mapping: mmap.mmap, view: memoryview) -> None:
        self.handle = handle
        self.mapping = mapping
        self.view = view


class _ShmClient(TransportClient):
    def __init__(self) -> None:
        self._host = host_identity()
        self._nodes: dict[int, dict[int, _Mapped]] = {}
        self._lock = threading.Lock()

    def reachable(self, endpoint: NodeEndpoint) -> bool:
        if endpoint.address != self._host:
            return False
        try:
            for handle in endpoint.regions:
                _open_checked(handle).close()
        except OSError:
            return False
        return True

    def connect(self, endpoint: NodeEndpoint) -> None:
        if endpoint.address != self._host:
            raise TransportError(f"node {endpoint.node} is on another host; shm is local only")
        mapped: dict[int, _Mapped] = {}
        try:
            for handle in endpoint.regions:
                mapped[handle.region] = _map(handle)
        except OSError as exc:
            for m in mapped.values():
                _unmap(m)
            raise TransportError(f"cannot map node {endpoint.node}'s memory: {exc}") from exc
        with self._lock:
            old = self._nodes.pop(endpoint.node, None)
            self._nodes[endpoint.node] = mapped
        for m in (old or {}).values():
            _unmap(m)

    def _regions(self, node: int) -> dict[int, _Mapped]:
        with self._lock:
            regions = self._nodes.get(node)
        if regions is None:
            raise TransportError(f"not connected to node {node}")
        return regions

    def read(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        return self._copy(node, segments, into_region=False)

    def write(self, node: int, segments: Sequence[Segment]) -> list[TransportError | None]:
        return self._copy(node, segments, into_region=True)

    def _copy(
        self, node: int, segments: Sequence[Segment], *, into_region: bool
    ) -> list[TransportError | None]:
        regions = self._regions(node)
        errors: list[TransportError | None] = []
        for seg in segments:
            mapped = regions.get(seg.region)
            if mapped is None:
                errors.append(TransportError(f"node {node} has no region {seg.region}"))
                continue
            error = check_segment_bounds(seg, mapped.handle)
            if error is None:
                remote = mapped.view[seg.offset : seg.offset + seg.buffer.nbytes]
                if into_region:
                    copy_into(remote, seg.buffer)
                else:
                    copy_into(seg.buffer, remote)
            errors.append(error)
        return errors

    def disconnect(self, node: int) -> None:
        with self._lock:
            regions = self._nodes.pop(node, {})
        for m in regions.values():
            _unmap(m)

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes)
        for node in nodes:
            self.disconnect(node)


def _open_checked(handle: RegionHandle) -> _FileRef:
    dev, ino, offset = _INFO.unpack_from(handle.info)
    path = handle.info[_INFO.size :].decode()
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino):
        os.close(fd)
        raise OSError(f"{path} is not the file the node registered")
    return _FileRef(fd, offset)


class _FileRef:
    __slots__ = ("fd", "offset")

    def __init__(self, fd: int, offset: int) -> None:
        self.fd = fd
        self.offset = offset

    def close(self) -> None:
        os.close(self.fd)


def _map(handle: RegionHandle) -> _Mapped:
    ref = _open_checked(handle)
    try:
        mapping = mmap.mmap(ref.fd, handle.size, mmap.MAP_SHARED, offset=ref.offset)
    finally:
        ref.close()
    return _Mapped(handle, mapping, memoryview(mapping))


def _unmap(mapped: _Mapped) -> None:
    # A read in flight on another thread still holds a slice: the GC unmaps it later.
    try:
        mapped.view.release()
        mapped.mapping.close()
    except BufferError:
        pass


class ShmTransport(Transport):
    name = "shm"
    # Same host only, and one-sided: the best choice wherever it reaches.
    preference = 30
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
        return _ShmClient()


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(ShmTransport.name, ShmTransport)
