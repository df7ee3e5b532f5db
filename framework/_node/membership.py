"""Where a data node keeps itself known: a controller, or a shared index used directly.

The node agent does the same things either way — register (after scanning for the records
it holds), report them, heartbeat, deregister when it stops — through a :class:`Membership`:

- :class:`ControllerMembership` speaks the control protocol to a controller;
- :class:`IndexMembership` calls a *shared* index plugin (state kept outside the processes
  using it, e.g. Redis) directly: no kvfabric process in the metadata path. The node also
  ticks the index, as every user of a shared index does (expiring leases, dropping nodes
  that fell silent).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np

from kvfabric._control.client import ControlClient, ControllerRefusedError
from kvfabric._control.security import Credentials
from kvfabric._control.session import chunks
from kvfabric._wire import member_bodies as mb
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import ErrorCode, MsgType
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import ConfigError, ControllerUnavailableError, NameInUseError
from kvfabric.spi.index import IndexPlugin, NodeInfo

__all__ = ["RESTORE_BATCH", "ControllerMembership", "IndexMembership", "Membership"]

RESTORE_BATCH = 8192
"""Records per ``restore`` call of a shared index: a large restore never stalls the index
for long. (To a controller they go in the control protocol's chunks, pipelined:
:mod:`kvfabric._control.session`.)"""


class Membership(abc.ABC):
    """The service a node registers with. Methods raise ``ControllerUnavailableError`` when
    it cannot be reached, :class:`NameInUseError` when a live node holds the name."""

    where: str
    """What it is, for log lines."""
    check_hint: str = "is it running and reachable"
    """What to check while it does not answer, for log lines."""
    on_reset: Callable[[], None] | None = None
    """Called when the service lost every registration (a controller restarted)."""

    @abc.abstractmethod
    def register(self, info: NodeInfo) -> NodeInfo: ...

    @abc.abstractmethod
    def restore(self, info: NodeInfo, records: np.ndarray) -> int:
        """Report records (descriptor wire form, addressed) found in the node's memory."""

    @abc.abstractmethod
    def restore_done(self, info: NodeInfo) -> None: ...

    @abc.abstractmethod
    def heartbeat(self, info: NodeInfo, counters: dict[str, int]) -> bool:
        """False: the registration is gone (register again)."""

    @abc.abstractmethod
    def deregister(self, info: NodeInfo) -> None: ...

    def close(self) -> None:
        """Release connections."""


class ControllerMembership(Membership):
    def __init__(
        self,
        controller: str,
        *,
        timeout: float,
        retry_interval: float,
        credentials: Credentials | None = None,
    ) -> None:
        self.where = f"the controller at {controller}"
        self.check_hint = "is `kvfabric controller` running there"
        self._client = ControlClient(
            controller,
            timeout=timeout,
            retry_interval=retry_interval,
            credentials=credentials,
            on_epoch_change=self._reset,
        )

    def _reset(self, epoch: int) -> None:
        if self.on_reset is not None:
            self.on_reset()

    def register(self, info: NodeInfo) -> NodeInfo:
        try:
            r = self._client.call(MsgType.REGISTER_NODE, info.to_bytes())
        except ControllerRefusedError as exc:
            if exc.code == ErrorCode.NAME_IN_USE:
                raise NameInUseError(str(exc)) from exc
            raise
        registered = NodeInfo.read_from(r)
        r.end()
        return registered

    def restore(self, info: NodeInfo, records: np.ndarray) -> int:
        # In chunks, pipelined: the controller serves other requests between them, and a
        # restore of a million records takes the time its work takes, not a round trip each.
        head = mb.write_node_ref(info.id, info.incarnation)
        ranges = chunks(len(records), DESCRIPTOR_SIZE)
        bodies = [
            head + p.write_descriptor_bytes(len(c), records[c.start : c.stop].tobytes())
            for c in ranges
        ]
        with self._client.session() as session:
            replies = session.exchange(MsgType.RESTORE, bodies, items=len(records))
        kept = 0
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            if reply is None:
                raise ControllerUnavailableError(f"{self.where} did not answer a restore in time")
            kept += reply.u32()
            reply.end()
        return kept

    def restore_done(self, info: NodeInfo) -> None:
        self._client.call(MsgType.RESTORE_DONE, mb.write_node_ref(info.id, info.incarnation)).end()

    def heartbeat(self, info: NodeInfo, counters: dict[str, int]) -> bool:
        try:
            body = mb.write_heartbeat(info.id, info.incarnation, counters)
            self._client.call(MsgType.HEARTBEAT, body).end()
        except ControllerRefusedError as exc:
            if exc.code == ErrorCode.UNKNOWN_NODE:
                return False
            raise
        return True

    def deregister(self, info: NodeInfo) -> None:
        body = mb.write_deregister(info.id, info.incarnation)
        # Never wait for a connection that is not up (in `serve` the controller stops first).
        self._client.call(MsgType.DEREGISTER_NODE, body, wait_connect=False).end()

    def close(self) -> None:
        self._client.close()


class IndexMembership(Membership):
    """A node of a shared index (``kvfabric node --index NAME``)."""

    def __init__(self, index: IndexPlugin, where: str, *, owns_index: bool = True) -> None:
        """``owns_index``: close the index with the membership (False when the process
        uses the same index object for other things, as an embedded store does)."""
        if not type(index).shared:
            raise ConfigError(
                f"index {type(index).name!r} lives inside one process and is served by a "
                "controller: run `kvfabric controller --index ...` and point nodes at it with "
                "--controller; only a shared index (e.g. redis) takes nodes directly"
            )
        self.where = where
        self._index = index
        self._owns_index = owns_index

    def register(self, info: NodeInfo) -> NodeInfo:
        return self._index.register_node(info)

    def restore(self, info: NodeInfo, records: np.ndarray) -> int:
        kept = 0
        for start in range(0, len(records), RESTORE_BATCH):
            batch = Descriptor.many_from_bytes(records[start : start + RESTORE_BATCH].tobytes())
            kept += self._index.restore(info.id, batch)
        return kept

    def restore_done(self, info: NodeInfo) -> None:
        self._index.restore_done(info.id)

    def heartbeat(self, info: NodeInfo, counters: dict[str, int]) -> bool:
        alive = self._index.heartbeat(info.id, info.incarnation)
        self._index.tick()
        return alive

    def deregister(self, info: NodeInfo) -> None:
        self._index.remove_node(info.id)

    def close(self) -> None:
        if self._owns_index:
            self._index.close()
