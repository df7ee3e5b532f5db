"""``kvfabric://HOST:PORT``: a client of a controller and its data nodes.

Metadata goes to the controller (one round trip per batched call); bytes go straight to the
data nodes, each over the best transport both sides have: ``shm`` when the node is on this
host, else the next one in preference order. ``?transport=NAME`` forces one.
"""

from __future__ import annotations

import logging

from kvfabric._client.dataplane import DataPlane
from kvfabric._client.store import Store
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._control.security import Credentials, load_secret
from kvfabric.errors import KvfabricError
from kvfabric.options import RemoteOptions
from kvfabric.spi.plugins import PluginManager, installed_plugins
from kvfabric.spi.transport import TransportClient, TransportConfig

__all__ = ["PREFERENCE", "open_remote"]

log = logging.getLogger("kvfabric")

PREFERENCE = ("shm", "verbs", "tcp", "ucx")
"""Built-in transports, best first; other installed ones are used only when forced.

``ucx`` comes after ``tcp``: from here kvfabric cannot tell whether UCX would reach a node
over RDMA or emulate RMA over TCP, and emulated UCX is slower than kvfabric's own ``tcp`` and
exposed to a UCX bug that can abort the node when a client dies (see docs/ucx.md). On an RDMA
fabric, ask for it: ``?transport=ucx``."""


def open_remote(options: RemoteOptions, host: str, port: int, plugins: PluginManager) -> Store:
    secret = load_secret(options.secret_file)
    credentials = Credentials.from_secret(secret) if secret else None
    config = TransportConfig(
        timeout=options.timeout, token=credentials.data_token if credentials else b""
    )
    clients = _transport_clients(options, plugins, config)
    control = ControlClient(
        f"tcp://{host}:{port}",
        timeout=options.control_timeout,
        retry_interval=options.retry_interval,
        credentials=credentials,
    )
    try:
        store = Store(
            index=RemoteIndex(control),
            data=DataPlane(clients, list(clients)),
            options=options,
            plugins=plugins,
            on_close=[control.close],
        )
    except BaseException:
        control.close()
        for client in clients.values():
            client.close()
        raise
    control.on_epoch_change = store.controller_restarted
    return store


def _transport_clients(
    options: RemoteOptions, plugins: PluginManager, config: TransportConfig
) -> dict[str, TransportClient]:
    if options.transport:
        return {options.transport: plugins.transport(options.transport).create_client(config)}
    installed = {p.name for p in installed_plugins("transport")}
    clients: dict[str, TransportClient] = {}
    for name in PREFERENCE:
        if name not in installed:
            continue
        try:
            clients[name] = plugins.transport(name).create_client(config)
        except KvfabricError as exc:
            log.debug("transport %s not usable here: %s", name, exc)
    return clients
