"""A real kvfabric deployment on 127.0.0.1: controller and data-node processes.

``Cluster`` starts ``kvfabric controller`` and ``kvfabric node`` as child processes (the
same commands an operator runs), waits until every node is registered, and can kill, stop,
continue or restart any of them, so fault tests exercise the real processes and sockets.
``kvfabric bench`` uses it too, so it lives here and imports nothing of the test suite.

``Cluster(redis=URL)`` runs no controller: its nodes register with the ``redis`` index at
URL (``kvfabric node --index redis``), in a namespace of their own, and clients connect
with ``kvfabric://HOST:PORT?index=redis`` (:meth:`Cluster.url`). The namespace is purged
when the cluster closes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlsplit

from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex, fetch_stats
from kvfabric._control.security import Credentials
from kvfabric.errors import ControllerUnavailableError, KvfabricError
from kvfabric.spi.index import IndexConfig, NodeInfo

__all__ = ["Cluster", "free_port"]


def image_server_pids(controller_pid: int) -> list[int]:
    """The children of ``controller_pid`` that serve its lookup image (Linux ``/proc``)."""
    try:
        children = Path(f"/proc/{controller_pid}/task/{controller_pid}/children").read_text()
    except OSError:
        return []
    pids = []
    for child in children.split():
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if b"kvfabric._control.image_process" in command:
            pids.append(int(child))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Process:
    def __init__(self, args: list[str], log: Path, env: dict[str, str], ready: str) -> None:
        self.args = args
        self.log_path = log
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvfabric", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().decode()
        if ready not in line:
            self.popen.kill()
            self.popen.wait()
            raise RuntimeError(f"{' '.join(args)} did not start:\n{log.read_text()[-3000:]}")
        self.ready_line = line.strip()

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()


class Cluster:
    """A controller plus ``nodes`` data nodes; ``url`` is what clients connect to."""

    def __init__(
        self,
        *,
        nodes: int = 1,
        transports: Sequence[str] = ("tcp", "shm"),
        capacity: str = "256MiB",
        controller_args: Sequence[str] = (),
        node_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        secret: bytes | None = None,
        backend: str = "dram",
        redis: str | None = None,
        node_ttl: str = "2s",
    ) -> None:
        """``backend="file"`` gives each node its own directory (:meth:`node_path`), kept
        across restarts of that node. ``redis``: the URL of a Redis deployment whose
        ``redis`` index the nodes use instead of a controller (``node_ttl``: how long one
        may stay silent before whoever ticks the index drops it)."""
        self.redis = redis
        self.namespace = f"c{uuid.uuid4().hex[:12]}" if redis else ""
        self.node_ttl = node_ttl
        self._index: Any = None
        if redis:
            address = urlsplit(redis)
            self.port = address.port or 6379
            self.host = address.hostname or "127.0.0.1"
        else:
            self.port = free_port()
            self.host = "127.0.0.1"
        self.backend = backend
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.transports = list(transports)
        self.capacity = capacity
        self.controller_args = list(controller_args)
        self.node_args = list(node_args)
        self.secret = secret
        self.env = {**os.environ, **(env or {})}
        if secret is not None:
            self.env["KVFABRIC_SECRET"] = secret.decode()
        self._dir = tempfile.TemporaryDirectory(prefix="kvfabric-cluster-")
        self.logs = Path(self._dir.name)
        self.controller: _Process | None = None
        self.nodes: list[_Process | None] = []
        try:
            if not redis:
                self.start_controller()
            for _ in range(nodes):
                self.add_node()
            self.wait_nodes(nodes)
        except BaseException:
            self.close()
            raise

    def url(self, **options: str) -> str:
        """What clients connect to (``options`` as query parameters); with ``redis``, the
        index's URL and namespace come first."""
        if self.redis:
            options = {**self.index_options(), **options, "index": "redis"}
        query = "&".join(f"{k}={quote(str(v), safe='/:@')}" for k, v in options.items())
        return f"kvfabric://{self.host}:{self.port}" + (f"?{query}" if query else "")

    def index_options(self) -> dict[str, str]:
        """The redis index's options every process of this cluster uses (none without)."""
        if not self.redis:
            return {}
        return {"redis.url": self.redis, "redis.namespace": self.namespace}

    # -- processes ---------------------------------------------------------------------

    def start_controller(self) -> None:
        args = ["controller", "--listen", self.endpoint, "--node-timeout", "2s"]
        self.controller = _Process(
            args + self.controller_args,
            self.logs / "controller.log",
            self.env,
            "listening on",
        )

    def add_node(self) -> int:
        index = len(self.nodes)
        self.nodes.append(None)
        self.start_node(index)
        return index

    def node_path(self, index: int) -> Path:
        """The directory of node ``index`` when the backend keeps its memory in files."""
        return self.logs / "data" / f"node{index}"

    def start_node(
        self, index: int, *, name: str | None = None, capacity: str | None = None
    ) -> None:
        """Start (or restart) node ``index``: by default under its own name and capacity."""
        capacity = capacity or self.capacity
        if self.redis:
            options = {**self.index_options(), "redis.node_ttl": self.node_ttl}
            where = ["--index", "redis"]
            for option, value in options.items():
                where += ["--index-opt", f"{option}={value}"]
        else:
            where = ["--controller", self.endpoint]
        args = [
            "node",
            *where,
            "--transport",
            ",".join(self.transports),
            "--capacity",
            capacity,
            "--region-size",
            capacity,
            "--heartbeat",
            "0.25s",
            "--name",
            name or f"node{index}",
            "--backend",
            self.backend,
            *(["--path", str(self.node_path(index))] if self.backend == "file" else []),
            *self.node_args,
        ]
        self.nodes[index] = _Process(args, self.logs / f"node{index}.log", self.env, "serving")

    def kill_node(self, index: int) -> None:
        node = self.nodes[index]
        assert node is not None
        node.kill()
        node.stop()
        self.nodes[index] = None

    def signal_node(self, index: int, sig: int) -> None:
        node = self.nodes[index]
        assert node is not None
        node.signal(sig)

    def node_pid(self, index: int) -> int:
        node = self.nodes[index]
        assert node is not None
        return node.popen.pid

    def controller_pid(self) -> int:
        assert self.controller is not None
        return self.controller.popen.pid

    def image_server_pids(self) -> list[int]:
        """The controller's child processes that serve its lookup image (``tcp``)."""
        return image_server_pids(self.controller_pid())

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.controller.kill()
        self.controller.stop()
        self.controller = None

    # -- state -------------------------------------------------------------------------

    def _client(self) -> ControlClient:
        credentials = Credentials.from_secret(self.secret) if self.secret else None
        return ControlClient(self.endpoint, timeout=2.0, credentials=credentials)

    def index(self) -> Any:
        """The redis index of a ``redis`` cluster, opened once (a ``RedisIndex``)."""
        if self._index is None:
            from kvfabric.indexes.redis import RedisIndex

            options = {k.removeprefix("redis."): v for k, v in self.index_options().items()}
            self._index = RedisIndex.create(IndexConfig(options=options))
        return self._index

    def node_infos(self) -> list[NodeInfo]:
        """What the controller (or the redis index) knows of each registered node (regions,
        transport endpoints)."""
        if self.redis:
            try:
                return sorted(self.index().nodes(), key=lambda n: n.name)
            except ControllerUnavailableError:
                return []
        client = self._client()
        try:
            return sorted(RemoteIndex(client).nodes(), key=lambda n: n.name)
        except ControllerUnavailableError:
            return []
        finally:
            client.close()

    def _reported_nodes(self) -> int:
        if self.redis:
            # No one collects nodes' counters: registered is all there is to wait for.
            return len(self.node_infos())
        try:
            return sum(scope.startswith("node ") for scope in self.stats())
        except ControllerUnavailableError:
            return 0

    def node_names(self) -> list[str]:
        return [n.name for n in self.node_infos()]

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` nodes are registered and each has reported its counters once (a
        heartbeat), so stats and metrics show every node from the start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.node_names()) == count and self._reported_nodes() >= count:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{count} nodes did not register: {self.node_names()}\n{self.tail()}")

    def stats(self) -> dict[str, dict[str, int]]:
        if self.redis:
            return {"index": self.index().stats()}
        client = self._client()
        try:
            return fetch_stats(client)
        finally:
            client.close()

    def tail(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(self.logs.glob("*.log"))
        )

    def close(self) -> None:
        for index, node in enumerate(self.nodes):
            if node is not None:
                node.signal(signal.SIGCONT)
                node.stop()
                self.nodes[index] = None
        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if self.redis:
            # What the nodes left in Redis goes (a deployment a test killed keeps it).
            with contextlib.suppress(KvfabricError):
                self.index().purge()
            if self._index is not None:
                self._index.close()
                self._index = None
        self._dir.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
