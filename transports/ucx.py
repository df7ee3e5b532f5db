"""The ``ucx`` transport: one-sided reads and writes with UCX RMA (``ucp_get_nbx``/``put``).

The data node maps each region with ``ucp_mem_map`` and publishes its base address and
packed remote key in the region's handle, and its worker address as the node's address.
A client makes one endpoint per node from that worker address (which is what lets UCX pick
CMA on one host; RDMA with a verbs-enabled UCX), unpacks the keys once, and moves a batch
by posting every get or put, then driving progress until all complete or ``timeout``
passes. Bytes land straight in the caller's buffers.

One-sidedness depends on what UCX picks (``UCX_TLS``): with ``sm`` (CMA) and RDMA the data
node's CPU does nothing per read or write; with ``tcp`` UCX emulates RMA in software and the
node's progress thread serves each request. UCX checks no addresses against registered
memory, so the checks every batch passes first (``kvfabric.spi.PeerClient`` plans it:
rkey, bounds, writable destination) are the only ones.

Threads: the client has one worker and one lock; every UCX call is made under the lock,
waits for completion are not, so batches for several nodes are in flight together and
whichever caller progresses completes them all. The GIL: cffi drops it during each call,
and each call taken back beside a busy Python thread can wait out the switch interval
(5 ms), so a batch's posts, progress and completion checks run in kvfabric's native loops
(``kvfabric._runtime.native``: ``ucp_post`` keeps the GIL, ``ucp_wait`` releases it once for
the whole wait and takes the CRCs of the batch's records in the same release), with libucp's
functions passed as addresses, and the lock is a native ``Mutex`` those loops take without
the GIL. Native code is loaded lazily (``kvfabric.transports._ucp``): this module imports
without UCX, and selecting the transport without it gives the install hint.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import struct
import threading
from typing import Any

from kvfabric._runtime.buffers import address_of
from kvfabric._runtime.native import GIL_RELEASE_MIN, Mutex, ucp_post, ucp_wait
from kvfabric.errors import PluginUnavailableError, TransportError, TransportTimeoutError
from kvfabric.spi import (
    Batch,
    Capabilities,
    Counters,
    ExceptionMapping,
    MemoryKind,
    NodeEndpoint,
    PeerClient,
    Region,
    RegionHandle,
    Registry,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
    byte_view,
    hookimpl,
    map_exceptions,
)
from kvfabric.transports import _ucp

__all__ = ["UcxTransport"]

log = logging.getLogger(__name__)

_HINT = "pip install 'kvfabric[ucx]'"
# RegionHandle.info: the region's base address in the node's memory, then the packed rkey.
_INFO = struct.Struct("<Q")

# PEER error handling (a dead node fails a request instead of aborting the client, and a
# stuck request can be cancelled by a force close) makes UCX drop CMA unless told these;
# a variable the user sets in the environment wins.
_CONTEXT_DEFAULTS = {
    "CMA_MEMORY_INVALIDATE": "y",
    "POSIX_ERROR_HANDLING": "y",
    "SYSV_ERROR_HANDLING": "y",
    # CMA copies happen inside the client's ucp_worker_progress(), by default one 512 KiB
    # segment per call. Each call drops the GIL, and taking it back from a busy Python thread
    # can cost a switch interval, so a large batch beside such a thread spends most of its
    # time waiting for the GIL; with 64 MiB segments a get of up to that size is one call.
    "CMA_SEG_SIZE": "64M",
    "CMA_TX_QUOTA": "1024",
    # Over tcp UCX moves RMA data in messages of at most this size, each a progress round on
    # the node, so the default 8 KiB makes a large get pay hundreds of rounds. Both ends must
    # agree (a sender's TX may not exceed its peer's RX), which they do unless a user sets one.
    "TCP_TX_SEG_SIZE": "1M",
    "TCP_RX_SEG_SIZE": "1M",
}
# The node's progress thread sleeps on the worker's event fd; the cap only bounds the cost of
# a wakeup UCX might not signal.
_NODE_IDLE_MS = 100
# A client spins this many empty progress rounds (a reply is often microseconds away), then
# sleeps on the event fd for at most this long between deadline checks.
_CLIENT_SPINS = 20
_CLIENT_IDLE_MS = 1
_DRAIN_MAX = 1 << 16
# After a force close, cancelled requests complete within a progress call or two.
_CANCEL_ROUNDS = 1000

_SERVER_COUNTERS = ("regions", "progress_wakeups", "progress_events")


def _native() -> _ucp.Binding:
    try:
        return _ucp.binding()
    except _ucp.LibraryError as exc:
        raise PluginUnavailableError(f"ucx: {exc}; install it with: {_HINT}") from exc


def _refuse_after_fork() -> None:
    """Refuse to start UCX in a process forked after UCX started in its parent (see
    ``_ucp.started_in_a_parent``): the store's other transports carry its bytes instead."""
    parent = _ucp.started_in_a_parent()
    if parent is None:
        return
    global _fork_warned
    if not _fork_warned:
        _fork_warned = True
        log.warning(
            "kvfabric: ucx is not used in this process (pid %d): it was forked from process "
            "%d after UCX started there, and UCX is not fork-safe; its bytes go over the "
            "store's other transports. To use UCX here, connect after the fork.",
            os.getpid(),
            parent,
        )
    raise PluginUnavailableError(
        f"ucx: this process was forked from process {parent} after UCX started there, and "
        "UCX is not fork-safe (its event thread stayed in that process, which would take "
        "this one's events); connect after the fork to use ucx here, or use another "
        "transport"
    )


_fork_warned = False


def _context_config(extra: dict[str, str] | None = None) -> dict[str, str]:
    wanted = {**_CONTEXT_DEFAULTS, **(extra or {})}
    return {k: v for k, v in wanted.items() if f"UCX_{k}" not in os.environ}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Every libucp failure the binding raises; timeouts and failed requests come back as
# statuses, which the client turns into errors itself.
_UCX_ERRORS: ExceptionMapping = {_ucp.UcxError: TransportError}


# -- server -------------------------------------------------------------------------------


class _UcxServer(TransportServer):
    """Maps regions and keeps a worker progressing (needed only where UCX emulates RMA)."""

    def __init__(self, config: TransportConfig) -> None:
        _native()
        _refuse_after_fork()
        # A node bound to loopback keeps UCX's tcp interfaces on loopback too, as the tcp
        # transport's listener would be (UCX_NET_DEVICES, if set, wins).
        extra = {"NET_DEVICES": "lo"} if _is_loopback(config.host) else {}
        self._counters = Counters(_SERVER_COUNTERS)
        self._maps: list[_ucp.MemoryMap] = []
        self._lock = threading.Lock()
        self._stopping = False
        with map_exceptions(_UCX_ERRORS, where="ucx: cannot start the node's worker"):
            self._context = _ucp.Context(_context_config(extra), name="kvfabric-node", shared=True)
            try:
                self._worker = _ucp.Worker(self._context, _ucp.THREAD_MODE_MULTI)
                self._address = self._worker.address()
                self._efd = self._worker.efd()
            except BaseException:
                self._context.close()
                raise
        self._thread = threading.Thread(
            target=self._progress_loop, name="kvfabric-ucx-progress", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, region: Region) -> RegionHandle:
        view = byte_view(region.view)
        base = address_of(view)
        with map_exceptions(_UCX_ERRORS, where=f"ucx: cannot map region {region.id}"):
            mapped = _ucp.MemoryMap(self._context, base, view.nbytes)
            packed = mapped.pack()
        with self._lock:
            self._maps.append(mapped)
        self._counters.add("regions")
        return RegionHandle(
            region=region.id, rkey=region.rkey, size=region.size, info=_INFO.pack(base) + packed
        )

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def _progress_loop(self) -> None:
        worker = self._worker
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        events = 0
        try:
            while not self._stopping:
                for _ in range(_DRAIN_MAX):
                    done = worker.progress()
                    if not done:
                        break
                    events += done
                # Arm fails (busy) when events are already pending: progress again at once.
                if worker.arm():
                    if events:
                        self._counters.update(progress_wakeups=1, progress_events=events)
                        events = 0
                    poller.poll(_NODE_IDLE_MS)
        except _ucp.UcxError:
            log.exception("kvfabric ucx: the node's progress thread failed")

    def close(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            maps, self._maps = self._maps, []
        self._worker.signal()
        self._thread.join(5.0)
        for mapped in maps:
            mapped.close()
        if not self._thread.is_alive():
            self._worker.close()
            self._context.close()


# -- client -------------------------------------------------------------------------------


class _Remote:
    """One region of a node as the client addresses it."""

    __slots__ = ("base", "packed", "rkey")

    def __init__(self, handle: RegionHandle) -> None:
        if len(handle.info) <= _INFO.size:
            raise TransportError(f"ucx: region {handle.region} has no packed remote key")
        (self.base,) = _INFO.unpack_from(handle.info)
        self.packed = handle.info[_INFO.size :]
        self.rkey: _ucp.RemoteKey | None = None


class _Peer:
    """A node (the client's state per node): its regions and, while usable, an endpoint and
    unpacked keys. ``closed`` once disconnected: calls still holding it then fail."""

    __slots__ = ("address", "closed", "ep", "node", "regions")

    def __init__(self, endpoint: NodeEndpoint) -> None:
        self.node = endpoint.node
        self.address = endpoint.address
        self.regions = {h.region: _Remote(h) for h in endpoint.regions}
        self.ep: _ucp.Endpoint | None = None
        self.closed = False


class _Requests:
    """Requests one call posted (addresses), and the buffers they use (kept alive until they
    complete)."""

    __slots__ = ("keep", "pending")

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.keep: list[Any] = []


class _UcxClient(PeerClient[_Peer]):
    native_errors = _UCX_ERRORS
    # Checksummed puts: the payloads' CRC32C is taken after their puts are posted, while the
    # NIC moves them (RDMA); the headers follow in a second call, after the flush.
    checksums_writes = True

    def __init__(self, config: TransportConfig) -> None:
        _refuse_after_fork()
        super().__init__(config)
        self._b = _native()
        # Keys of endpoints closed under running requests: destroyed once nothing is in flight.
        self._retired: list[_ucp.RemoteKey] = []
        self._in_flight = 0
        # Every UCX call on the worker is made under this lock (the worker is SERIALIZED);
        # the native wait takes it between progress rounds without the GIL.
        self._lock = Mutex()
        ffi, lib = self._b.ffi, self._b.lib
        self._get_fn, self._put_fn, self._flush_fn = (
            _address(ffi, ffi.addressof(lib, name))
            for name in ("ucp_get_nbx", "ucp_put_nbx", "ucp_ep_flush_nbx")
        )
        self._wait_fns = tuple(
            _address(ffi, ffi.addressof(lib, name))
            for name in (
                "ucp_worker_progress",
                "ucp_request_check_status",
                "ucp_request_free",
                "ucp_worker_arm",
            )
        )
        self._param = _address(ffi, self._b.host_param)
        with map_exceptions(_UCX_ERRORS, where="ucx: cannot start a client worker"):
            self._context = _ucp.Context(_context_config(), name="kvfabric-client", shared=False)
            try:
                # SERIALIZED: any thread may use the worker, one at a time (our lock).
                self._worker = _ucp.Worker(self._context, _ucp.THREAD_MODE_SERIALIZED)
                self._efd = self._worker.efd()
            except BaseException:
                self._context.close()
                raise

    # -- nodes ------------------------------------------------------------------------

    def reachable(self, endpoint: NodeEndpoint) -> bool:
        # Whether UCX has a path depends on the transports both sides enabled (UCX_TLS):
        # making the endpoint is local and tells.
        try:
            self.connect(endpoint)
        except TransportError as exc:
            log.debug("kvfabric ucx: node %d unreachable: %s", endpoint.node, exc)
            return False
        return True

    def describe(self, endpoint: NodeEndpoint) -> str:
        return f"ucx: node {endpoint.node}"

    def open_peer(self, endpoint: NodeEndpoint) -> _Peer:
        peer = _Peer(endpoint)
        with self._lock:
            self._open(peer)
        return peer

    def close_peer(self, peer: _Peer) -> None:
        with self._lock:
            peer.closed = True
            self._shut(peer)

    def close(self) -> None:
        super().close()
        with self._lock:
            if self._worker.handle is None:
                return
            self._drain()
            self._destroy_retired()
            self._worker.close()
            self._context.close()

    def _open(self, peer: _Peer) -> None:
        """Create the endpoint and unpack the region keys (lock held)."""
        ep = _ucp.Endpoint(self._worker, peer.address, name=f"kvfabric-node{peer.node}")
        try:
            for remote in peer.regions.values():
                remote.rkey = ep.unpack(remote.packed)
        except BaseException:
            self._close_ep(ep, [r.rkey for r in peer.regions.values()])
            for remote in peer.regions.values():
                remote.rkey = None
            raise
        peer.ep = ep

    def _shut(self, peer: _Peer) -> None:
        """Force-close the peer's endpoint, cancelling whatever runs on it (lock held)."""
        ep = peer.ep
        if ep is None:
            return
        peer.ep = None
        rkeys = [r.rkey for r in peer.regions.values()]
        for remote in peer.regions.values():
            remote.rkey = None
        self._close_ep(ep, rkeys)

    def _close_ep(self, ep: _ucp.Endpoint, rkeys: list[_ucp.RemoteKey | None]) -> None:
        request = ep.force_close()
        if _ucp.ptr_status(self._b.ffi, request) == _ucp.INPROGRESS:
            self._b.lib.ucp_request_free(request)  # completes by itself; UCX then frees it
        # Requests of other threads may still hold these keys until their cancellation is
        # seen: destroy them once nothing is in flight.
        self._retired.extend(k for k in rkeys if k is not None)
        if not self._in_flight:
            self._drain()
            self._destroy_retired()

    def _destroy_retired(self) -> None:
        for rkey in self._retired:
            rkey.close()
        self._retired.clear()

    def _drain(self) -> int:
        progress, worker = self._b.lib.ucp_worker_progress, self._worker.handle
        total = 0
        for _ in range(_DRAIN_MAX):
            done = progress(worker)
            if not done:
                break
            total += done
        return int(total)

    # -- transfers --------------------------------------------------------------------

    def read_segments(self, peer: _Peer, batch: Batch) -> None:
        self._transfer(peer, batch, put=False)

    def write_segments(self, peer: _Peer, batch: Batch) -> None:
        self._transfer(peer, batch, put=True)

    def _transfer(self, peer: _Peer, batch: Batch, *, put: bool) -> None:
        requests = _Requests()
        with self._lock:
            if peer.closed:
                raise TransportError(f"ucx: node {peer.node} was disconnected")
            if peer.ep is not None and peer.ep.failure != _ucp.OK:
                # UCX saw the node fail (while progressing for another call): posting on a
                # failed endpoint is not safe in every UCX release, so start afresh.
                self._shut(peer)
            if peer.ep is None:
                self._open(peer)  # a timeout or failure closed it: this is the reconnect
            ep = peer.ep
            assert ep is not None
            self._in_flight += 1
            try:
                failure = self._post(ep, peer, batch, requests, put=put)
            except BaseException:
                self._abandon(peer, ep, requests)  # what was posted must not outlive the call
                self._in_flight -= 1
                raise
        try:
            if failure == _ucp.OK:
                failure = self._wait(requests, batch, put=put)
        finally:
            with self._lock:
                if requests.pending or failure != _ucp.OK:
                    self._abandon(peer, ep, requests)
                self._in_flight -= 1
                if not self._in_flight and self._retired:
                    self._drain()
                    self._destroy_retired()
        if failure == _ucp.ERR_TIMED_OUT:
            raise TransportTimeoutError(
                f"ucx: node {peer.node} did not complete {len(batch.segments)} transfer(s) "
                f"within {self.config.timeout:g} s"
            )
        if failure != _ucp.OK:
            raise TransportError(f"ucx: node {peer.node}: {_ucp.status_text(failure)}")

    def _post(
        self, ep: _ucp.Endpoint, peer: _Peer, batch: Batch, requests: _Requests, *, put: bool
    ) -> int:
        """Post every segment, then after puts a flush (lock held); returns the first failure,
        or OK. One native call, which keeps the GIL.

        UCX checks no remote address against mapped memory (over tcp a bad one crashes the
        node; over CMA it reads whatever is there): the batch was planned, so every segment
        lies inside a region the node registered.
        """
        ffi = self._b.ffi
        regions = peer.regions
        buffers = []
        remote = []
        for seg in batch.segments:
            region = regions[seg.region]
            assert region.rkey is not None
            buffers.append(seg.buffer)
            remote.append((region.base + seg.offset, _address(ffi, region.rkey.handle)))
        requests.keep.extend(buffers)
        failure, requests.pending = ucp_post(
            self._put_fn if put else self._get_fn,
            self._flush_fn,
            _address(ffi, ep.handle),
            self._param,
            buffers,
            remote,
            put=put,
        )
        return failure

    def _wait(self, requests: _Requests, batch: Batch, *, put: bool) -> int:
        """Progress until the requests complete, one fails or the deadline passes; set the
        batch's CRCs when it has spans (puts: of the sources, while they move). One native
        call, one release of the GIL."""
        spans = batch.crc_spans
        failure, requests.pending, crcs = ucp_wait(
            self._wait_fns,
            _address(self._b.ffi, self._worker.handle),
            self._efd,
            requests.pending,
            self._lock,
            batch.deadline,
            spins=_CLIENT_SPINS,
            idle_ms=_CLIENT_IDLE_MS,
            crc_buffers=None if spans is None else [seg.buffer for seg in batch.segments],
            crc_spans=spans,
            crc_first=put,
            try_first=sum(seg.buffer.nbytes for seg in batch.segments) < GIL_RELEASE_MIN,
        )
        if failure == _ucp.OK:
            if spans is not None:
                batch.crcs = crcs
            requests.keep.clear()
        return failure

    def _abandon(self, peer: _Peer, ep: _ucp.Endpoint, requests: _Requests) -> None:
        """After a timeout or failure: cancel what is left and drop the endpoint (lock held).

        The next call reconnects. Requests of other calls on the same endpoint complete as
        cancelled, and those calls fail too: the node is unusable, not one request.
        """
        if peer.ep is ep:
            self._shut(peer)
        ffi, lib = self._b.ffi, self._b.lib
        pending = [ffi.cast("void *", r) for r in requests.pending]
        for _ in range(_CANCEL_ROUNDS):
            if not pending:
                break
            lib.ucp_worker_progress(self._worker.handle)
            pending = [r for r in pending if _still_running(lib, r)]
        for request in pending:
            # Released by UCX when it completes; its buffer must outlive it, so keep those.
            log.warning("kvfabric ucx: a request to node %d did not cancel", peer.node)
            lib.ucp_request_free(request)
        requests.pending = [_address(ffi, r) for r in pending]
        if requests.pending:
            _leaked_buffers.extend(requests.keep)
        requests.pending = []
        requests.keep.clear()


# Buffers of requests UCX never cancelled; freeing them could let a late transfer write
# into reused memory, so they live as long as the process.
_leaked_buffers: list[Any] = []


def _address(ffi: Any, pointer: Any) -> int:
    """A cffi pointer as the integer address kvfabric's native loops take."""
    return int(ffi.cast("uintptr_t", pointer))


def _still_running(lib: Any, request: Any) -> bool:
    if lib.ucp_request_check_status(request) == _ucp.INPROGRESS:
        return True
    lib.ucp_request_free(request)
    return False


class UcxTransport(Transport):
    name = "ucx"
    # Behind tcp: a client cannot tell whether UCX would use RDMA or emulate RMA over TCP
    # for a node, and emulated UCX is slower than kvfabric's tcp and exposed to a UCX bug that
    # can abort the node when a client dies (docs/ucx.md). On RDMA, force it: ?transport=ucx.
    preference = 10
    # One-sided with UCX_TLS=sm (CMA) and with RDMA; with UCX_TLS=tcp UCX emulates RMA with
    # the node's progress thread (see docs/ucx.md).
    capabilities = Capabilities(
        one_sided=True,
        local_only=False,
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.FILE}),
    )
    install_hint = _HINT

    @classmethod
    def check_available(cls) -> None:
        _native()

    @classmethod
    def create_server(cls, config: TransportConfig) -> TransportServer:
        return _UcxServer(config)

    @classmethod
    def create_client(cls, config: TransportConfig) -> TransportClient:
        return _UcxClient(config)


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(UcxTransport.name, UcxTransport)
