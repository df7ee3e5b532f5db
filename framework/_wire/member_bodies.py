"""The bodies of node membership (nodes, registrations, heartbeats, restores, departures)
and of the lookup image's location (formats: :mod:`kvfabric._wire.protocol`)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvfabric._runtime.codec import Reader, Writer
from kvfabric._wire.protocol import (
    read_counters,
    read_descriptors,
    write_counters,
    write_descriptors,
)
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ProtocolError
from kvfabric.spi.index import (
    MAX_ENDPOINTS,
    NodeInfo,
)
from kvfabric.spi.transport import NodeEndpoint

__all__ = [
    "ImageLocation",
    "read_deregister",
    "read_heartbeat",
    "read_image_location",
    "read_node_ref",
    "read_nodes",
    "read_restore",
    "write_deregister",
    "write_heartbeat",
    "write_image_location",
    "write_node_ref",
    "write_nodes",
    "write_restore",
]


def write_nodes(nodes: Sequence[NodeInfo]) -> bytes:
    w = Writer().u32(len(nodes))
    for node in nodes:
        node.write_to(w)
    return w.getvalue()


def read_nodes(r: Reader) -> list[NodeInfo]:
    return [NodeInfo.read_from(r) for _ in range(r.count(16, 1 << 16))]


def write_deregister(node: int, incarnation: int) -> bytes:
    return write_node_ref(node, incarnation)


def read_deregister(r: Reader) -> tuple[int, int]:
    """(node id, incarnation) of a ``DEREGISTER_NODE`` request."""
    return read_node_ref(r)


def write_node_ref(node: int, incarnation: int) -> bytes:
    """A registration of a node: its id and the incarnation that registration was given."""
    return Writer().u32(node).u64(incarnation).getvalue()


def read_node_ref(r: Reader) -> tuple[int, int]:
    return r.u32(), r.u64()


def write_heartbeat(node: int, incarnation: int, counters: dict[str, int]) -> bytes:
    return write_node_ref(node, incarnation) + write_counters(counters).getvalue()


def read_heartbeat(r: Reader) -> tuple[int, int, dict[str, int]]:
    node, incarnation = read_node_ref(r)
    return node, incarnation, read_counters(r)


def write_restore(node: int, incarnation: int, records: Sequence[Descriptor]) -> bytes:
    return write_node_ref(node, incarnation) + write_descriptors(records)


def read_restore(r: Reader) -> tuple[int, int, list[Descriptor]]:
    node, incarnation = read_node_ref(r)
    return node, incarnation, read_descriptors(r)


@attrs.frozen(kw_only=True)
class ImageLocation:
    """Where the index's lookup image is (:mod:`kvfabric._runtime.image`), as ``IMAGE`` answers."""

    image_id: int
    size: int
    endpoints: tuple[NodeEndpoint, ...]
    """The image as a region on each transport that serves it (node ``IMAGE_NODE``)."""
    host: bytes = b""
    """The controller's host (its boot id), when a client there may map the image itself."""
    path: str = ""
    """The file to map read-only (``/proc/<pid>/fd/<n>`` of a memfd)."""
    device: int = 0
    inode: int = 0
    """What the opened ``path`` must be: the very file, not one at a same-named path."""
    extents: bool = False
    """Whether the index leases extents (a client reading the image writes through them)."""


def write_image_location(location: ImageLocation | None) -> bytes:
    w = Writer()
    if location is None:
        return w.u8(0).getvalue()
    w.u8(1).u64(location.image_id).u64(location.size)
    w.blob(location.host).text(location.path).u64(location.device).u64(location.inode)
    w.u32(len(location.endpoints))
    for endpoint in location.endpoints:
        endpoint.write_to(w)
    return w.u8(int(location.extents)).getvalue()


def read_image_location(r: Reader) -> ImageLocation | None:
    if not r.u8():
        return None
    image_id, size = r.u64(), r.u64()
    host, path, device, inode = r.blob(256), r.text(4096), r.u64(), r.u64()
    endpoints = tuple(NodeEndpoint.read_from(r) for _ in range(r.count(12, MAX_ENDPOINTS)))
    extents = r.u8()
    if extents > 1:
        raise ProtocolError(f"extents flag {extents}")
    return ImageLocation(
        image_id=image_id,
        size=size,
        endpoints=endpoints,
        host=host,
        path=path,
        device=device,
        inode=inode,
        extents=bool(extents),
    )
