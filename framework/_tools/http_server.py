"""The HTTP endpoint on a server's ``--metrics-port``: ``/metrics``, ``/healthz``, ``/readyz``.

``/metrics`` (and any other path, as before) is prometheus-client's own WSGI application
over the process's registry, unchanged: content negotiation (OpenMetrics), compression and
``name[]`` filters as that library does them. ``/healthz`` answers ``200 ok`` while the
process serves HTTP at all (liveness). ``/readyz`` answers ``200`` when every readiness
check of :class:`~kvfabric._tools.health.Health` holds and ``503`` otherwise, with one line
per check either way (``ok registered``, ``not ready memory: preparing 4.0 GiB ...``), so a
person reading it with curl sees what is missing.

The server is the standard library's WSGI server with a thread per request, as
prometheus-client's ``start_http_server`` builds it, with the routing above in front.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from kvfabric._tools.health import Health

__all__ = ["HEALTH_PATH", "READY_PATH", "EndpointServer"]

HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"

_StartResponse = Callable[..., Any]
_App = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: scrapes and probes come every few seconds."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _text(start: _StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
        ],
    )
    return [data]


def _routes(metrics: _App, health: Health) -> _App:
    def app(environ: dict[str, Any], start: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == HEALTH_PATH:
            return _text(start, "200 OK", "ok\n")
        if path == READY_PATH:
            ready, body = health.report()
            return _text(start, "200 OK" if ready else "503 Service Unavailable", body)
        return metrics(environ, start)

    return app


class EndpointServer:
    """Serves ``registry`` and ``health`` on ``host:port`` (0: any free port) from a thread."""

    def __init__(self, registry: CollectorRegistry, health: Health, host: str, port: int) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Server", (_ThreadingServer,), {"address_family": family})
        self._server: WSGIServer = make_server(
            host, port, _routes(make_wsgi_app(registry), health), server_class, _QuietHandler
        )
        self.port = int(self._server.server_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvfabric-metrics-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
