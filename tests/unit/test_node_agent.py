"""A node whose registration was taken, then lost before it was complete, scans its memory
when it registers again: clients may have written to it meanwhile.

The real case is a Redis restarted empty while a node's arenas were being made ready
(``test_a_redis_restarted_empty_gets_the_nodes_and_their_records_back`` meets it in about 1
run in 10, and lost the node's records from the new registry before). Here the moment is
made exact: the membership is a stand-in that registers in a real memory index and then
raises what the redis index raises, once.
"""

from __future__ import annotations

import threading

import numpy as np

from kvfabric._node.agent import NodeAgent
from kvfabric._node.membership import Membership
from kvfabric._node.node import DataNode
from kvfabric.errors import RegistrationInterruptedError
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.spi import BackendConfig, TransportConfig
from kvfabric.spi.index import NodeInfo

_WAIT = 10.0


class _InterruptedOnce(Membership):
    """Registers in a real memory index; the first registration is then "lost"."""

    where = "the stand-in index"

    def __init__(self, node: DataNode) -> None:
        self.index = MemoryIndex(lease=30.0, grace=0.0, headroom=0.0)
        self.node = node
        self.scanned: list[bool] = []  # per registration: would the agent have scanned?
        self.registrations: list[NodeInfo] = []
        self.registered = threading.Event()

    def register(self, info: NodeInfo) -> NodeInfo:
        # The agent scans before it registers exactly when the node may hold records.
        self.scanned.append(self.node.may_hold_records())
        registered = self.index.register_node(info)
        self.registrations.append(info)
        if len(self.registrations) == 1:
            raise RegistrationInterruptedError("registered, then the index was lost")
        self.registered.set()
        return registered

    def restore(self, info: NodeInfo, records: np.ndarray) -> int:
        return 0

    def restore_done(self, info: NodeInfo) -> None:
        pass

    def heartbeat(self, info: NodeInfo, counters: dict[str, int]) -> bool:
        return True

    def deregister(self, info: NodeInfo) -> None:
        pass


def test_an_interrupted_registration_makes_the_next_one_scan_the_memory() -> None:
    node = DataNode.create(
        backend="dram",
        transports=["tcp"],
        backend_config=BackendConfig(capacity=8 << 20, region_size=4 << 20),
        transport_config=TransportConfig(),
    )
    membership = _InterruptedOnce(node)
    agent = NodeAgent(node, membership, heartbeat=0.05)
    try:
        agent.start()
        assert membership.registered.wait(_WAIT)
        assert agent.wait_registered(_WAIT) is not None
        # Fresh memory: the first registration skips the scan; after it was interrupted,
        # the second one scans.
        assert membership.scanned == [False, True]
    finally:
        agent.stop(deregister=False)
        node.close()
