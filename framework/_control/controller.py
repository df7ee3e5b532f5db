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

Its port bounds what a peer can make it hold before any frame is trusted, authenticated or
not: a frame larger than ``max_frame`` is refused by ZeroMQ as its size arrives (the peer
is disconnected, nothing is allocated for it), and each connection may have at most
:data:`RECEIVE_QUEUE` frames queued (ZeroMQ stops reading from a connection past that), so
one connection can hold at most ``RECEIVE_QUEUE x max_frame`` bytes of it. Clients send
large requests as chunks far below the bound (:mod:`kvfabric._control.session`). What each
client may hold *reserved* in the index is bounded too (:mod:`kvfabric._control.reservations`).

Given a KV event publisher (``--kv-events``: :mod:`kvfabric._control.kv_events`), the
controller has its index report every entry stored and removed to it. A controller starts
with an empty index, whatever one before it held, so the first event it publishes is
``AllBlocksCleared``: a router drops what it learnt from the controller's predecessor, and
the stores that follow (the nodes' records restored, new puts) build its view afresh.

With tenants (:mod:`kvfabric._control.tenant_gate`), the credential each frame's connection
proved decides which handlers serve it: a tenant's reach only its own namespace, within its
quota.
"""

from __future__ import annotations

import gc
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from kvfabric._control.auth_monitor import RefusalMonitor
from kvfabric._control.client_requests import CLIENT_TYPES, ClientRequests
from kvfabric._control.client_usage import ClientUsage
from kvfabric._control.image_publisher import ImagePublisher
from kvfabric._control.kv_events import KvEventPublisher
from kvfabric._control.node_members import NodeMembers
from kvfabric._control.refusal import Handler, Refusal
from kvfabric._control.reservations import ReservationLimits, Reservations
from kvfabric._control.security import Credentials
from kvfabric._control.tenant_gate import TenantGate
from kvfabric._runtime.codec import Reader, Writer
from kvfabric._wire import member_bodies as mb
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import REPLY_BIT, ErrorCode, MsgType
from kvfabric.errors import ConfigError, ProtocolError
from kvfabric.spi.index import IndexPlugin
from kvfabric.spi.transport import TransportServer

__all__ = ["Controller"]

log = logging.getLogger("kvfabric._control.controller")

MAX_FRAME = 4 << 20
"""The largest control frame the controller takes by default: sixteen times the largest
chunk a client sends (:data:`kvfabric._control.session.CHUNK_BYTES`), with room for a data
node's registration of thousands of regions."""
RECEIVE_QUEUE = 16
"""Frames one connection may have queued at the controller (a client pipelines a few)."""

UPKEEP_LOG_INTERVAL = 60.0
"""Seconds between log records of one failing upkeep step of the index's (each failure is
counted as ``upkeep_errors``)."""


class Controller:
    """The index behind a ROUTER socket: the request loop, upkeep and the counters."""

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
        max_frame: int = MAX_FRAME,
        reservation_limits: ReservationLimits | None = None,
        kv_events: KvEventPublisher | None = None,
        tenants: TenantGate | None = None,
    ) -> None:
        """``image_servers``: transport servers (by name) to serve the index's lookup image
        on; none: clients look everything up by RPC. ``freeze_long_lived``: every tick,
        exempt what outlived the young generations from later full collections (for a
        process of the controller's own; see :meth:`_freeze_gc`). ``max_frame``: the
        largest frame taken, in bytes. ``reservation_limits``: what one client may hold
        reserved (default: :class:`ReservationLimits`'s). ``kv_events``: where the index's
        changes are published (the controller starts its thread, and closes it when it
        stops serving); a ConfigError if the index reports none. ``tenants``: the tenants
        served beside the deployment's own clients (needs ``credentials``: a tenant is known
        by the key its connection proved)."""
        if tenants is not None and credentials is None:
            raise ConfigError(
                "--tenants needs the deployment's secret (--secret-file or KVFABRIC_SECRET): "
                "a tenant is known by the credential its connection proves"
            )
        self.listen = listen
        self.index = index
        self.tick = tick
        self.epoch = secrets.randbits(63) | 1
        self.endpoint = ""
        self._credentials = credentials
        self._counters: Counter[str] = Counter()
        self._upkeep_logged: dict[str, float] = {}
        """Upkeep step -> when a failure of it may be logged again."""
        self._stopping = threading.Event()
        self.serving = threading.Event()
        """Set while the request loop runs (bound, answering)."""
        self._refusals: RefusalMonitor | None = None
        """Counts the handshakes the control socket refused (a secret problem)."""
        self.index_failure: str | None = None
        """Why the index's last upkeep tick failed (its store unreachable, say); None
        while ticks succeed. Read by the readiness check."""
        self._freeze_long_lived = freeze_long_lived
        self._image = ImagePublisher(index, image_servers or {})
        self._tenants = tenants
        self._nodes = NodeMembers(
            tenants.observe_restores(index) if tenants is not None else index,
            node_timeout,
            self._counters,
        )
        self.max_frame = max_frame
        self._capacity = (-1, 0)
        """(nodes generation, capacity in bytes) as last summed."""
        self._reservations = Reservations(
            reservation_limits or ReservationLimits(), self._capacity_now, self._counters
        )
        self._kv_events = kv_events
        if kv_events is not None:
            # Whatever a controller before this one published is not held here: routers
            # start their view afresh, before the first store.
            kv_events.queue.cleared()
            if not index.report_events(kv_events.queue):
                raise ConfigError(
                    f"--kv-events: the {index.name} index reports no KV events (the memory "
                    "and redis indexes do; see docs/kv-events.md)"
                )
        self._usage = ClientUsage()
        self._handlers: dict[int, Handler] = {
            **ClientRequests(
                index, self._image, self._reservations, kv_events=kv_events is not None
            ).handlers,
            **self._nodes.handlers,
            **self._usage.handlers,
            MsgType.STATS: self._stats,
        }
        if tenants is not None:
            tenants.bind(index, self._image, self._reservations)

    @property
    def node_timeout(self) -> float:
        return self._nodes.node_timeout

    def _capacity_now(self) -> int:
        """The store's capacity: its nodes' regions, summed again when the nodes change."""
        generation = self._nodes.generation
        if self._capacity[0] != generation:
            total = sum(r.size for node in self.index.nodes() for r in node.regions)
            self._capacity = (generation, total)
        return self._capacity[1]

    @property
    def kv_events(self) -> KvEventPublisher | None:
        """Where the index's KV events are published, if they are."""
        return self._kv_events

    @property
    def image(self) -> mb.ImageLocation | None:
        """Where the lookup image is served (None: lookups go by RPC)."""
        return self._image.location

    # -- serving ---------------------------------------------------------------------------

    def serve(self, ready: Callable[[str], None] | None = None) -> None:
        """Serve until :meth:`stop` is called (from any thread or a signal handler)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        authenticator = None
        sock = context.socket(zmq.ROUTER)
        sock.linger = 0
        # Bounds on what a peer can make this process hold, set before it can connect.
        sock.maxmsgsize = self.max_frame
        sock.rcvhwm = RECEIVE_QUEUE
        # Refused handshakes never reach the loop: counted and logged from the socket's
        # monitor events instead.
        refusals = RefusalMonitor(sock, secured=self._credentials is not None)
        self._refusals = refusals
        try:
            if self._credentials is not None:
                authenticator = self._start_authenticator(context)
                self._credentials.secure_server(sock)
            sock.bind(self.listen)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._image.publish()
            if self._kv_events is not None:
                self._kv_events.start()
            log.info("controller listening on %s (epoch %x)", self.endpoint, self.epoch)
            if ready is not None:
                ready(self.endpoint)
            self.serving.set()
            self._loop(sock)
        finally:
            self.serving.clear()
            refusals.close()
            sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            context.term()
            if self._kv_events is not None:
                self._kv_events.close()

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
                    if self._tenants is None:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                        reply = self._reply_to(frames)
                    else:
                        frames, handlers = self._tenants.receive(sock)
                        reply = self._reply_to(frames, handlers)
                    if reply is not None:
                        sock.send_multipart([frames[0], reply])
                # Every request answered: upkeep the replies need not wait for (a full
                # store's eviction ahead of need, while the writer that leased writes).
                self._upkeep(self.index.idle, "idle")
            if time.monotonic() >= next_tick:
                self._maintain()
                next_tick = time.monotonic() + self.tick

    def _start_authenticator(self, context: zmq.Context[zmq.Socket[bytes]]) -> Any:
        from zmq.auth.thread import ThreadAuthenticator

        assert self._credentials is not None
        allowed = {self._credentials.client_public}
        if self._tenants is not None:
            allowed |= self._tenants.client_keys()

        class _SharedSecret:
            def callback(self, domain: str, key: bytes) -> bool:
                return key in allowed

        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve_callback("*", credentials_provider=_SharedSecret())
        return authenticator

    def stop(self) -> None:
        self._stopping.set()

    def _reply_to(
        self, frames: list[bytes], handlers: dict[int, Handler] | None = None
    ) -> bytes | None:
        """The reply to one message; ``handlers``: a tenant's (default: all of them)."""
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
            handler = (handlers or self._handlers).get(header.type)
            if handler is None:
                raise Refusal(ErrorCode.UNKNOWN_TYPE, f"unknown message type {header.type}")
            apply = handler(reader)
            reader.end()
            body = apply()
            kind, name = _COUNTED_AS[header.type]
            self._counters[kind] += 1
            self._counters[name] += 1
            return p.encode(
                header.type | REPLY_BIT, request_id, body, self.epoch, self._nodes.generation
            )
        except Refusal as exc:
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
            MsgType.ERROR,
            request_id,
            p.write_error(code, message),
            self.epoch,
            self._nodes.generation,
        )

    # -- upkeep ------------------------------------------------------------------------------

    def _upkeep(self, step: Callable[[], None], name: str) -> None:
        """Run one of the index's upkeep steps. Like one bad request, one failing step must
        never stop the controller: an exception is counted, and logged with its traceback
        at most once every :data:`UPKEEP_LOG_INTERVAL` per step (a step that fails at every
        tick would flood the log), and the loop goes on serving."""
        try:
            step()
        except Exception as exc:
            if name == "tick":
                self.index_failure = f"{type(exc).__name__}: {exc}"
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
            return
        if name == "tick" and self.index_failure is not None:
            log.warning("controller: the index's tick() succeeds again")
            self.index_failure = None

    def _maintain(self) -> None:
        self._upkeep(self.index.tick, "tick")
        self._reservations.expire()
        if self._freeze_long_lived:
            self._freeze_gc()
        self._image.revive()
        self._nodes.drop_silent()
        if self._tenants is not None:
            self._upkeep(self._tenants_tick, "tenants")

    def _tenants_tick(self) -> None:
        assert self._tenants is not None
        self._tenants.tick(self._nodes.generation)

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

    # -- stats -------------------------------------------------------------------------------

    def _stats(self, r: Reader) -> Callable[[], bytes]:
        return self._stats_body

    def _stats_body(self) -> bytes:
        controller = {
            "rpcs": 0,
            "node_rpcs": 0,
            "touch_rpcs": 0,
            "usage_rpcs": 0,
            "image_endpoints": len(self.image.endpoints) if self.image else 0,
            "bad_frames": 0,
            "refused": 0,
            "nodes_dropped": 0,
            "nodes_deregistered": 0,
            **self._counters,
            **(self._refusals.stats() if self._refusals is not None else {}),
            **self._reservations.stats(),
            # What later full collections no longer walk (see _freeze_gc).
            **({"gc_frozen_objects": gc.get_freeze_count()} if self._freeze_long_lived else {}),
            # The work the image's servers did (in ``serve``, the node's servers: all of it).
            **self._image.server_stats(),
            **(self._kv_events.stats() if self._kv_events is not None else {}),
        }
        if self._image.restarts:
            controller["image_server_restarts"] = self._image.restarts
        scopes = {
            "controller": controller,
            "index": self.index.stats(),
            "clients": self._usage.stats(),
        }
        scopes.update(self._nodes.stats_scopes())
        if self._tenants is not None:
            scopes.update(self._tenants.stats_scopes())
        w = Writer().u32(len(scopes))
        for scope, counters in scopes.items():
            w.text(scope)
            w.raw(p.write_counters(counters).getvalue())
        return w.getvalue()


def _kind_of(msg_type: int) -> str:
    """Which counter a request adds to: clients' lookups and writes ("rpcs"), clients' use
    and usage reports sent off the lookup path ("touch_rpcs", "usage_rpcs"), or data nodes'
    requests."""
    if msg_type in CLIENT_TYPES:
        return "rpcs"
    if msg_type == MsgType.USAGE:
        return "usage_rpcs"
    return "touch_rpcs" if msg_type == MsgType.TOUCH else "node_rpcs"


# The two counters each request served adds to, named once rather than per request.
_COUNTED_AS = {int(t): (_kind_of(t), f"rpc_{t.name.lower()}") for t in MsgType}
# An int, not the flag enum: ``int & Flag`` goes through the enum's Python operators.
_POLLIN = int(zmq.POLLIN)
