"""The data node: a backend's regions, registered with every transport it serves.

It owns memory and nothing else: the index decides what goes where, clients move the bytes.
On one-sided transports the node does nothing per read or write.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

import attrs
import numpy as np

from kvfabric._plugins import PluginManager, PluginOptions, plugin_manager
from kvfabric._runtime.record_scan import scan_records
from kvfabric._runtime.step_log import StepLog
from kvfabric.descriptor import DESCRIPTOR_DTYPE
from kvfabric.errors import NotSupportedError
from kvfabric.spi.backend import Backend, BackendConfig
from kvfabric.spi.index import NodeInfo, RegionInfo
from kvfabric.spi.transport import NodeEndpoint, RegionHandle, TransportConfig, TransportServer
from kvfabric.spi.units import format_size

__all__ = ["DataNode", "NodeScan"]

log = logging.getLogger("kvfabric._node.node")


@attrs.frozen(kw_only=True)
class NodeScan:
    """What a scan of the node's memory found."""

    records: np.ndarray = attrs.field(eq=False, repr=lambda a: f"<{len(a)} records>")
    """One descriptor wire record (:data:`~kvfabric.descriptor.DESCRIPTOR_DTYPE`) per intact
    record; ``node`` and ``rkey`` are 0 until :meth:`addressed` fills them in."""
    torn: int
    """Records dropped because their payload failed its CRC32C (torn or overwritten)."""
    scanned_bytes: int
    seconds: float

    def addressed(self, info: NodeInfo) -> np.ndarray:
        """The records as descriptors of the registration ``info`` (its id, each region's rkey)."""
        records = self.records.copy()
        records["node"] = info.id
        for region in info.regions:
            records["rkey"][records["region"] == region.id] = region.rkey
        return records


class DataNode:
    def __init__(
        self,
        backend: Backend,
        servers: dict[str, TransportServer],
        *,
        name: str | None = None,
    ) -> None:
        self.name = name or uuid.uuid4().hex
        # Random per process: the index tells this run of the node from another process
        # registering under the same name.
        self.instance = secrets.randbits(63) | 1
        self.backend = backend
        self.servers = servers
        self._registered_once = False
        self.handles: dict[str, tuple[RegionHandle, ...]] = {
            transport: tuple(server.register(r) for r in backend.regions())
            for transport, server in servers.items()
        }

    @classmethod
    def create(
        cls,
        *,
        backend: str,
        transports: Sequence[str],
        backend_config: BackendConfig,
        transport_config: TransportConfig,
        name: str | None = None,
        plugins: PluginManager | None = None,
        plugin_options: PluginOptions | None = None,
    ) -> DataNode:
        """Build a node from plugin names, checking capabilities and options first.

        ``plugin_options``: users' ``NAME.OPTION`` settings; each selected plugin takes its
        own, and any left over (a plugin this node does not use) is refused.
        """
        plugins = plugins or plugin_manager()
        settings = plugin_options or PluginOptions()
        backend_cls = plugins.backend(backend)
        transport_classes = {t: plugins.transport(t) for t in transports}
        backend_config = attrs.evolve(backend_config, options=settings.claim(backend_cls))
        transport_configs = {
            t: attrs.evolve(transport_config, options=settings.claim(cls))
            for t, cls in transport_classes.items()
        }
        settings.check_all_claimed("node")
        for tname, tcls in transport_classes.items():
            kinds = tcls.capabilities.memory_kinds
            if backend_cls.memory_kind not in kinds:
                raise NotSupportedError(
                    f"transport {tname!r} cannot register {backend_cls.memory_kind.value} "
                    f"memory (backend {backend!r}); it supports "
                    f"{', '.join(sorted(k.value for k in kinds))}"
                )
            if tcls.capabilities.local_only and not backend_cls.shareable:
                raise NotSupportedError(
                    f"transport {tname!r} maps memory from another process, but backend "
                    f"{backend!r} does not give shareable regions"
                )
        store = backend_cls(backend_config)
        servers: dict[str, TransportServer] = {}
        try:
            for tname, tcls in transport_classes.items():
                servers[tname] = tcls.create_server(transport_configs[tname])
            return cls(store, servers, name=name)
        except BaseException:
            for server in servers.values():
                server.close()
            store.close()
            raise

    def info(self, *, restoring: bool = False) -> NodeInfo:
        """What the index needs to know of this node (``id`` is assigned by the index).

        ``restoring``: the node will report the records it holds (:meth:`scan`) before its
        regions take new grants.
        """
        return NodeInfo(
            name=self.name,
            instance=self.instance,
            regions=tuple(
                RegionInfo(id=r.id, size=r.size, rkey=r.rkey) for r in self.backend.regions()
            ),
            restoring=restoring,
            endpoints=tuple(
                NodeEndpoint(
                    node=0,
                    transport=transport,
                    address=server.address,
                    regions=self.handles[transport],
                )
                for transport, server in self.servers.items()
            ),
        )

    def may_hold_records(self) -> bool:
        """Whether a scan could find anything: after the first registration always, before
        it only if the backend's memory outlives processes (a fresh dram region holds
        nothing, and reading it would commit every page)."""
        return self._registered_once or type(self.backend).persistent

    def mark_registered(self) -> None:
        self._registered_once = True

    def empty_scan(self) -> NodeScan:
        """What a scan of memory known to be fresh finds: nothing."""
        return NodeScan(records=np.zeros(0, DESCRIPTOR_DTYPE), torn=0, scanned_bytes=0, seconds=0.0)

    def scan(self) -> NodeScan:
        """Every intact record in this node's memory, ready to report to the index.

        Vectorised over each region (numpy), with one CRC32C call per record header and
        payload; about a second per few hundred thousand records here.
        """
        started = time.monotonic()
        parts: list[np.ndarray] = []
        torn = 0
        scanned = 0
        regions = self.backend.regions()
        total = sum(r.size for r in regions)
        with StepLog(
            log, f"scanning {format_size(total)} of memory for the records it holds", total=total
        ) as step:
            for region in regions:
                result = scan_records(region.view)
                torn += result.torn
                scanned += region.size
                part = np.zeros(len(result.found), DESCRIPTOR_DTYPE)
                for name in ("key", "offset", "length", "version", "crc"):
                    part[name] = result.found[name]
                part["region"] = region.id
                parts.append(part)
                step.advance(region.size)
        records = np.concatenate(parts) if parts else np.zeros(0, DESCRIPTOR_DTYPE)
        return NodeScan(
            records=records,
            torn=torn,
            scanned_bytes=scanned,
            seconds=time.monotonic() - started,
        )

    def stats(self) -> dict[str, int]:
        """Capacity, how long preparing the memory took at start, how much of it huge pages
        map (where the backend says), and every transport server's counters, prefixed with
        its name."""
        counters = {
            "capacity_bytes": sum(r.size for r in self.backend.regions()),
            "regions": len(self.backend.regions()),
            # Backends that prefault their regions (dram, file) say how long it took; the
            # counters are integers on the wire, hence milliseconds.
            "prefault_ms": round(float(getattr(self.backend, "prefault_seconds", 0.0)) * 1000),
        }
        # Backends on shared memory (dram) say how much of it huge pages map.
        huge_page_bytes = getattr(self.backend, "huge_page_bytes", None)
        if callable(huge_page_bytes):
            counters["huge_page_bytes"] = int(huge_page_bytes())
        for transport, server in self.servers.items():
            for name, value in server.stats().items():
                counters[f"{transport}_{name}"] = value
        return counters

    def close(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.close()
        self.backend.close()
