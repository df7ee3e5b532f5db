"""The plugin interface: the one module transports, backends and indexes import.

A plugin imports ``kvfabric.spi`` (and the public ``kvfabric`` API: errors, keys,
descriptor) and nothing else; ruff enforces this for the built-in plugins. Here are the hook
specifications and registries, the ``Transport``, ``Backend`` and ``Index`` base classes,
the values that cross them, and the helpers a plugin needs (buffers, counters, wire codec,
record format, slot allocator, sizes and durations, region prefaulting; and from
``kvfabric.spi.native`` the batch CRC32C, copies, socket loops and prefaulting that take the
GIL back once per batch). A transport's
client subclasses ``PeerClient`` and writes only its primitives: the peer table, the
segment checks (``plan_batch``; ``RegionTable`` on a server) and the error boundary
(``map_exceptions``) are here, once.
"""

from __future__ import annotations

from kvfabric.spi.backend import Backend, BackendConfig, MemoryKind, Region, new_rkey
from kvfabric.spi.boundary import SOCKET_ERRORS, ExceptionMapping, map_exceptions
from kvfabric.spi.buffers import (
    GIL_FREE_COPY_MIN,
    address_of,
    byte_view,
    copy_into,
    prefault_all,
    writable_view,
)
from kvfabric.spi.codec import Reader, Writer
from kvfabric.spi.counters import CLIENT_COUNTERS, Counters
from kvfabric.spi.hooks import hookimpl, hookspec
from kvfabric.spi.image import (
    IMAGE_NODE,
    IMAGE_REGION,
    ImageGeometry,
    ImageStop,
    image_beat,
    image_store,
)
from kvfabric.spi.index import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    Copies,
    GrantRef,
    Index,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
    alternate_key,
)
from kvfabric.spi.native import (
    GIL_RELEASE_MIN,
    IOV_MAX,
    Mutex,
    PeerClosed,
    copy_many,
    crc32c_many,
    gil_reacquisitions,
    prefault,
    recv_into_all,
    request_reply,
    send_all,
    send_checksummed,
    ucp_post,
    ucp_wait,
)
from kvfabric.spi.options import (
    OptionSpec,
    Plugin,
    PluginOptions,
    group_plugin_options,
    parse_bool,
    parse_plugin_options,
)
from kvfabric.spi.peers import PeerClient
from kvfabric.spi.plugins import (
    GROUPS,
    InstalledPlugin,
    PluginManager,
    Registry,
    installed_plugins,
    plugin_manager,
)
from kvfabric.spi.record import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    SLOT_ALIGN,
    Failure,
    RecordHeader,
    checksum,
    checksum_pieces,
    pack_header,
    parse_header,
    record_size,
    validate_record,
)
from kvfabric.spi.record_scan import FoundRecord, ScanResult, scan_records
from kvfabric.spi.segments import Batch, RegionTable, SegmentStatus, plan_batch, segment_status
from kvfabric.spi.slots import SlotAllocator
from kvfabric.spi.transport import (
    Capabilities,
    NodeEndpoint,
    RegionHandle,
    Segment,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
)
from kvfabric.spi.units import format_size, parse_duration, parse_size

__all__ = [
    "CLIENT_COUNTERS",
    "FORMAT_VERSION",
    "GIL_FREE_COPY_MIN",
    "GIL_RELEASE_MIN",
    "GROUPS",
    "HEADER_SIZE",
    "IMAGE_NODE",
    "IMAGE_REGION",
    "IOV_MAX",
    "MAGIC",
    "SLOT_ALIGN",
    "SOCKET_ERRORS",
    "AllocateResult",
    "Allocation",
    "AllocationKind",
    "AllocationRequest",
    "Backend",
    "BackendConfig",
    "Batch",
    "Capabilities",
    "Copies",
    "Counters",
    "ExceptionMapping",
    "Failure",
    "FoundRecord",
    "GrantRef",
    "ImageGeometry",
    "ImageStop",
    "Index",
    "IndexConfig",
    "IndexPlugin",
    "InstalledPlugin",
    "MemoryKind",
    "Mutex",
    "NodeEndpoint",
    "NodeInfo",
    "OptionSpec",
    "PeerClient",
    "PeerClosed",
    "Plugin",
    "PluginManager",
    "PluginOptions",
    "Reader",
    "RecordHeader",
    "Region",
    "RegionHandle",
    "RegionInfo",
    "RegionTable",
    "Registry",
    "ScanResult",
    "Segment",
    "SegmentStatus",
    "SlotAllocator",
    "Transport",
    "TransportClient",
    "TransportConfig",
    "TransportServer",
    "Writer",
    "address_of",
    "alternate_key",
    "byte_view",
    "checksum",
    "checksum_pieces",
    "copy_into",
    "copy_many",
    "crc32c_many",
    "format_size",
    "gil_reacquisitions",
    "group_plugin_options",
    "hookimpl",
    "hookspec",
    "image_beat",
    "image_store",
    "installed_plugins",
    "map_exceptions",
    "new_rkey",
    "pack_header",
    "parse_bool",
    "parse_duration",
    "parse_header",
    "parse_plugin_options",
    "parse_size",
    "plan_batch",
    "plugin_manager",
    "prefault",
    "prefault_all",
    "record_size",
    "recv_into_all",
    "request_reply",
    "scan_records",
    "segment_status",
    "send_all",
    "send_checksummed",
    "ucp_post",
    "ucp_wait",
    "validate_record",
    "writable_view",
]
