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

``?tenant=NAME`` connects as a tenant (:mod:`kvfabric._client.tenant_store`): with that
tenant's secret and the controller's public key, never with a shared index.

The plugins and their options are chosen once, when the store connects; what they make (the
control client, the transport clients, a shared index's client) is made again in a child the
store was forked into, by the same functions, without the plugin manager.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import attrs

from kvfabric._client.image_reader import ImageReader, could_read, open_image
from kvfabric._client.record_io import RecordIO
from kvfabric._client.shared_index import check_shared, client_parts
from kvfabric._client.store import Opener, Store, StoreParts
from kvfabric._client.tenant_store import TenantStore
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._control.security import Credentials, load_secret
from kvfabric._control.tenant_keys import TenantKeys, valid_tenant_name
from kvfabric._plugins import PluginManager, PluginOptions
from kvfabric.errors import ConfigError, KvfabricError
from kvfabric.spi.index import IndexConfig
from kvfabric.spi.transport import Transport, TransportClient, TransportConfig
from kvfabric.urls import RemoteOptions

__all__ = ["open_remote"]

log = logging.getLogger("kvfabric")


def open_remote(options: RemoteOptions, host: str, port: int, plugins: PluginManager) -> Store:
    tenant = _tenant_keys(options)
    if tenant is not None:
        assert options.controller_key is not None
        credentials: Credentials | None = tenant.client_credentials(options.controller_key)
        # Extents are leased to no tenant (its puts allocate per batch), and the lookup
        # image, every tenant's, is not read to it (it asks the controller, which keeps
        # tenants apart).
        options = attrs.evolve(options, extents=False, lookup_image=False)
    else:
        secret = load_secret(options.secret_file)
        credentials = Credentials.from_secret(secret) if secret else None
    config = TransportConfig(
        timeout=options.timeout, token=credentials.data_token if credentials else b""
    )
    settings = PluginOptions(options.plugin_options)
    transports = _transports(options, plugins, config, settings)
    opener: Opener
    if options.index:
        opener = _shared_opener(options, host, port, plugins, transports, settings)
    else:
        settings.check_all_claimed("store")
        opener = functools.partial(
            _open_controlled, options, f"tcp://{host}:{port}", credentials, transports
        )
    if tenant is not None:
        return TenantStore(options=options, plugins=plugins, opener=opener, tenant=tenant)
    return Store(options=options, plugins=plugins, opener=opener)


def _tenant_keys(options: RemoteOptions) -> TenantKeys | None:
    """``tenant=NAME``'s keys from its secret; None without a tenant. A tenant needs its
    secret and the controller's key, and a controller: a shared index has no one to hold
    tenants apart."""
    if options.tenant is None:
        if options.controller_key is not None:
            raise ConfigError("controller_key= is for a tenant's client (with tenant=NAME)")
        return None
    name = valid_tenant_name(options.tenant)
    if options.index:
        raise ConfigError(
            f"tenant={name} with index={options.index}: tenants are served by a controller "
            "(kvfabric controller --tenants FILE), which keeps them apart; a shared index is "
            "used by its clients directly and cannot. Connect to the controller instead"
        )
    if not options.secret_file:
        raise ConfigError(f"tenant={name} needs the tenant's secret: secret_file=FILE")
    if not options.controller_key:
        raise ConfigError(
            f"tenant={name} needs controller_key=KEY: the controller's public key, which it "
            "prints at start"
        )
    secret = load_secret(options.secret_file)
    assert secret is not None
    return TenantKeys.from_secret(name, secret)


def _open_controlled(
    options: RemoteOptions,
    endpoint: str,
    credentials: Credentials | None,
    transports: Sequence[_Configured],
    store: Store,
) -> StoreParts:
    """The parts of a store whose index a controller serves, made in this process."""
    clients = _transport_clients(options, transports)
    try:
        control = ControlClient(
            endpoint,
            timeout=options.control_timeout,
            retry_interval=options.retry_interval,
            credentials=credentials,
            on_epoch_change=store.controller_restarted,
            on_membership_change=store.membership_changed,
        )
    except BaseException:
        for client in clients.values():
            client.close()
        raise
    index = RemoteIndex(control)
    map_locally = options.transport in (None, "shm")

    def locate_image() -> tuple[ImageReader | None, bool]:
        location = index.image_location()
        if location is None:
            return None, False
        reader = open_image(location, clients, map_locally=map_locally)
        return reader, reader is None and could_read(location, clients)

    return StoreParts(
        index=index,
        records=RecordIO(clients, list(clients), node_backoff=options.node_backoff),
        on_close=[control.close],
        locate_image=locate_image if options.lookup_image else None,
        report_usage=index.report_usage,
        report_interval=options.report_interval,
    )


def _shared_opener(
    options: RemoteOptions,
    host: str,
    port: int,
    plugins: PluginManager,
    transports: Sequence[_Configured],
    settings: PluginOptions,
) -> Opener:
    """Checks the shared index plugin and its options now; what it returns makes the parts
    (once here, again in a forked child)."""
    assert options.index is not None
    cls = plugins.index(options.index)
    check_shared(cls)
    cls.check_replicas(options.replicas)
    config = IndexConfig(
        options=settings.claim(cls), address=f"{host}:{port}", replicas=options.replicas
    )
    settings.check_all_claimed("store")

    def open_shared(store: Store) -> StoreParts:
        clients = _transport_clients(options, transports)
        try:
            index = cls.create(config)
        except BaseException:
            for client in clients.values():
                client.close()
            raise
        records = RecordIO(clients, list(clients), node_backoff=options.node_backoff)
        return client_parts(index, records, store)

    return open_shared


@attrs.frozen
class _Configured:
    """A transport this store may use, with its options, chosen when it connected."""

    cls: type[Transport]
    config: TransportConfig


def _transports(
    options: RemoteOptions,
    plugins: PluginManager,
    config: TransportConfig,
    settings: PluginOptions,
) -> list[_Configured]:
    """Every transport installed here (or the forced one), most preferred first, with its
    options checked: chosen once, so a forked child makes its clients without the plugin
    manager."""
    if options.transport:
        forced = plugins.transport(options.transport)
        return [_Configured(forced, _configured(config, forced, settings))]
    # Outside any try: a bad NAME.OPTION is the user's mistake, not "unusable here".
    return [
        _Configured(cls, _configured(config, cls, settings))
        for cls in plugins.installed_transports()
    ]


def _transport_clients(
    options: RemoteOptions, transports: Sequence[_Configured]
) -> dict[str, TransportClient]:
    """A client of every transport usable here, most preferred first (or the forced one).

    Per node, the data plane then uses the first of these that the node also serves and that
    can reach it. A third-party transport takes part through its declared ``preference``.
    """
    if options.transport:
        (forced,) = transports
        return {forced.cls.name: forced.cls.create_client(forced.config)}
    clients: dict[str, TransportClient] = {}
    for transport in transports:
        try:
            clients[transport.cls.name] = transport.cls.create_client(transport.config)
        except KvfabricError as exc:
            log.debug("transport %s not usable here: %s", transport.cls.name, exc)
    return clients


def _configured(
    config: TransportConfig, cls: type[Transport], settings: PluginOptions
) -> TransportConfig:
    return attrs.evolve(config, options=settings.claim(cls))
