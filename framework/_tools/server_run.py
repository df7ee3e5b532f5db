"""Running the server commands: ``kvfabric controller``, ``kvfabric node`` and ``kvfabric serve``.

Each prints one line on stdout once it is ready (tests and scripts wait for it) naming its
capacity and every endpoint it serves, logs to stderr, and shuts down cleanly on SIGINT or
SIGTERM. Start-up problems (a port in use, an address ZeroMQ cannot use, a capacity this
machine cannot give) are one ``kvfabric: error: ...`` line that says what to do. The parts
are built by :mod:`kvfabric._tools.server_build` from the options of
:mod:`kvfabric._tools.server_options`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import zmq

from kvfabric._control.client import ControlClient
from kvfabric._control.controller import Controller
from kvfabric._control.remote_index import fetch_stats
from kvfabric._control.security import Credentials
from kvfabric._control.tenant_config import TenantSpec
from kvfabric._control.tenant_keys import controller_key
from kvfabric._node.agent import NodeAgent
from kvfabric._node.membership import Membership
from kvfabric._node.node import DataNode
from kvfabric._runtime.bounds import check_host
from kvfabric._tools.advertise import WILDCARD_HOSTS, advertised_host
from kvfabric._tools.endpoints import listen_error
from kvfabric._tools.health import Health
from kvfabric._tools.metrics import MetricsServer, Scopes, ScopesCollector
from kvfabric._tools.server_build import (
    close_servers,
    controller_from,
    controller_membership,
    credentials_from,
    duration,
    image_servers_from,
    index_from,
    kv_events_from,
    membership_from,
    node_from,
    plugin_settings,
    tenants_from,
)
from kvfabric._tools.server_health import add_controller_checks, add_node_checks
from kvfabric.errors import ConfigError, KvfabricError
from kvfabric.spi.units import format_size

__all__ = ["configure_logging", "run_controller", "run_node", "run_serve"]

log = logging.getLogger("kvfabric._tools.server_run")

# A node that has not registered after this long says so, then again at this interval.
_FIRST_WAIT_NOTICE = 2.0
_WAIT_NOTICE_EVERY = 5.0
# How long `serve` waits for its own node to register before it gives up.
_SERVE_REGISTER_WITHIN = 30.0


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


# -- ready lines ---------------------------------------------------------------------------


def _describe(node: DataNode) -> str:
    """Capacity, backend and every transport with its address, for the ready line."""
    regions = node.backend.regions()
    capacity = sum(r.size for r in regions)
    parts = [_endpoint_words(name, server.address) for name, server in node.servers.items()]
    region_word = "region" if len(regions) == 1 else "regions"
    stats = node.stats()
    prefault_ms = stats.get("prefault_ms", 0)
    prepared = f", memory prepared in {prefault_ms / 1000:.2f}s" if prefault_ms else ""
    if stats.get("huge_page_bytes"):
        prepared += f", {format_size(stats['huge_page_bytes'])} on huge pages"
    return (
        f"{format_size(capacity)} ({capacity} bytes, {node.backend.name}, {len(regions)} "
        f"{region_word}{prepared}) over {', '.join(parts)}"
    )


def _endpoint_words(name: str, address: bytes) -> str:
    """A transport and its address as the ready lines show them."""
    text = address.decode("ascii", errors="replace")
    if name == "shm":
        return "shm (same host)"
    if text.isprintable() and "\ufffd" not in text:
        return f"{name}@{text}"
    return f"{name} ({len(address)}-byte address)"


def _image_words(controller: Controller) -> str:
    """For the ready line: where the lookup image is served."""
    image = controller.image
    if image is None:
        return "; no lookup image (lookups by RPC)"
    parts = [_endpoint_words(e.transport, e.address) for e in image.endpoints]
    return f"; lookup image over {', '.join(parts) or 'nothing'}"


def _kv_events_words(controller: Controller) -> str:
    """For the ready line: where KV events are published, if they are."""
    events = controller.kv_events
    if events is None:
        return ""
    replay = f" (replay {events.replay_endpoint})" if events.replay_endpoint else ""
    return f"; KV events on {events.endpoint}{replay}"


def _tenant_words(
    endpoint: str, credentials: Credentials | None, tenants: list[TenantSpec] | None
) -> str:
    """For the ready line: how a tenant's client connects."""
    if not tenants or credentials is None:
        return ""
    return (
        f"; tenants {', '.join(t.name for t in tenants)} connect with "
        f"kvfabric://{_host_port(endpoint)}?tenant=NAME&secret_file=FILE"
        f"&controller_key={controller_key(credentials)}"
    )


def _host_port(endpoint: str) -> str:
    """``HOST:PORT`` of ``endpoint`` as clients use it: a wildcard bind (0.0.0.0) shows
    this host's address on the default route instead."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host in WILDCARD_HOSTS:
        with contextlib.suppress(ConfigError):
            host = advertised_host(host, None, None) or host
    return f"{host}:{port}"


# -- what every server command does --------------------------------------------------------


def _stop_on_signals(stop: Callable[[], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop())


def _controller_stats(endpoint: Callable[[], str], args: argparse.Namespace) -> Scopes:
    """The controller's counters through its own STATS request, as ``kvfabric stats`` reads
    them. A client per scrape: scrapes are seconds apart and each runs on its own thread."""
    client = ControlClient(
        endpoint(),
        timeout=duration(args.metrics_timeout, "--metrics-timeout"),
        credentials=credentials_from(args),
    )
    try:
        return fetch_stats(client)
    finally:
        client.close()


@contextmanager
def _metrics(
    args: argparse.Namespace,
    fetch: Callable[[], Scopes],
    source: str,
    health: Health,
    *,
    nodes: bool = True,
    image: bool = True,
) -> Iterator[str]:
    """Serve ``fetch``'s counters, ``/healthz`` and ``/readyz`` (``health``) on
    ``--metrics-port`` if given; yields the ready-line part. ``nodes``/``image``: whether
    this process exports its nodes' and its lookup image's servers' counters (each value by
    the process that owns it)."""
    if args.metrics_port is None:
        yield ""
        return
    host = check_host(args.metrics_host, "--metrics-host")
    collector = ScopesCollector(fetch, source, nodes=nodes, image=image)
    server = MetricsServer(collector, host, args.metrics_port, health)
    try:
        yield f"; metrics at {server.url}"
    finally:
        server.close()


def _controller_metrics(
    args: argparse.Namespace, controller: Controller, health: Health
) -> AbstractContextManager[str]:
    """A controller's own counters (asked of it once it is bound) on ``--metrics-port``,
    with its readiness checks."""
    add_controller_checks(health, controller)
    return _metrics(
        args,
        lambda: _controller_stats(lambda: controller.endpoint, args),
        "the controller",
        health,
        nodes=False,
    )


def _serve_controller(controller: Controller, listen: str, ready: Callable[[str], None]) -> None:
    """``controller.serve`` with a failed bind as one line that says what to do."""
    try:
        controller.serve(ready)
    except zmq.ZMQError as exc:
        if controller.endpoint:
            raise  # bound and served: not a start-up problem
        raise listen_error(
            "the controller", listen, exc.errno, exc.strerror, "--listen HOST:PORT"
        ) from None


def _announce_waiting(agent: NodeAgent, membership: Membership, secured: bool) -> None:
    """Log on stderr while the node waits for its controller, until it is registered."""
    started = time.monotonic()
    if agent.wait_registered(_FIRST_WAIT_NOTICE) is not None:
        return
    hint = " with the same secret" if secured else ""
    while True:
        cause = f"{agent.last_failure}; " if agent.last_failure else ""
        log.warning(
            "waiting for %s to register this node (%.0fs so far; the "
            "node is not used until then): %s%s%s?",
            membership.where,
            time.monotonic() - started,
            cause,
            membership.check_hint,
            hint,
        )
        if agent.wait_registered(_WAIT_NOTICE_EVERY) is not None:
            log.info(
                "registered with %s after %.1fs",
                membership.where,
                time.monotonic() - started,
            )
            return


# -- the commands --------------------------------------------------------------------------


def run_controller(args: argparse.Namespace) -> int:
    settings = plugin_settings(args)
    credentials = credentials_from(args)
    tenants = tenants_from(args)
    index = index_from(args, settings)
    try:
        servers = image_servers_from(args, credentials, settings)
        kv_events = None
        try:
            kv_events = kv_events_from(args)
            controller = controller_from(args, credentials, index, servers, tenants, kv_events)
            settings.check_all_claimed("controller")
            with _controller_metrics(args, controller, Health()) as metrics:
                _stop_on_signals(controller.stop)
                _serve_controller(
                    controller,
                    controller.listen,
                    lambda endpoint: print(
                        f"kvfabric controller listening on {endpoint} (index {args.index})"
                        f"{_image_words(controller)}{_kv_events_words(controller)}{metrics}; "
                        f"clients connect with kvfabric://{_host_port(endpoint)}"
                        f"{_tenant_words(endpoint, credentials, tenants)}",
                        flush=True,
                    ),
                )
        finally:
            if kv_events is not None:
                kv_events.close()
            close_servers(servers)
    finally:
        index.close()
    return 0


def run_node(args: argparse.Namespace) -> int:
    credentials = credentials_from(args)
    tenants = tenants_from(args)
    membership, shared_index = membership_from(args, credentials)
    # The endpoint is up before the memory is prepared (which can take minutes): alive,
    # and saying what it is not yet ready for.
    built: list[DataNode] = []
    agents: list[NodeAgent] = []
    health = Health()
    add_node_checks(health, lambda: bool(built), lambda: agents[0] if agents else None)

    def node_stats() -> Scopes:
        if not built or not agents:
            return {}
        node, agent = built[0], agents[0]
        registered = agent.registered
        node_id = registered.id if registered is not None else 0
        scopes: Scopes = {f"node {node_id} {node.name}": agent.stats()}
        if shared_index is not None:
            # No controller reports the shared index's counters (per shard, in Redis):
            # every node does. One that cannot reach it still reports its own.
            with contextlib.suppress(KvfabricError):
                scopes["index"] = shared_index.shared_stats()
        return scopes

    stop = threading.Event()
    source = f"node {args.name}" if args.name else "this node"
    try:
        with _metrics(args, node_stats, source, health) as metrics:
            _stop_on_signals(stop.set)
            node = node_from(args, credentials, plugin_settings(args, index=False), tenants)
            try:
                agent = NodeAgent(
                    node, membership, heartbeat=duration(args.heartbeat, "--heartbeat")
                )
                built.append(node)
                agents.append(agent)
                agent.start()
                print(
                    f"kvfabric node {node.name} serving {_describe(node)}; registering with "
                    f"{membership.where}{metrics}",
                    flush=True,
                )
                threading.Thread(
                    target=_announce_waiting,
                    args=(agent, membership, credentials is not None),
                    name="kvfabric-wait-notice",
                    daemon=True,
                ).start()
                try:
                    stop.wait()
                finally:
                    agent.stop()
            finally:
                node.close()
    except BaseException:
        if not agents:
            membership.close()  # else the agent closed it when it stopped
        raise
    return 0


def run_serve(args: argparse.Namespace) -> int:
    credentials = credentials_from(args)
    tenants = tenants_from(args)
    settings = plugin_settings(args)
    # As for a node: the endpoint is up (alive, not ready) while the memory is prepared.
    controllers: list[Controller] = []
    agents: list[NodeAgent] = []
    health = Health()
    add_node_checks(health, lambda: bool(controllers), lambda: agents[0] if agents else None)

    def stats() -> Scopes:
        if not controllers or not controllers[0].endpoint:
            return {}
        return _controller_stats(lambda: controllers[0].endpoint, args)

    # serve exports its node's counters too, without the image's servers (they are the
    # node's).
    with _metrics(args, stats, "the controller", health, nodes=True, image=False) as metrics:
        index = index_from(args, settings)
        try:
            node = node_from(args, credentials, settings, tenants)
        except BaseException:
            index.close()
            raise
        kv_events = None
        try:
            kv_events = kv_events_from(args)
            # The node's transport servers serve the lookup image too: one port per transport.
            controller = controller_from(args, credentials, index, node.servers, tenants, kv_events)
            add_controller_checks(health, controller)
            controllers.append(controller)
            _stop_on_signals(controller.stop)

            def ready(endpoint: str) -> None:
                # The controller is bound: start the node's agent against it, announce when
                # the node is in.
                agent = NodeAgent(
                    node,
                    controller_membership(endpoint, args, credentials),
                    heartbeat=duration(args.heartbeat, "--heartbeat"),
                )
                agents.append(agent)
                agent.start()
                threading.Thread(target=announce, args=(agent, endpoint), daemon=True).start()

            def announce(agent: NodeAgent, endpoint: str) -> None:
                if agent.wait_registered(_SERVE_REGISTER_WITHIN) is None:
                    print(
                        "kvfabric: error: the node did not register with its own controller "
                        f"within {_SERVE_REGISTER_WITHIN:.0f}s",
                        file=sys.stderr,
                        flush=True,
                    )
                    controller.stop()
                    return
                print(
                    f"kvfabric serving on {endpoint}: node {node.name}, {_describe(node)}"
                    f"{_image_words(controller)}{_kv_events_words(controller)}{metrics}; "
                    f"connect with kvfabric://{_host_port(endpoint)}"
                    f"{_tenant_words(endpoint, credentials, tenants)}",
                    flush=True,
                )

            try:
                _serve_controller(controller, controller.listen, ready)
            finally:
                for agent in agents:
                    agent.stop()
        finally:
            if kv_events is not None:
                kv_events.close()
            index.close()
            node.close()
    return 0
