"""Where the controller serves its index's lookup image, and keeping that true.

The index makes the image (:mod:`kvfabric._runtime.image`); this registers it read-only
with each image server (a transport server, or one in a process of the controller's own),
says where it is (the ``IMAGE`` reply) and starts again a server process that died, so
clients that read its old address fall back to the control RPC and ask where it went.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import attrs

from kvfabric._control.image_process import ImageProcessServer
from kvfabric._runtime.image import IMAGE_NODE, ImageGeometry, host_identity
from kvfabric._wire import member_bodies as mb
from kvfabric.errors import KvfabricError
from kvfabric.spi.backend import Region
from kvfabric.spi.index import IndexPlugin
from kvfabric.spi.transport import NodeEndpoint, RegionHandle, TransportServer

__all__ = ["ImagePublisher"]

log = logging.getLogger("kvfabric._control.controller")


class ImagePublisher:
    """The lookup image's servers and location; ``location`` is None when none is served."""

    def __init__(self, index: IndexPlugin, servers: Mapping[str, TransportServer]) -> None:
        self._index = index
        self._servers = dict(servers)
        self._handles: dict[str, RegionHandle] = {}
        self._region: Region | None = None
        self.location: mb.ImageLocation | None = None
        self.restarts = 0

    def publish(self) -> mb.ImageLocation | None:
        """Register the index's lookup image with the image servers; where it is, or None."""
        if not self._servers:
            return None
        region = self._index.lookup_image()
        if region is None:
            log.info("index %s keeps no lookup image: lookups go by RPC", self._index.name)
            return None
        # Registered read-only: a server that checks writes against its memory (tcp, in
        # ``serve`` the node's own) refuses any sent to the image.
        exposed = attrs.evolve(region, view=region.view.toreadonly())
        for name, server in self._servers.items():
            try:
                self._handles[name] = server.register(exposed)
            except KvfabricError as exc:
                log.warning("the %s transport cannot serve the lookup image: %s", name, exc)
        self._region = region
        self.location = self._location_now()
        return self.location

    def revive(self) -> None:
        """Start again an image server whose process died, and say where it is now."""
        if self.location is None:
            return
        moved = False
        for name in self._handles:
            server = self._servers[name]
            if isinstance(server, ImageProcessServer) and server.revive():
                self.restarts += 1
                moved = True
        if moved:
            self.location = self._location_now()

    def server_stats(self) -> dict[str, int]:
        """The work the image's servers did, as ``image_<transport>_<counter>``."""
        if self.location is None:
            return {}
        return {
            f"image_{name}_{counter}": value
            for name in self._handles
            for counter, value in self._servers[name].stats().items()
        }

    def _location_now(self) -> mb.ImageLocation:
        """Where the image is served now (a server in a process of its own may have moved)."""
        region = self._region
        assert region is not None
        endpoints = [
            NodeEndpoint(
                node=IMAGE_NODE,
                transport=name,
                address=self._servers[name].address,
                regions=(handle,),
            )
            for name, handle in self._handles.items()
        ]
        local = "shm" in self._servers and region.path is not None
        st = os.stat(region.path) if local and region.path else None
        geometry = ImageGeometry.from_header(region.view)
        # An index that prepares the image's memory at start says how long it took.
        prepared_ms = self._index.stats().get("image_prefault_ms")
        log.info(
            "lookup image: %d buckets (%d bytes%s) over %s",
            geometry.buckets,
            region.size,
            "" if prepared_ms is None else f", memory prepared in {prepared_ms / 1000:.2f}s",
            ", ".join(f"{e.transport} at {e.address.decode(errors='replace')}" for e in endpoints)
            or "nothing",
        )
        return mb.ImageLocation(
            image_id=geometry.image_id,
            size=region.size,
            endpoints=tuple(endpoints),
            host=host_identity() if st else b"",
            path=region.path if st and region.path else "",
            device=st.st_dev if st else 0,
            inode=st.st_ino if st else 0,
            extents=self._index.leases_extents(),
        )
