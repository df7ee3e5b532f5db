"""``embedded://[NAME]``: index, one data node and clients in the caller's process.

The default for the demo and for unit tests: no sockets. The node's memory is real
shareable memory and the client reads it through a real transport (``shm`` unless told
otherwise), so embedded mode runs the same read, validation and dedup paths as a
distributed deployment. Clients connecting with the same NAME share one index and node.

With the ``file`` backend (``embedded://?backend=file&path=DIR``) the node's memory outlives
the process: a store opened again on the same directory, by this process or a new one,
scans the files and finds every record that validates.

Lookups probe the index's lookup image in place, as a client on a controller's host does
(``?memory.image=0``: none, every lookup is a call into the index).

After ``os.fork()`` the index and the node stay the parent's, and a store the child inherited
makes its own parts on first use there. With a shared index (``index=redis``) the child is
one more client of it, reading and writing the parent's node as any process may. A private
index lives in the parent's memory: a child writing into the node's shared regions by its
own copy of it would overwrite the parent's records, so the child gets an embedded store of
its own instead (the same options, empty; one per NAME, shared by the child's stores of that
name), and the parent's is left untouched. With a private index and a backend whose records
outlive the process (``file``), the files are the parent's: the inherited store refuses to
be used in the child, with an error that says what to do instead.
"""

from __future__ import annotations

import threading

import attrs

from kvfabric._client.image_reader import ImageReader, MappedImage
from kvfabric._client.record_io import RecordIO
from kvfabric._client.shared_index import client_parts
from kvfabric._client.store import Store, StoreParts
from kvfabric._node.agent import NodeAgent
from kvfabric._node.capacity import check_capacity
from kvfabric._node.membership import IndexMembership
from kvfabric._node.node import DataNode
from kvfabric._plugins import PluginManager, PluginOptions
from kvfabric._runtime import forks
from kvfabric._runtime.image import ImageGeometry
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ConfigError, ControllerUnavailableError, NotSupportedError
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.index import IndexConfig, IndexPlugin
from kvfabric.spi.transport import TransportConfig
from kvfabric.urls import EmbeddedOptions

__all__ = ["open_embedded"]

# Options that shape the shared services rather than one client.
_SERVICE_OPTIONS = (
    "capacity",
    "backend",
    "path",
    "index",
    "region_size",
    "lease",
    "grace",
    "headroom",
    "replicas",
    "transport",
    "plugin_options",
)


@attrs.define
class _Services:
    index: IndexPlugin
    node: DataNode
    options: tuple[object, ...]
    agent: NodeAgent | None = None
    """Keeps the node registered with a shared index (none for a private one)."""
    clients: int = 0


_REGISTER_WAIT = 30.0
"""Seconds an embedded node may take to register with a shared index."""


_shared: dict[str, _Services] = {}
_shared_lock = threading.Lock()


def _forget_inherited_services() -> None:
    """In a forked child: the services open by name are the parent's (their index lives in
    the parent's memory, their node's regions are the parent's): a name opened here starts
    its own."""
    global _shared, _shared_lock
    forks.abandon(_shared)
    _shared = {}
    _shared_lock = threading.Lock()


forks.in_child(_forget_inherited_services)


def open_embedded(options: EmbeddedOptions, name: str, plugins: PluginManager) -> Store:
    transport_name = options.transport or "shm"
    transport_cls = plugins.transport(transport_name)
    settings = PluginOptions(options.plugin_options)
    config = TransportConfig(timeout=options.timeout, options=settings.claim(transport_cls))
    service_options = tuple(getattr(options, o) for o in _SERVICE_OPTIONS)
    backend = plugins.backend(options.backend)
    index_cls = plugins.index(options.index)
    born = forks.generation()

    def open_parts(store: Store) -> StoreParts:
        if forks.generation() != born:
            if index_cls.shared:
                # Forked: the node stays the parent's, registered with the shared index; the
                # child is one more client of that index, as any process could be.
                index = index_cls.create(_index_config(options, index_cls, settings))
                try:
                    client = transport_cls.create_client(config)
                except BaseException:
                    index.close()
                    raise
                records = RecordIO(
                    {transport_name: client}, [transport_name], node_backoff=options.node_backoff
                )
                return client_parts(index, records, store)
            if backend.persistent:
                raise NotSupportedError(
                    f"this embedded store keeps its records in {options.backend} files that "
                    f"belong to the process that opened it, not to this forked child: "
                    f"connect in the child (with a path= of its own), or share one node "
                    f"(kvfabric serve) through kvfabric://"
                )
        with _shared_lock:
            services = _shared.get(name) if name else None
            if services is None:
                services = _start(
                    options, transport_name, config, plugins, settings, service_options
                )
                if name:
                    _shared[name] = services
            elif services.options != service_options:
                raise ConfigError(
                    f"embedded://{name} is already open with other "
                    f"{'/'.join(_SERVICE_OPTIONS)}; connect with the same ones"
                )
            services.clients += 1
        try:
            records = RecordIO(
                {transport_name: transport_cls.create_client(config)},
                [transport_name],
                node_backoff=options.node_backoff,
            )
            return StoreParts(
                index=services.index,
                records=records,
                on_close=[lambda: _release(name, services)],
                local_node=services.node,
                local_index=services.index,
                image=_image_of(services.index) if options.lookup_image else None,
            )
        except BaseException:
            _release(name, services)
            raise

    return Store(options=options, plugins=plugins, opener=open_parts)


def _start(
    options: EmbeddedOptions,
    transport_name: str,
    config: TransportConfig,
    plugins: PluginManager,
    settings: PluginOptions,
    service_options: tuple[object, ...],
) -> _Services:
    index_cls = plugins.index(options.index)
    index_cls.check_replicas(options.replicas)
    index_config = _index_config(options, index_cls, settings)
    region_size = min(options.region_size, options.capacity)
    check_capacity(
        options.capacity,
        region_size,
        plugins.backend(options.backend),
        option="capacity",
        region_option="region_size",
    )
    node = DataNode.create(
        backend=options.backend,
        transports=[transport_name],
        backend_config=BackendConfig(
            capacity=options.capacity, region_size=region_size, path=options.path
        ),
        transport_config=config,
        plugins=plugins,
        plugin_options=settings,
    )
    try:
        index = index_cls.create(index_config)
    except BaseException:
        node.close()
        raise
    agent: NodeAgent | None = None
    try:
        if index_cls.shared:
            # Others use this index too and drop nodes that stop heartbeating: the node
            # joins it as any node does, through an agent.
            agent = NodeAgent(
                node, IndexMembership(index, f"the {index_cls.name} index", owns_index=False)
            )
            agent.start()
            if agent.wait_registered(_REGISTER_WAIT) is None:
                raise ControllerUnavailableError(
                    f"the embedded node could not register with the {index_cls.name} index"
                )
        else:
            _register(index, node)
    except BaseException:
        if agent is not None:
            agent.stop()
        index.close()
        node.close()
        raise
    return _Services(index=index, node=node, options=service_options, agent=agent)


def _index_config(
    options: EmbeddedOptions, index_cls: type[IndexPlugin], settings: PluginOptions
) -> IndexConfig:
    return IndexConfig(
        lease=options.lease,
        grace=options.grace,
        headroom=options.headroom,
        options=settings.claim(index_cls),
        replicas=options.replicas,
    )


def _register(index: IndexPlugin, node: DataNode) -> None:
    """Register the node with its private index, with the records it already holds (a
    file-backed node, or any memory that outlived a store)."""
    scan = node.scan() if node.may_hold_records() else node.empty_scan()
    restoring = len(scan.records) > 0
    registered = index.register_node(node.info(restoring=restoring))
    if restoring:
        records = Descriptor.many_from_bytes(scan.addressed(registered).tobytes())
        index.restore(registered.id, records)
        index.restore_done(registered.id)
    node.mark_registered()


def _image_of(index: IndexPlugin) -> ImageReader | None:
    """The index's own lookup image, probed in place (it lives in this process, so no
    heartbeat check), or None if the index keeps none."""
    region = index.lookup_image()
    if region is None:
        return None
    return MappedImage(region.view, ImageGeometry.from_header(region.view).image_id)


def _release(name: str, services: _Services) -> None:
    with _shared_lock:
        services.clients -= 1
        if services.clients > 0:
            return
        if name and _shared.get(name) is services:
            del _shared[name]
    if services.agent is not None:
        services.agent.stop()
    services.index.close()
    services.node.close()
