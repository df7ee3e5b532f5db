"""The controller: the index behind a ZeroMQ ROUTER socket.

It owns the index and the slot maps of every data node, never payload bytes. Each request
is decoded, served from the in-memory index (microseconds per key, so inline in the loop),
and answered; any frame it cannot serve gets an ERROR reply (its code taken from the error,
never from the message) and the loop goes on. Data nodes register and heartbeat; a node that
deregisters (it is stopping) is dropped with all its entries at once, and a node silent for
``node_timeout`` the same way.

Given transport servers for it (``kvfabric controller --transport tcp,shm``; ``serve`` lends
its node's), the controller asks its index for a lookup image (:mod:`kvfabric._runtime.image`),
registers it with each server like a region and tells clients where it is (``IMAGE``):
clients then answer lookups by reading it one-sided, and the controller does nothing per
such lookup. The index restamps the image's heartbeat at every tick of the loop, so a
client mapping it on this host stops trusting it once the controller stops.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import zmq

from kvfabric._control.image_process import ImageProcessServer
from kvfabric._control.security import Credentials
from kvfabric._runtime.codec import Reader, Writer
from kvfabric._runtime.image import IMAGE_NODE, ImageGeometry, host_identity
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import REPLY_BIT, ErrorCode, MsgType
from kvfabric.errors import KvfabricError, ProtocolError
from kvfabric.spi.backend import Region
from kvfabric.spi.index import IndexPlugin, NodeInfo
from kvfabric.spi.transport import NodeEndpoint, RegionHandle, TransportServer

__all__ = ["Controller"]

log = logging.getLogger("kvfabric._control.controller")

UPKEEP_LOG_INTERVAL = 60.0
"""Seconds between log records of one failing upkeep step of the index's (each failure is
counted as ``upkeep_errors``)."""

# Requests that serve clients' lookups and writes: what "control RPCs" counts.
_CLIENT_TYPES = frozenset(
    {
        MsgType.NODES,
        MsgType.LOOKUP_PREFIX,
        MsgType.RESOLVE,
        MsgType.EXISTS,
        MsgType.ALLOCATE,
        MsgType.PUBLISH,
        MsgType.ABORT,
        MsgType.UNPUBLISH,
        MsgType.IMAGE,
        MsgType.LEASE_EXTENTS,
        MsgType.PUBLISH_CARVED,
    }
)


class _Refusal(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Controller:
    def __init__(
        self,
        *,
        listen: str,
        index: IndexPlugin,
        node_timeout: float = 3.0,
        tick: float = 0.25,
        credentials: Credentials | None = None,
        image_servers: Mapping[str, TransportServer] | None = None,
        freeze_long_lived: bool = False,
    ) -> None:
        """``image_servers``: transport servers (by name) to serve the index's lookup image
        on; none: clients look everything up by RPC. ``freeze_long_lived``: every tick,
        exempt what outlived the young generations from later full collections (for a
        process of the controller's own; see :meth:`_freeze_gc`)."""
        self.listen = listen
        self.index = index
        self.node_timeout = node_timeout
        self.tick = tick
        self.epoch = secrets.randbits(63) | 1
        self.endpoint = ""
        self._credentials = credentials
        self._last_seen: dict[int, float] = {}
        # Grows whenever a node registers or leaves; every reply carries it, so clients
        # relearn the nodes (a new incarnation, a replaced node) within one round trip.
        self._membership = 0
        self._node_stats: dict[int, dict[str, int]] = {}
        self._counters: Counter[str] = Counter()
        self._upkeep_logged: dict[str, float] = {}
        """Upkeep step -> when a failure of it may be logged again."""
        self._stopping = threading.Event()
        self._image_servers = dict(image_servers or {})
        self._image_handles: dict[str, RegionHandle] = {}
        self._image_region: Region | None = None
        self.image: p.ImageLocation | None = None
        self._freeze_long_lived = freeze_long_lived
        # A handler decodes the request and returns what applying it does: the frame is
        # checked whole (no trailing bytes) between the two, so a frame refused for any
        # reason has no effect.
        self._handlers: dict[int, Callable[[Reader], Callable[[], bytes]]] = {
            MsgType.NODES: self._nodes,
            MsgType.LOOKUP_PREFIX: self._lookup_prefix,
            MsgType.RESOLVE: self._resolve,
            MsgType.EXISTS: self._exists,
            MsgType.ALLOCATE: self._allocate,
            MsgType.PUBLISH: self._publish,
            MsgType.ABORT: self._abort,
            MsgType.UNPUBLISH: self._unpublish,
            MsgType.STATS: self._stats,
            MsgType.REGISTER_NODE: self._register_node,
            MsgType.HEARTBEAT: self._heartbeat,
            MsgType.DEREGISTER_NODE: self._deregister_node,
            MsgType.RESTORE: self._restore,
            MsgType.RESTORE_DONE: self._restore_done,
            MsgType.REPORT_INVALID: self._report_invalid,
            MsgType.IMAGE: self._image_location,
            MsgType.TOUCH: self._touch,
            MsgType.LEASE_EXTENTS: self._lease_extents,
            MsgType.PUBLISH_CARVED: self._publish_carved,
        }

    # -- serving ---------------------------------------------------------------------------

    def serve(self, ready: Callable[[str], None] | None = None) -> None:
        """Serve until :meth:`stop` is called (from any thread or a signal handler)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        authenticator = None
        sock = context.socket(zmq.ROUTER)
        sock.linger = 0
        try:
            if self._credentials is not None:
                authenticator = self._start_authenticator(context)
                self._credentials.secure_server(sock)
            sock.bind(self.listen)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.image = self._publish_image()
            log.info("controller listening on %s (epoch %x)", self.endpoint, self.epoch)
            if ready is not None:
                ready(self.endpoint)
            self._loop(sock)
        finally:
            sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            context.term()

    def _loop(self, sock: zmq.Socket[bytes]) -> None:
        # A plain poll loop, not asyncio: an asyncio ROUTER adds its own scheduling to every
        # round trip, and lookups are the hot path.
        next_tick = time.monotonic() + self.tick
        while not self._stopping.is_set():
            timeout = max(0, int((next_tick - time.monotonic()) * 1000))
            # Drain what is queued without raising zmq.Again (an exception costs more than
            # a flags check), then poll again.
            if sock.poll(timeout, zmq.POLLIN):
                while int(sock.getsockopt(zmq.EVENTS)) & _POLLIN:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    reply = self._reply_to(frames)
                    if reply is not None:
                        sock.send_multipart([frames[0], reply])
                # Every request answered: upkeep the replies need not wait for (a full
                # store's eviction ahead of need, while the writer that leased writes).
                self._upkeep(self.index.idle, "idle")
            if time.monotonic() >= next_tick:
                self._maintain()
                next_tick = time.monotonic() + self.tick

    def _publish_image(self) -> p.ImageLocation | None:
        """Register the index's lookup image with the image servers; where it is, or None."""
        if not self._image_servers:
            return None
        region = self.index.lookup_image()
        if region is None:
            log.info("index %s keeps no lookup image: lookups go by RPC", self.index.name)
            return None
        # Registered read-only: a server that checks writes against its memory (tcp, in
        # ``serve`` the node's own) refuses any sent to the image.
        exposed = attrs.evolve(region, view=region.view.toreadonly())
        for name, server in self._image_servers.items():
            try:
                self._image_handles[name] = server.register(exposed)
            except KvfabricError as exc:
                log.warning("the %s transport cannot serve the lookup image: %s", name, exc)
        self._image_region = region
        return self._image_location_now()

    def _image_location_now(self) -> p.ImageLocation:
        """Where the image is served now (a server in a process of its own may have moved)."""
        region = self._image_region
        assert region is not None
        endpoints = [
            NodeEndpoint(
                node=IMAGE_NODE,
                transport=name,
                address=self._image_servers[name].address,
                regions=(handle,),
            )
            for name, handle in self._image_handles.items()
        ]
        local = "shm" in self._image_servers and region.path is not None
        st = os.stat(region.path) if local and region.path else None
        geometry = ImageGeometry.from_header(region.view)
        # An index that prepares the image's memory at start says how long it took.
        prepared_ms = self.index.stats().get("image_prefault_ms")
        log.info(
            "lookup image: %d buckets (%d bytes%s) over %s",
            geometry.buckets,
            region.size,
            "" if prepared_ms is None else f", memory prepared in {prepared_ms / 1000:.2f}s",
            ", ".join(f"{e.transport} at {e.address.decode(errors='replace')}" for e in endpoints)
            or "nothing",
        )
        return p.ImageLocation(
            image_id=geometry.image_id,
            size=region.size,
            endpoints=tuple(endpoints),
            host=host_identity() if st else b"",
            path=region.path if st and region.path else "",
            device=st.st_dev if st else 0,
            inode=st.st_ino if st else 0,
            extents=self.index.leases_extents(),
        )

    def _start_authenticator(self, context: zmq.Context[zmq.Socket[bytes]]) -> Any:
        from zmq.auth.thread import ThreadAuthenticator

        assert self._credentials is not None
        allowed = self._credentials.client_public

        class _SharedSecret:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == allowed

        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", credentials_provider=_SharedSecret())
        return authenticator

    def stop(self) -> None:
        self._stopping.set()

    def _reply_to(self, frames: list[bytes]) -> bytes | None:
        if len(frames) != 2:
            # A DEALER sends one frame; ROUTER adds the identity. Anything else is not ours,
            # and without a well-formed envelope there is no one to answer.
            self._counters["bad_frames"] += 1
            return None
        frame = frames[1]
        request_id = 0
        try:
            header, reader = p.decode_header(frame)
            request_id = header.request_id
            handler = self._handlers.get(header.type)
            if handler is None:
                raise _Refusal(ErrorCode.UNKNOWN_TYPE, f"unknown message type {header.type}")
            apply = handler(reader)
            reader.end()
            body = apply()
            kind, name = _COUNTED_AS[header.type]
            self._counters[kind] += 1
            self._counters[name] += 1
            return p.encode(header.type | REPLY_BIT, request_id, body, self.epoch, self._membership)
        except _Refusal as exc:
            self._counters["refused"] += 1
            return self._error(request_id, exc.code, str(exc))
        except ProtocolError as exc:
            self._counters["bad_frames"] += 1
            code = exc.code if isinstance(exc, p.FrameError) else ErrorCode.BAD_FRAME
            return self._error(request_id, code, str(exc))
        except Exception as exc:  # one bad request must never stop the controller
            log.exception("controller: internal error serving a request")
            self._counters["internal_errors"] += 1
            return self._error(request_id, ErrorCode.INTERNAL, f"internal error: {exc}")

    def _error(self, request_id: int, code: ErrorCode, message: str) -> bytes:
        return p.encode(
            MsgType.ERROR, request_id, p.write_error(code, message), self.epoch, self._membership
        )

    def _upkeep(self, step: Callable[[], None], name: str) -> None:
        """Run one of the index's upkeep steps. Like one bad request, one failing step must
        never stop the controller: an exception is counted, and logged with its traceback
        at most once every :data:`UPKEEP_LOG_INTERVAL` per step (a step that fails at every
        tick would flood the log), and the loop goes on serving."""
        try:
            step()
        except Exception:
            self._counters["upkeep_errors"] += 1
            now = time.monotonic()
            if now >= self._upkeep_logged.get(name, 0.0):
                self._upkeep_logged[name] = now + UPKEEP_LOG_INTERVAL
                log.exception(
                    "controller: the index's %s() failed (%d upkeep failures so far; the "
                    "next of this step's is logged after %.0f s)",
                    name,
                    self._counters["upkeep_errors"],
                    UPKEEP_LOG_INTERVAL,
                )

    def _maintain(self) -> None:
        self._upkeep(self.index.tick, "tick")
        if self._freeze_long_lived:
            self._freeze_gc()
        self._revive_image_servers()
        now = time.monotonic()
        for node, seen in list(self._last_seen.items()):
            if now - seen > self.node_timeout:
                dropped = self._drop_node(node)
                self._counters["nodes_dropped"] += 1
                log.warning(
                    "node %d missed heartbeats for %.1fs: dropped with %d entries",
                    node,
                    now - seen,
                    dropped,
                )

    @staticmethod
    def _freeze_gc() -> None:
        """Collect the young generations, then freeze what survived: full collections walk
        only what was promoted since the last tick.

        The index holds an object or more per entry (its entry, descriptors) for as long as
        the entry lives, and none of them form cycles. Python's full collections walk every
        object, and one runs about once per quarter of the heap's growth: a stall of every
        request that grows with the index, towards a client's control timeout on a large
        one. A frozen object is
        still freed when its last reference goes; only a cycle that became garbage after it
        outlived the young generations would be kept (the controller makes none that way).
        """
        gc.collect(1)
        gc.freeze()

    def _revive_image_servers(self) -> None:
        """Start again an image server whose process died; clients that read its old address
        fall back to the control RPC and ask where the image went."""
        if self.image is None:
            return
        moved = False
        for name in self._image_handles:
            server = self._image_servers[name]
            if isinstance(server, ImageProcessServer) and server.revive():
                self._counters["image_server_restarts"] += 1
                moved = True
        if moved:
            self.image = self._image_location_now()

    def _drop_node(self, node: int) -> int:
        dropped = self.index.remove_node(node)
        self._membership += 1
        self._last_seen.pop(node, None)
        self._node_stats.pop(node, None)
        return dropped

    # -- handlers ----------------------------------------------------------------------------

    def _nodes(self, r: Reader) -> Callable[[], bytes]:
        return lambda: p.write_nodes(self.index.nodes())

    def _lookup_prefix(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        # With replicas the reply ends with the keys' other copies (absent when none).
        return lambda: p.write_copies(self.index.lookup_copies(keys), optional=False)

    def _resolve(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: p.write_copies(self.index.resolve_copies(keys), optional=True)

    def _exists(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: p.write_flags(self.index.exists(keys))

    def _allocate(self, r: Reader) -> Callable[[], bytes]:
        requests = p.read_allocation_requests(r)
        return lambda: p.write_allocate_result(self.index.allocate(requests))

    def _publish(self, r: Reader) -> Callable[[], bytes]:
        grants = p.read_grants(r)
        return lambda: p.write_flags(self.index.publish(grants))

    def _lease_extents(self, r: Reader) -> Callable[[], bytes]:
        need, want, count, exclude, returned = p.read_lease_request(r)
        return lambda: p.write_extents(
            self.index.lease_extents(need, want, count, exclude, returned)
        )

    def _publish_carved(self, r: Reader) -> Callable[[], bytes]:
        records, again = p.read_carved(r)
        return lambda: p.write_carve_outcomes(self.index.publish_carved(records, again))

    def _abort(self, r: Reader) -> Callable[[], bytes]:
        grants = p.read_grants(r)

        def apply() -> bytes:
            self.index.abort(grants)
            return b""

        return apply

    def _unpublish(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)
        return lambda: Writer().u32(self.index.unpublish(keys)).getvalue()

    def _image_location(self, r: Reader) -> Callable[[], bytes]:
        return lambda: p.write_image_location(self.image)

    def _touch(self, r: Reader) -> Callable[[], bytes]:
        keys = p.read_keys(r)

        def apply() -> bytes:
            self.index.touch(keys)
            return b""

        return apply

    def _report_invalid(self, r: Reader) -> Callable[[], bytes]:
        records = p.read_grants(r)
        return lambda: Writer().u32(self.index.drop_invalid(records)).getvalue()

    def _register_node(self, r: Reader) -> Callable[[], bytes]:
        offered = NodeInfo.read_from(r)

        def apply() -> bytes:
            self._refuse_takeover(offered)
            info = self.index.register_node(offered)
            self._last_seen[info.id] = time.monotonic()
            self._membership += 1
            log.info(
                "node %d (%s) registered: incarnation %d, %d regions%s",
                info.id,
                info.name,
                info.incarnation,
                len(info.regions),
                ", restoring its records" if info.restoring else "",
            )
            return info.to_bytes()

        return apply

    def _refuse_takeover(self, offered: NodeInfo) -> None:
        """A live node's name is its own: another process may take it only once it is gone."""
        known = next((n for n in self.index.nodes() if n.name == offered.name), None)
        if known is None or known.instance == offered.instance or known.id not in self._last_seen:
            return
        silent = time.monotonic() - self._last_seen[known.id]
        if silent <= self.node_timeout:
            self._counters["takeovers_refused"] += 1
            raise _Refusal(
                ErrorCode.NAME_IN_USE,
                f"node name {offered.name!r} belongs to a live node (heard from {silent:.1f}s "
                f"ago); it is released {self.node_timeout:g}s after that node falls silent",
            )

    def _registration(self, node: int, incarnation: int) -> NodeInfo:
        known = next((n for n in self.index.nodes() if n.id == node), None)
        if known is None or node not in self._last_seen or known.incarnation != incarnation:
            raise _Refusal(
                ErrorCode.UNKNOWN_NODE, f"node {node} incarnation {incarnation} is not registered"
            )
        return known

    def _heartbeat(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation, counters = p.read_heartbeat(r)

        def apply() -> bytes:
            self._registration(node, incarnation)
            self._last_seen[node] = time.monotonic()
            self._node_stats[node] = counters
            return b""

        return apply

    def _restore(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation, records = p.read_restore(r)

        def apply() -> bytes:
            self._registration(node, incarnation)
            self._last_seen[node] = time.monotonic()
            return Writer().u32(self.index.restore(node, records)).getvalue()

        return apply

    def _restore_done(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation = p.read_node_ref(r)

        def apply() -> bytes:
            known = self._registration(node, incarnation)
            self.index.restore_done(node)
            log.info("node %d (%s) restored its records", node, known.name)
            return b""

        return apply

    def _deregister_node(self, r: Reader) -> Callable[[], bytes]:
        node, incarnation = p.read_deregister(r)

        def apply() -> bytes:
            known = self._registration(node, incarnation)
            dropped = self._drop_node(node)
            self._counters["nodes_deregistered"] += 1
            log.info(
                "node %d (%s) deregistered: dropped with %d entries", node, known.name, dropped
            )
            return b""

        return apply

    def _stats(self, r: Reader) -> Callable[[], bytes]:
        return self._stats_body

    def _stats_body(self) -> bytes:
        scopes: dict[str, dict[str, int]] = {
            "controller": {
                "rpcs": 0,
                "node_rpcs": 0,
                "touch_rpcs": 0,
                "image_endpoints": len(self.image.endpoints) if self.image else 0,
                "bad_frames": 0,
                "refused": 0,
                "nodes_dropped": 0,
                "nodes_deregistered": 0,
                **self._counters,
                # What later full collections no longer walk (see _freeze_gc).
                **({"gc_frozen_objects": gc.get_freeze_count()} if self._freeze_long_lived else {}),
            },
            "index": self.index.stats(),
        }
        if self.image is not None:
            # The work the image's servers did (in ``serve``, the node's servers: all of it).
            for name in self._image_handles:
                for counter, value in self._image_servers[name].stats().items():
                    scopes["controller"][f"image_{name}_{counter}"] = value
        names = {n.id: n.name for n in self.index.nodes()}
        for node, counters in sorted(self._node_stats.items()):
            scopes[f"node {node} {names.get(node, '?')}"] = counters
        w = Writer().u32(len(scopes))
        for scope, counters in scopes.items():
            w.text(scope)
            w.raw(p.write_counters(counters).getvalue())
        return w.getvalue()


def _kind_of(msg_type: int) -> str:
    """Which counter a request adds to: clients' lookups and writes ("rpcs"), clients' use
    reports sent off the lookup path ("touch_rpcs"), or data nodes' requests."""
    if msg_type in _CLIENT_TYPES:
        return "rpcs"
    return "touch_rpcs" if msg_type == MsgType.TOUCH else "node_rpcs"


# The two counters each request served adds to, named once rather than per request.
_COUNTED_AS = {int(t): (_kind_of(t), f"rpc_{t.name.lower()}") for t in MsgType}
# An int, not the flag enum: ``int & Flag`` goes through the enum's Python operators.
_POLLIN = int(zmq.POLLIN)
