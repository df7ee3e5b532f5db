"""The node agent: keeps a data node known to the controller.

It registers the node (regions, rkeys, transport addresses), then heartbeats with the
node's counters. Before each registration it scans the node's memory for the records it
already holds (a ``file`` node that restarted, or any node whose controller restarted and
lost its index); if it finds some, it registers as ``restoring`` and reports them in
batches, so the controller rebuilds its entries from the nodes and the cache survives
the restart. When the controller answers "unknown node" or reports a new epoch (it was
restarted, or dropped us after missed heartbeats) the agent registers again; while the
controller is unreachable it keeps trying. The node serves reads all the while: data
transfer never depends on the controller being up.

When the node stops (``stop()``, e.g. on SIGTERM) the agent deregisters it, so the
controller drops the node and its entries at once instead of after missed heartbeats.
"""

from __future__ import annotations

import logging
import threading

from kvfabric._control.client import ControlClient, ControllerRefusedError, UnknownNodeError
from kvfabric._control.security import Credentials
from kvfabric._node.node import DataNode, NodeScan
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import ErrorCode, MsgType
from kvfabric.errors import ControllerUnavailableError, KvfabricError
from kvfabric.spi.index import NodeInfo
from kvfabric.spi.units import format_size

__all__ = ["RESTORE_BATCH", "NodeAgent"]

RESTORE_BATCH = 8192
"""Records per RESTORE frame (~620 KiB): a large restore never stalls the controller's loop
for long, nor makes one huge frame."""

log = logging.getLogger("kvfabric._node.node")


class NodeAgent:
    def __init__(
        self,
        node: DataNode,
        controller: str,
        *,
        heartbeat: float = 1.0,
        timeout: float = 2.0,
        credentials: Credentials | None = None,
    ) -> None:
        self.node = node
        self.heartbeat = heartbeat
        self.registered: NodeInfo | None = None
        self._client = ControlClient(
            controller,
            timeout=timeout,
            retry_interval=min(heartbeat, 1.0),
            credentials=credentials,
            on_epoch_change=self._forget_registration,
        )
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvfabric-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_registered(self, timeout: float) -> NodeInfo | None:
        with self._changed:
            self._changed.wait_for(lambda: self.registered is not None, timeout)
            return self.registered

    def _forget_registration(self, epoch: int) -> None:
        log.warning("controller restarted (epoch %x): registering again", epoch)
        self.registered = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.registered is None:
                    self._register()
                else:
                    self._beat(self.registered)
            except UnknownNodeError:
                log.warning("controller forgot node %s: registering again", self.node.name)
                self.registered = None
                continue
            except ControllerUnavailableError as exc:
                log.debug("controller unavailable: %s", exc)
            except KvfabricError as exc:
                log.error("node agent: %s", exc)
            self._stop.wait(self.heartbeat)

    def _register(self) -> None:
        scan = self.node.scan()
        if len(scan.records) or scan.torn:
            log.info(
                "found %d records in %s of memory in %.2fs (%d torn, dropped)",
                len(scan.records),
                format_size(scan.scanned_bytes),
                scan.seconds,
                scan.torn,
            )
        restoring = len(scan.records) > 0
        try:
            r = self._client.call(
                MsgType.REGISTER_NODE, self.node.info(restoring=restoring).to_bytes()
            )
        except ControllerRefusedError as exc:
            if exc.code != ErrorCode.NAME_IN_USE:
                raise
            log.warning("%s; waiting", exc)
            return
        info = NodeInfo.read_from(r)
        r.end()
        if restoring:
            self._restore(info, scan)
        with self._changed:
            self.registered = info
            self._changed.notify_all()
        log.info(
            "registered as node %d (incarnation %d) with %s",
            info.id,
            info.incarnation,
            self._client.endpoint,
        )

    def _restore(self, info: NodeInfo, scan: NodeScan) -> None:
        """Report the records found, in frames of a bounded size, then say it is done."""
        records = scan.addressed(info)
        kept = 0
        for start in range(0, len(records), RESTORE_BATCH):
            batch = records[start : start + RESTORE_BATCH]
            body = p.write_node_ref(info.id, info.incarnation) + p.write_descriptor_bytes(
                len(batch), batch.tobytes()
            )
            r = self._client.call(MsgType.RESTORE, body)
            kept += r.u32()
            r.end()
        self._client.call(MsgType.RESTORE_DONE, p.write_node_ref(info.id, info.incarnation)).end()
        log.info(
            "restored %d of %d records (the rest: keys already stored elsewhere)",
            kept,
            len(records),
        )

    def _beat(self, node: NodeInfo) -> None:
        body = p.write_heartbeat(node.id, node.incarnation, self.node.stats())
        self._client.call(MsgType.HEARTBEAT, body).end()

    def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating and, unless told not to, deregister the node.

        Deregistering is one bounded round trip (at most the agent's ``timeout``, and none
        when no connection to the controller is up, e.g. it stopped first in ``serve``); if
        the controller does not answer, it drops the node after missed heartbeats as before.
        Pass ``deregister=False`` when the controller is known to be gone already.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        registered = self.registered
        # After the join: a heartbeat racing the deregistration would register us again.
        if deregister and registered is not None and not self._thread.is_alive():
            body = p.write_deregister(registered.id, registered.incarnation)
            try:
                self._client.call(MsgType.DEREGISTER_NODE, body, wait_connect=False).end()
                log.info("deregistered node %d", registered.id)
            except KvfabricError as exc:
                # Best effort: the controller drops the node after missed heartbeats anyway.
                log.info("could not deregister node %d (%s)", registered.id, exc)
            self.registered = None
        self._client.close()
