"""The node agent: keeps a data node known to its controller (or shared index).

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

Losing the controller (or the shared index) is said at once: the first heartbeat that gets
no answer logs a warning naming the cause (no answer, or an authentication failure), later
ones a line a minute, and the first call answered again logs the recovery and how long it
was away. :attr:`NodeAgent.in_service` (the node's ``registered`` gauge, its readiness) is
true only while the node is registered and its last call was answered.
"""

from __future__ import annotations

import logging
import threading
import time

from kvfabric._node.membership import Membership
from kvfabric._node.node import DataNode
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.errors import (
    ControllerUnavailableError,
    KvfabricError,
    NameInUseError,
    RegistrationInterruptedError,
)
from kvfabric.spi.index import NodeInfo
from kvfabric.spi.units import format_size

__all__ = ["LOST_NOTICE_EVERY", "NodeAgent"]

log = logging.getLogger("kvfabric._node.node")

LOST_NOTICE_EVERY = 60.0
"""Seconds between the warnings of a node whose controller (or index) stays away."""


class NodeAgent:
    def __init__(self, node: DataNode, membership: Membership, *, heartbeat: float = 1.0) -> None:
        self.node = node
        self.heartbeat = heartbeat
        self.membership = membership
        self.registered: NodeInfo | None = None
        self.lost_since: float | None = None
        """When calls to the controller (or index) started failing (monotonic); None while
        it answers."""
        self.last_failure = ""
        """Why the last failing call failed, for logs and readiness."""
        self.failed_calls = 0
        """Heartbeats and registrations that got no answer, since the start."""
        self._lost_warned = False
        self._was_registered = False
        self._next_notice = 0.0
        # What repeats every heartbeat while it lasts (a name in use, an error reply):
        # a line a minute, with a count of the rest.
        self._limited = LimitedLog(log)
        membership.on_reset = self._forget_registration
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvfabric-agent", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def in_service(self) -> bool:
        """Registered, and the controller (or index) answered the last call."""
        return self.registered is not None and self.lost_since is None

    def _answered(self) -> None:
        """A call was answered: log the recovery if calls had been failing."""
        lost_since = self.lost_since
        self.lost_since = None
        if lost_since is not None and self._lost_warned:
            self._lost_warned = False
            log.warning(
                "%s answers again, after %.1f s without an answer",
                self.membership.where,
                time.monotonic() - lost_since,
            )

    def _unanswered(self, exc: ControllerUnavailableError) -> None:
        """A call got no answer: warn at once the first time, then a line a minute."""
        self.failed_calls += 1
        self.last_failure = str(exc)
        now = time.monotonic()
        if self.lost_since is None:
            self.lost_since = now
            self._next_notice = now + LOST_NOTICE_EVERY
            if not self._was_registered:
                # Still starting: the command's waiting notices say so.
                log.debug("%s unavailable: %s", self.membership.where, exc)
                return
            self._lost_warned = True
            log.warning(
                "lost %s: %s; the node keeps serving, but its clients' lookups and puts "
                "miss until it is back (retrying every %gs)",
                self.membership.where,
                exc,
                self.heartbeat,
            )
        elif self._lost_warned and now >= self._next_notice:
            self._next_notice = now + LOST_NOTICE_EVERY
            log.warning(
                "still no answer from %s after %.0f s: %s",
                self.membership.where,
                now - self.lost_since,
                exc,
            )
        else:
            log.debug("%s unavailable: %s", self.membership.where, exc)

    def wait_registered(self, timeout: float) -> NodeInfo | None:
        with self._changed:
            self._changed.wait_for(lambda: self.registered is not None, timeout)
            return self.registered

    def _forget_registration(self) -> None:
        log.warning("%s restarted: registering again", self.membership.where)
        self.registered = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                registered = self.registered
                if registered is None:
                    self._register()
                    self._answered()
                else:
                    known = self.membership.heartbeat(registered, self.node.stats())
                    self._answered()
                    if not known:
                        log.warning(
                            "%s forgot node %s: registering again",
                            self.membership.where,
                            self.node.name,
                        )
                        self.registered = None
                        continue
            except NameInUseError as exc:
                self._limited.warning("name in use", "%s; waiting", exc)
            except RegistrationInterruptedError as exc:
                # Clients may have written to this node meanwhile: its next registration
                # scans its memory and reports what it finds, as after any restart.
                self.node.mark_registered()
                log.warning("%s; registering again", exc)
            except ControllerUnavailableError as exc:
                self._unanswered(exc)
            except KvfabricError as exc:
                self._limited.error(type(exc).__name__, "node agent: %s", exc)
            self._stop.wait(self.heartbeat)

    def stats(self) -> dict[str, int]:
        """The node's counters, with whether it is in service (``registered``: 1 while it
        is registered and its controller or index answers) and the calls that got no
        answer."""
        return {
            **self.node.stats(),
            "registered": int(self.in_service),
            "heartbeat_failures": self.failed_calls,
        }

    def _register(self) -> None:
        scan = self.node.scan() if self.node.may_hold_records() else self.node.empty_scan()
        if len(scan.records) or scan.torn:
            log.info(
                "found %d records in %s of memory in %.2fs (%d torn, dropped)",
                len(scan.records),
                format_size(scan.scanned_bytes),
                scan.seconds,
                scan.torn,
            )
        restoring = len(scan.records) > 0
        info = self.membership.register(self.node.info(restoring=restoring))
        if restoring:
            kept = self.membership.restore(info, scan.addressed(info))
            self.membership.restore_done(info)
            log.info(
                "restored %d of %d records (the rest: keys already stored elsewhere)",
                kept,
                len(scan.records),
            )
        self.node.mark_registered()
        self._was_registered = True
        with self._changed:
            self.registered = info
            self._changed.notify_all()
        log.info(
            "registered as node %d (incarnation %d) with %s",
            info.id,
            info.incarnation,
            self.membership.where,
        )

    def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating and, unless told not to, deregister the node.

        Deregistering is one bounded call (none when no connection to the controller is up,
        e.g. it stopped first in ``serve``); if it fails, the node is dropped after missed
        heartbeats as before. Pass ``deregister=False`` when the service is known gone.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        registered = self.registered
        # After the join: a heartbeat racing the deregistration would register us again.
        if deregister and registered is not None and not self._thread.is_alive():
            try:
                self.membership.deregister(registered)
                log.info("deregistered node %d", registered.id)
            except KvfabricError as exc:
                # Best effort: the node is dropped after missed heartbeats anyway.
                log.info("could not deregister node %d (%s)", registered.id, exc)
            self.registered = None
        self.membership.close()
