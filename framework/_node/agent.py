"""The node agent: keeps a data node known to the controller.

It registers the node (regions, rkeys, transport addresses), then heartbeats with the
node's counters. When the controller answers "unknown node" or reports a new epoch (it was
restarted, or dropped us after missed heartbeats) the agent registers again; while the
controller is unreachable it keeps trying. The node serves reads all the while: data
transfer never depends on the controller being up.

When the node stops (``stop()``, e.g. on SIGTERM) the agent deregisters it, so the
controller drops the node and its entries at once instead of after missed heartbeats.
"""

from __future__ import annotations

import logging
import threading

from kvfabric._control.client import ControlClient, UnknownNodeError
from kvfabric._control.security import Credentials
from kvfabric._node.node import DataNode
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import MsgType
from kvfabric.errors import ControllerUnavailableError, KvfabricError
from kvfabric.spi.codec import Writer
from kvfabric.spi.index import NodeInfo

__all__ = ["NodeAgent"]

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
                    self._beat(self.registered.id)
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
        r = self._client.call(MsgType.REGISTER_NODE, self.node.info().to_bytes())
        info = NodeInfo.read_from(r)
        r.end()
        with self._changed:
            self.registered = info
            self._changed.notify_all()
        log.info("registered as node %d with %s", info.id, self._client.endpoint)

    def _beat(self, node_id: int) -> None:
        body = Writer().u32(node_id).raw(p.write_counters(self.node.stats()).getvalue())
        self._client.call(MsgType.HEARTBEAT, body.getvalue()).end()

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
