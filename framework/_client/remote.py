"""``kvfabric://HOST:PORT``: a client of a controller and its data nodes.

Metadata goes to the controller (one round trip per batched call); bytes go straight to the
data nodes, each over the most preferred transport both sides have that can reach it (each
transport declares its ``preference``: ``shm`` on the same host, else ``tcp``, then ``ucx``).
``?transport=NAME`` forces one.

Lookups read the controller's lookup image where it serves one: mapped on its host (unless
a transport other than ``shm`` is forced), else through the same transport clients as the
data nodes, the image being one more peer.

``kvfabric://HOST:PORT?index=NAME`` uses a *shared* index plugin (e.g. ``redis``) at
HOST:PORT directly instead: no controller, the plugin's own round trips
(:mod:`kvfabric._client.shared_index`).
"""

from __future__ import annotations

import logging

import attrs

from kvfabric._client.image_reader import ImageReader, could_read, open_image
from kvfabric._client.record_io import RecordIO
from kvfabric._client.shared_index import IndexUpkeep, check_shared
from kvfabric._client.store import Store
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._control.security import Credentials, load_secret
from kvfabric._plugins import PluginManager, PluginOptions
from kvfabric.errors import KvfabricError
from kvfabric.spi.index import IndexConfig
from kvfabric.spi.transport import Transport, TransportClient, TransportConfig
from kvfabric.urls import RemoteOptions

__all__ = ["open_remote"]

log = logging.getLogger("kvfabric")


def open_remote(options: RemoteOptions, host: str, port: int, plugins: PluginManager) -> Store:
    secret = load_secret(options.secret_file)
    credentials = Credentials.from_secret(secret) if secret else None
    config = TransportConfig(
        timeout=options.timeout, token=credentials.data_token if credentials else b""
    )
    settings = PluginOptions(options.plugin_options)
    clients = _transport_clients(options, plugins, config, settings)
    if options.index:
        return _open_shared(options, host, port, plugins, clients, settings)
    settings.check_all_claimed("store")
    control = ControlClient(
        f"tcp://{host}:{port}",
        timeout=options.control_timeout,
        retry_interval=options.retry_interval,
        credentials=credentials,
    )
    index = RemoteIndex(control)
    map_locally = options.transport in (None, "shm")

    def locate_image() -> tuple[ImageReader | None, bool]:
        location = index.image_location()
        if location is None:
            return None, False
        reader = open_image(location, clients, map_locally=map_locally)
        return reader, reader is None and could_read(location, clients)

    try:
        store = Store(
            index=index,
            records=RecordIO(clients, list(clients)),
            options=options,
            plugins=plugins,
            on_close=[control.close],
            locate_image=locate_image if options.lookup_image else None,
        )
    except BaseException:
        control.close()
        for client in clients.values():
            client.close()
        raise
    control.on_epoch_change = store.controller_restarted
    control.on_membership_change = store.membership_changed
    return store


def _open_shared(
    options: RemoteOptions,
    host: str,
    port: int,
    plugins: PluginManager,
    clients: dict[str, TransportClient],
    settings: PluginOptions,
) -> Store:
    assert options.index is not None
    try:
        cls = plugins.index(options.index)
        check_shared(cls)
        cls.check_replicas(options.replicas)
        config = IndexConfig(
            options=settings.claim(cls), address=f"{host}:{port}", replicas=options.replicas
        )
        settings.check_all_claimed("store")
        index = cls.create(config)
    except BaseException:
        for client in clients.values():
            client.close()
        raise
    upkeep: list[IndexUpkeep] = []

    def stop_upkeep() -> None:
        for job in upkeep:
            job.stop()

    try:
        store = Store(
            index=index,
            records=RecordIO(clients, list(clients)),
            options=options,
            plugins=plugins,
            # Run in reverse: the upkeep stops before the index closes under it.
            on_close=[index.close, stop_upkeep],
        )
    except BaseException:
        index.close()
        for client in clients.values():
            client.close()
        raise
    upkeep.append(IndexUpkeep(index, store))
    return store


def _transport_clients(
    options: RemoteOptions,
    plugins: PluginManager,
    config: TransportConfig,
    settings: PluginOptions,
) -> dict[str, TransportClient]:
    """A client of every transport usable here, most preferred first (or the forced one).

    Per node, the data plane then uses the first of these that the node also serves and that
    can reach it. A third-party transport takes part through its declared ``preference``.
    """
    if options.transport:
        forced = plugins.transport(options.transport)
        return {forced.name: forced.create_client(_configured(config, forced, settings))}
    clients: dict[str, TransportClient] = {}
    for cls in plugins.installed_transports():
        # Outside the try: a bad NAME.OPTION is the user's mistake, not "unusable here".
        configured = _configured(config, cls, settings)
        try:
            clients[cls.name] = cls.create_client(configured)
        except KvfabricError as exc:
            log.debug("transport %s not usable here: %s", cls.name, exc)
    return clients


def _configured(
    config: TransportConfig, cls: type[Transport], settings: PluginOptions
) -> TransportConfig:
    return attrs.evolve(config, options=settings.claim(cls))
