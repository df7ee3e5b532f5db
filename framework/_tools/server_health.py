"""The readiness checks of the server commands, as ``/readyz`` on ``--metrics-port`` reads them.

- a controller is ready once it listens and while its index's upkeep succeeds (an index
  whose store is unreachable fails its tick);
- a data node once its memory is prepared (prefaulted, files reserved), it is registered,
  and while its controller (or shared index: Redis answers its heartbeats) answers;
- ``serve`` is both.

Each check reads state its owner keeps (never calls out), so a probe answers at once
whatever is down. See :mod:`kvfabric._tools.health`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfabric._control.controller import Controller
from kvfabric._node.agent import NodeAgent
from kvfabric._tools.health import Health

__all__ = ["add_controller_checks", "add_node_checks"]


def add_controller_checks(health: Health, controller: Controller) -> None:
    def listening() -> str | None:
        return None if controller.serving.is_set() else "not listening yet"

    def index() -> str | None:
        failure = controller.index_failure
        return None if failure is None else f"the index's upkeep fails: {failure}"

    health.add("controller", listening)
    health.add("index", index)


def add_node_checks(
    health: Health, prepared: Callable[[], bool], agent: Callable[[], NodeAgent | None]
) -> None:
    """``prepared``: whether the node's memory is ready (false while it prefaults);
    ``agent``: the node's agent once there is one."""

    def memory() -> str | None:
        return None if prepared() else "preparing memory (prefault, file reservation, scan)"

    def registered() -> str | None:
        current = agent()
        if current is None or current.registered is None:
            where = current.membership.where if current is not None else "its controller"
            cause = f": {current.last_failure}" if current and current.last_failure else ""
            return f"not registered with {where} yet{cause}"
        lost_since = current.lost_since
        if lost_since is not None:
            return (
                f"no answer from {current.membership.where} for "
                f"{time.monotonic() - lost_since:.0f} s: {current.last_failure}"
            )
        return None

    health.add("memory", memory)
    health.add("registered", registered)
