"""kvfabric's metrics for Prometheus: one collector, served over HTTP or printed as text.

:class:`ScopesCollector` reads the counters of a controller or a node at each scrape
(through a callable: the controller's own STATS request, so a scrape sees what ``kvfabric
stats`` sees, served in order by the controller's loop; or a node's ``stats()``) and yields
them as metric families named and labelled the usual way
(:mod:`kvfabric._tools.metric_families`), with ``kvfabric_build_info``, ``kvfabric_up``
and, on a server's endpoint, prometheus-client's process, platform and garbage-collector
metrics. prometheus-client writes the exposition and serves it (:class:`MetricsServer`,
behind ``--metrics-port``); ``kvfabric stats --format prometheus`` prints the same families.

Each value is exported by the process that owns it, so a sum over every scraped process
counts nothing twice: a controller's endpoint leaves out the data nodes' counters (each
node serves its own), and ``serve`` leaves out its lookup image's servers (they are its
node's, exported with the node). ``kvfabric stats --format prometheus`` prints everything the
controller knows, its nodes' counters as of their last heartbeat included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvfabric import __version__
from kvfabric._tools.endpoints import listen_error
from kvfabric._tools.health import Health
from kvfabric._tools.http_server import EndpointServer
from kvfabric._tools.metric_families import Scopes, families
from kvfabric.errors import KvfabricError

__all__ = ["MetricsServer", "Scopes", "ScopesCollector", "exposition", "families"]

log = logging.getLogger("kvfabric._tools.metrics")


def build_info() -> GaugeMetricFamily:
    """``kvfabric_build_info{version}`` 1: which kvfabric a process runs."""
    info = GaugeMetricFamily(
        "kvfabric_build_info",
        "Always 1; the labels say which kvfabric this process runs.",
        labels=["version"],
    )
    info.add_metric([__version__], 1)
    return info


def process_registry() -> CollectorRegistry:
    """prometheus-client's ``process_*``, ``python_info`` and ``python_gc_*`` metrics of
    this process, in a registry of their own."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class ScopesCollector(Collector):
    """Metric families from ``fetch()`` at each scrape; ``kvfabric_up`` says if it answered."""

    def __init__(
        self,
        fetch: Callable[[], Scopes],
        source: str,
        *,
        nodes: bool = True,
        image: bool = True,
        process: bool = True,
    ) -> None:
        """``nodes``/``image``: export the data nodes' scopes and the lookup image's
        servers (see the module's docstring); ``process``: add this process's own metrics
        (a server's endpoint; not ``kvfabric stats``)."""
        self._fetch = fetch
        self._source = source
        self._nodes = nodes
        self._image = image
        self._process = process_registry() if process else None

    def collect(self) -> Iterator[Metric]:
        try:
            scopes = self._fetch()
            up = 1
        except KvfabricError as exc:
            log.warning("metrics: could not read the counters of %s: %s", self._source, exc)
            scopes, up = {}, 0
        yield build_info()
        yield GaugeMetricFamily(
            "kvfabric_up", f"1 when the counters of {self._source} could be read, else 0.", value=up
        )
        yield from families(scopes, nodes=self._nodes, image=self._image)
        if self._process is not None:
            yield from self._process.collect()


def exposition(scopes: Scopes) -> str:
    """Prometheus text exposition of ``scopes`` (every scope, no process metrics)."""
    registry = CollectorRegistry()
    registry.register(ScopesCollector(lambda: scopes, "the controller", process=False))
    return generate_latest(registry).decode()


class MetricsServer:
    """An HTTP endpoint Prometheus scrapes: ``http://HOST:PORT/metrics`` (port 0: any),
    beside ``/healthz`` and ``/readyz`` (``health``'s checks; none given: always ready).
    See :mod:`kvfabric._tools.http_server`."""

    def __init__(
        self, collector: Collector, host: str, port: int, health: Health | None = None
    ) -> None:
        registry = CollectorRegistry()
        registry.register(collector)
        try:
            self._server = EndpointServer(registry, health or Health(), host, port)
        except OSError as exc:
            raise listen_error(
                "the metrics endpoint", f"{host}:{port}", exc.errno, str(exc), "--metrics-port"
            ) from exc
        self.host = host
        self.port = self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.close()
