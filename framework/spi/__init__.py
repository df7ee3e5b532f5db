"""The plug-in contract: what a transport, backend or index implements and what it is handed.

A plug-in imports this module and the public API (``kvfabric.errors``, ``kvfabric.keys``,
``kvfabric.descriptor``) and nothing else. Every name here is documented in the guides
(``docs/writing-a-transport.md``, ``docs/writing-a-backend.md``,
``docs/writing-an-index.md``); what is not here (the native data path, the lookup image,
the record codec) is kvfabric's own machinery, which built-in plug-ins share and third-party
ones never need.

- Registration: ``hookimpl`` marks a module's ``kvfabric_register_transports`` (or
  ``_backends``, ``_indexes``) hook, which receives a ``Registry``.
- Every plug-in class: ``Plugin`` (its name, ``OptionSpec`` options, availability), with
  ``parse_bool``, ``parse_size``, ``parse_duration`` and ``format_size`` for options.
- Transports: ``Transport`` with ``Capabilities``, a ``TransportServer`` that registers a
  ``Region`` as a ``RegionHandle`` and a ``TransportClient`` that moves ``Segment`` lists
  to and from a ``NodeEndpoint``; ``PeerClient`` is a client base that keeps the peer table
  and checks segments (``plan_batch``, ``Batch``), ``RegionTable`` the server's check
  (``SegmentStatus``), ``map_exceptions`` the error boundary.
- Backends: ``Backend`` gives ``Region`` objects of a ``MemoryKind`` (``new_rkey``).
- Indexes: ``IndexPlugin`` (an ``Index``) and the values that cross it; ``IndexEvents``,
  what an index that reports KV events tells of its entries, and ``EngineBlock``, what a
  writer says of a key in the engine's own terms.
- Records: ``HEADER_SIZE``, ``SLOT_ALIGN`` and ``record_size`` (how many bytes a value
  occupies in a slot); ``Counters`` for ``stats()``; ``byte_view`` for any buffer.
"""

from __future__ import annotations

from kvfabric._runtime.buffers import byte_view
from kvfabric.spi.backend import Backend, BackendConfig, MemoryKind, Region, new_rkey
from kvfabric.spi.boundary import SOCKET_ERRORS, ExceptionMapping, map_exceptions
from kvfabric.spi.counters import Counters
from kvfabric.spi.events import EngineBlock, IndexEvents
from kvfabric.spi.hooks import hookimpl
from kvfabric.spi.index import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
    Index,
    IndexConfig,
    IndexPlugin,
    NodeInfo,
    RegionInfo,
)
from kvfabric.spi.options import OptionSpec, Plugin, parse_bool
from kvfabric.spi.peers import PeerClient
from kvfabric.spi.record import HEADER_SIZE, SLOT_ALIGN, record_size
from kvfabric.spi.registry import Registry
from kvfabric.spi.segments import Batch, RegionTable, SegmentStatus, plan_batch
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
    "HEADER_SIZE",
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
    "CarveOutcome",
    "CarvedRecord",
    "Copies",
    "Counters",
    "EngineBlock",
    "ExceptionMapping",
    "Extent",
    "GrantRef",
    "Index",
    "IndexConfig",
    "IndexEvents",
    "IndexPlugin",
    "MemoryKind",
    "NodeEndpoint",
    "NodeInfo",
    "OptionSpec",
    "PeerClient",
    "Plugin",
    "Region",
    "RegionHandle",
    "RegionInfo",
    "RegionTable",
    "Registry",
    "Segment",
    "SegmentStatus",
    "Transport",
    "TransportClient",
    "TransportConfig",
    "TransportServer",
    "byte_view",
    "format_size",
    "hookimpl",
    "map_exceptions",
    "new_rkey",
    "parse_bool",
    "parse_duration",
    "parse_size",
    "plan_batch",
    "record_size",
]
