"""A controller's tenants: who sent each frame, what it may ask, and each tenant's account.

With ``--tenants FILE`` the controller's ZAP handler admits the deployment's client key
(data nodes, and clients without a tenant: the operator's) and each tenant's. ZeroMQ hands
the controller, with every frame, the public key its connection's CurveZMQ handshake proved
(the ``User-Id`` ZAP gave it); the gate maps that key to its tenant. So the tenant is never
something the client claims in a frame, and a tenant's frames go to that tenant's handlers
only: the clients' requests, through a :class:`~kvfabric._control.tenant_index.TenantIndexView`
(its own namespace and quota). Everything else — a data node's requests, stats, extents —
is refused ``FORBIDDEN``.

Upkeep at each tick: grants whose lease ended stop counting, values past a tenant's ``ttl``
are removed, and after anything that may have removed a tenant's values behind its back
(the index evicting under capacity pressure, the nodes changing) the tenants' accounts are
checked against the index, at most once a second. A stats read checks them first too, so
what ``kvfabric stats`` shows per tenant (scope ``tenant NAME``) is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import zmq

from kvfabric._control.client_requests import ClientRequests
from kvfabric._control.image_publisher import ImagePublisher
from kvfabric._control.refusal import Handler, Refusal
from kvfabric._control.reservations import Reservations
from kvfabric._control.tenant_config import TenantSpec
from kvfabric._control.tenant_index import TenantIndexView
from kvfabric._control.tenant_keys import TAG
from kvfabric._control.tenant_ledger import TenantLedger
from kvfabric._runtime.codec import Reader
from kvfabric._runtime.record import HEADER_SIZE
from kvfabric._wire.protocol import ErrorCode, MsgType
from kvfabric.descriptor import Descriptor
from kvfabric.spi.index import IndexPlugin

__all__ = ["TenantGate"]

_RECONCILE_EVERY = 1.0
"""Seconds between checks of the tenants' accounts against the index (when one is due)."""
_CHECK_BATCH = 65536
"""Keys asked of the index at a time when an account is checked."""


@attrs.define
class _Tenant:
    spec: TenantSpec
    ledger: TenantLedger
    view: TenantIndexView | None = None
    handlers: dict[int, Handler] = attrs.field(factory=dict)


class TenantGate:
    """The tenants one controller serves."""

    def __init__(self, specs: Sequence[TenantSpec]) -> None:
        self._tenants = [_Tenant(spec, TenantLedger(spec.quota, spec.ttl)) for spec in specs]
        self._by_user = {t.spec.keys.client_public.decode(): t for t in self._tenants}
        self._by_tag = {t.spec.keys.tag: t for t in self._tenants}
        self._index: IndexPlugin | None = None
        self._nodes_generation = -1
        self._due = False
        self._next_check = 0.0

    @property
    def names(self) -> list[str]:
        return [t.spec.name for t in self._tenants]

    def client_keys(self) -> set[bytes]:
        """The tenants' Curve public keys (z85), for the ZAP handler to admit."""
        return set(t.spec.keys.client_public for t in self._tenants)

    def bind(self, index: IndexPlugin, image: ImagePublisher, reservations: Reservations) -> None:
        """Make each tenant's handlers, over ``index``."""
        self._index = index
        for tenant in self._tenants:
            tenant.view = TenantIndexView(index, tenant.spec.keys.tag, tenant.ledger)
            allowed = ClientRequests(cast(IndexPlugin, tenant.view), image, reservations)
            tenant.handlers = {t: _forbidden(MsgType(t)) for t in MsgType}
            tenant.handlers.update(allowed.handlers)
            for refused in (MsgType.LEASE_EXTENTS, MsgType.PUBLISH_CARVED):
                tenant.handlers[refused] = _forbidden(refused)

    def observe_restores(self, index: IndexPlugin) -> IndexPlugin:
        """``index`` as the data nodes' handlers should use it: records a node restores
        after a controller restart are counted to the tenant whose tag their key ends
        with."""
        return cast(IndexPlugin, _RestoreObserver(index, self))

    # -- per frame ------------------------------------------------------------------------

    def receive(self, sock: zmq.Socket[bytes]) -> tuple[list[bytes], dict[int, Handler] | None]:
        """One message from the ROUTER, and the handlers of its sender's tenant (None:
        the deployment's own credential, served as without tenants)."""
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        tenant = None
        if frames:
            try:
                tenant = self._by_user.get(str(frames[-1].get("User-Id")))
            except zmq.ZMQError:
                tenant = None
        return [f.bytes for f in frames], (tenant.handlers if tenant is not None else None)

    # -- upkeep -----------------------------------------------------------------------------

    def restored(self, records: Sequence[Descriptor]) -> None:
        by_tag = self._by_tag
        for record in records:
            tenant = by_tag.get(record.key[TAG])
            if tenant is not None:
                tenant.ledger.restored(record.key, HEADER_SIZE + record.length)

    def tick(self, nodes_generation: int) -> None:
        index = self._index
        if index is None:
            return
        now = time.monotonic()
        for tenant in self._tenants:
            ledger = tenant.ledger
            ledger.expire_leases(now)
            expired = ledger.expired(now)
            if expired:
                index.unpublish(expired)
                ledger.forget(expired)
                ledger.counters["ttl_expirations"] += len(expired)
            if tenant.view is not None and tenant.view.evicted_elsewhere:
                tenant.view.evicted_elsewhere = False
                self._due = True
        if nodes_generation != self._nodes_generation:
            self._nodes_generation = nodes_generation
            self._due = True
        if self._due and now >= self._next_check:
            self.reconcile()

    def reconcile(self) -> None:
        """Stop counting what the index no longer holds."""
        index = self._index
        if index is None:
            return
        self._due = False
        self._next_check = time.monotonic() + _RECONCILE_EVERY
        for tenant in self._tenants:
            keys = tenant.ledger.keys()
            for start in range(0, len(keys), _CHECK_BATCH):
                batch = keys[start : start + _CHECK_BATCH]
                present = index.exists(batch)
                tenant.ledger.forget(
                    k for k, there in zip(batch, present, strict=True) if not there
                )

    def stats_scopes(self) -> dict[str, dict[str, int]]:
        self.reconcile()
        return {f"tenant {t.spec.name}": t.ledger.stats() for t in self._tenants}


def _forbidden(msg_type: MsgType) -> Handler:
    def refuse(r: Reader) -> Callable[[], bytes]:
        raise Refusal(
            ErrorCode.FORBIDDEN,
            f"{msg_type.name} is not a request a tenant's client may make",
        )

    return refuse


class _RestoreObserver:
    """The index, with each restore also counted to its tenants."""

    def __init__(self, index: IndexPlugin, gate: TenantGate) -> None:
        self._index = index
        self._gate = gate

    def restore(self, node: int, records: Sequence[Descriptor]) -> int:
        restored = self._index.restore(node, records)
        self._gate.restored(records)
        return restored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)
