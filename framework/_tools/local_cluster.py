"""A kvfabric deployment on 127.0.0.1: controller and data-node processes, as operators run them.

:class:`LocalCluster` starts ``kvfabric controller`` and ``kvfabric node`` as child processes
(the same commands, through ``python -m kvfabric``), waits until every node is registered and
has reported once, and can kill and restart any of them. ``kvfabric bench`` measures against
it, so it ships with the command line and imports nothing of a test framework; the test
suite's :class:`kvfabric.testing.Cluster` builds on it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TypeVar
from urllib.parse import quote

from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex, fetch_stats
from kvfabric._control.security import Credentials
from kvfabric.errors import ControllerUnavailableError
from kvfabric.spi.index import NodeInfo

__all__ = ["LocalCluster", "ServerProcess", "free_port", "image_server_pids"]

_Cluster = TypeVar("_Cluster", bound="LocalCluster")


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
    """A TCP port free on 127.0.0.1 just now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m kvfabric ARGS`` as a child process, started once its ready line is out.

    Its stderr goes to ``log``; a process whose first stdout line lacks ``ready`` is killed
    and raises RuntimeError with the log's tail.
    """

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


class LocalCluster:
    """A controller plus ``nodes`` data nodes; :meth:`url` is what clients connect to."""

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
    ) -> None:
        """``backend="file"`` gives each node its own directory (:meth:`node_path`), kept
        across restarts of that node."""
        self.host, self.port = self._address()
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
        self.controller: ServerProcess | None = None
        self.nodes: list[ServerProcess | None] = []
        try:
            if self._has_controller():
                self.start_controller()
            for _ in range(nodes):
                self.add_node()
            self.wait_nodes(nodes)
        except BaseException:
            self.close()
            raise

    # -- where nodes register and clients connect (a subclass may register elsewhere) -----

    def _address(self) -> tuple[str, int]:
        """Host and port clients connect to: the controller's, on a free port."""
        return "127.0.0.1", free_port()

    def _has_controller(self) -> bool:
        return True

    def _registration_args(self) -> list[str]:
        """The ``kvfabric node`` arguments naming where a node registers."""
        return ["--controller", self.endpoint]

    def _url_options(self) -> dict[str, str]:
        """Query parameters every client URL carries before the caller's own."""
        return {}

    def url(self, **options: str) -> str:
        """What clients connect to, ``options`` as query parameters."""
        options = {**self._url_options(), **options}
        query = "&".join(f"{k}={quote(str(v), safe='/:@')}" for k, v in options.items())
        return f"kvfabric://{self.host}:{self.port}" + (f"?{query}" if query else "")

    # -- processes ---------------------------------------------------------------------

    def start_controller(self) -> None:
        args = ["controller", "--listen", self.endpoint, "--node-timeout", "2s"]
        self.controller = ServerProcess(
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
        args = [
            "node",
            *self._registration_args(),
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
        self.nodes[index] = ServerProcess(args, self.logs / f"node{index}.log", self.env, "serving")

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

    def node_infos(self) -> list[NodeInfo]:
        """What the controller knows of each registered node (regions, transport
        endpoints), by name."""
        client = self._client()
        try:
            return sorted(RemoteIndex(client).nodes(), key=lambda n: n.name)
        except ControllerUnavailableError:
            return []
        finally:
            client.close()

    def _reported_nodes(self) -> int:
        """How many nodes the controller has counters of (each reports with its heartbeat)."""
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
        """The controller's counters, its index's and every node's (``kvfabric stats``)."""
        client = self._client()
        try:
            return fetch_stats(client)
        finally:
            client.close()

    def tail(self) -> str:
        """The end of every process's log, for an error message."""
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
        self._dir.cleanup()

    def __enter__(self: _Cluster) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
