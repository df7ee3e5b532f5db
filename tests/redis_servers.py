"""Real ``redis-server`` processes on 127.0.0.1 for tests and benchmarks: one server or a cluster.

``RedisDeployment.single()`` starts one server; ``RedisDeployment.cluster(masters=3,
replicas=1)`` starts ``masters * (1 + replicas)`` servers in cluster mode and joins them with
``redis-cli --cluster create`` (the command an operator runs), then waits until every slot is
served and every replica is in sync. Persistence is off and every file lives in a temporary
directory that :meth:`RedisDeployment.close` removes, with the processes.

Fault tests use :meth:`RedisDeployment.kill` (``kill -9``),
:meth:`RedisDeployment.wait_healthy` (the slots of a dead master served again, by its promoted
replica) and :meth:`RedisDeployment.restart` (a single server back, empty). The cluster's
node timeout is short (``node_timeout``, 1 s by default) so a failover takes a couple of
seconds, and ``cluster-require-full-coverage no`` keeps the other masters
serving while one is down, as kvfabric's deployment guide recommends (docs/redis.md).

redis-py is imported lazily: the module itself needs only the standard library.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["RedisDeployment", "RedisProcess", "redis_server_binary"]

_SLOTS = 16384
_PR_SET_PDEATHSIG = 1


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` (and ``redis-cli`` beside it), or None when not installed."""
    server = shutil.which("redis-server")
    return server if server and shutil.which("redis-cli") else None


def _free_port_pair() -> int:
    """A port P such that P and P + 10000 (the cluster bus) are both free on 127.0.0.1."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if all(_port_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free pair of ports (P, P+10000) on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@attrs.define(kw_only=True)
class RedisProcess:
    port: int
    process: subprocess.Popen[bytes]
    alive: bool = True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class RedisDeployment:
    """Redis servers this process started; a context manager that stops them on exit."""

    def __init__(
        self, directory: Path, *, cluster: bool, password: str = "", tls: bool = False
    ) -> None:
        self.directory = directory
        self.is_cluster = cluster
        self.password = password
        self.tls = tls
        self.servers: list[RedisProcess] = []

    # -- starting --------------------------------------------------------------------------

    @classmethod
    def single(cls, *, password: str = "", tls: bool = False) -> RedisDeployment:
        """One server, cluster mode off; with ``password`` it requires AUTH, with ``tls`` it
        speaks only TLS (a certificate authority made here signs its certificate)."""
        directory = Path(tempfile.mkdtemp(prefix="kvfabric-redis-"))
        deployment = cls(directory, cluster=False, password=password, tls=tls)
        try:
            if tls:
                _make_certificates(directory)
            deployment._start_server(cluster=False, node_timeout_ms=0)
            deployment._wait_ping(deployment.servers[0])
        except BaseException:
            deployment.close()
            raise
        return deployment

    @classmethod
    def cluster(
        cls, *, masters: int = 3, replicas: int = 1, node_timeout: float = 1.0
    ) -> RedisDeployment:
        """``masters`` masters with ``replicas`` replicas each, joined by redis-cli."""
        deployment = cls(Path(tempfile.mkdtemp(prefix="kvfabric-redis-cluster-")), cluster=True)
        try:
            for _ in range(masters * (1 + replicas)):
                deployment._start_server(cluster=True, node_timeout_ms=int(node_timeout * 1000))
            for server in deployment.servers:
                deployment._wait_ping(server)
            create = [
                "redis-cli",
                "--cluster",
                "create",
                *(s.address for s in deployment.servers),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ]
            result = subprocess.run(create, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {result.stdout[-2000:]}")
            deployment.wait_healthy(timeout=60.0)
        except BaseException:
            deployment.close()
            raise
        return deployment

    def _start_server(
        self, *, cluster: bool, node_timeout_ms: int, port: int | None = None
    ) -> RedisProcess:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError(
                "redis-server and redis-cli are not installed (apt-get install redis-server)"
            )
        port = port or _free_port_pair()
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            f"redis-{port}.log",
            "--dbfilename",
            f"dump-{port}.rdb",
            # A replica's first sync streams straight from memory, with no delay.
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(port)]
            args += [
                "--tls-cert-file",
                str(self.directory / "server.crt"),
                "--tls-key-file",
                str(self.directory / "server.key"),
                "--tls-ca-cert-file",
                str(self.directory / "ca.crt"),
                "--tls-auth-clients",
                "no",
            ]
        if cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                # Other masters keep serving while one is down (kvfabric's keys are spread
                # over every slot; refusing all of them for one dead master helps nobody).
                "--cluster-require-full-coverage",
                "no",
                # A replica always takes over, however long its link was down.
                "--cluster-replica-validity-factor",
                "0",
            ]
        process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.directory,
            preexec_fn=_die_with_parent,
        )
        server = RedisProcess(port=port, process=process)
        self.servers.append(server)
        return server

    def _wait_ping(self, server: RedisProcess, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if server.process.poll() is not None:
                log = self.directory / f"redis-{server.port}.log"
                tail = log.read_text()[-1500:] if log.exists() else ""
                raise RuntimeError(f"redis-server on port {server.port} exited: {tail}")
            try:
                if self.client(server.port).ping():
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    # -- what tests ask -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """A URL of a live server (for a cluster: any node; it finds the rest): ``redis://``,
        or ``rediss://`` naming the certificate authority; with the password if one is set."""
        live = [s for s in self.servers if s.alive]
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            ca = self.directory / "ca.crt"
            return f"rediss://{auth}127.0.0.1:{live[0].port}?ssl_ca_certs={ca}"
        return f"redis://{auth}127.0.0.1:{live[0].port}"

    def client(self, port: int) -> Any:
        import redis

        extra: dict[str, Any] = {}
        if self.tls:
            extra = {"ssl": True, "ssl_ca_certs": str(self.directory / "ca.crt")}
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            socket_timeout=5.0,
            password=self.password or None,
            **extra,
        )

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Live masters by port, with the slot ranges each serves (cluster only)."""
        nodes = self._cluster_nodes()
        out: dict[int, list[tuple[int, int]]] = {}
        for node in nodes:
            if "master" in node["flags"] and "fail" not in node["flags"] and node["slots"]:
                out[node["port"]] = node["slots"]
        return out

    def master_of_slot(self, slot: int) -> int:
        for port, ranges in self.masters().items():
            if any(start <= slot <= end for start, end in ranges):
                return port
        raise LookupError(f"no live master serves slot {slot}")

    def _cluster_nodes(self) -> list[dict[str, Any]]:
        last: Exception | None = None
        for server in self.servers:
            if not server.alive:
                continue
            try:
                raw = self.client(server.port).execute_command("CLUSTER", "NODES")
            except Exception as exc:
                last = exc
                continue
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            return [_parse_node_line(line) for line in text.splitlines() if line.strip()]
        raise RuntimeError(f"no live cluster node answers CLUSTER NODES: {last}")

    def kill(self, port: int) -> None:
        """``kill -9`` the server on ``port``."""
        server = next(s for s in self.servers if s.port == port)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=10)
        server.alive = False

    def restart(self, port: int) -> None:
        """Start the single server that was on ``port`` again, empty (persistence is off):
        what a Redis restarted without RDB or AOF looks like to its clients."""
        if self.is_cluster:
            raise ValueError("restart starts a single server again; a cluster fails over")
        old = next(s for s in self.servers if s.port == port)
        if old.alive:
            self.kill(port)
        self.servers.remove(old)
        self._wait_ping(self._start_server(cluster=False, node_timeout_ms=0, port=port))

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Wait until every slot is served by a live master whose replicas are in sync and
        every live node says ``cluster_state:ok``; returns the seconds waited."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            problem = self._health_problem()
            if problem is None:
                return time.monotonic() - start
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster not healthy after {timeout:.0f}s: {problem}")
            time.sleep(0.1)

    def _health_problem(self) -> str | None:
        try:
            masters = self.masters()
            covered = sum(end - start + 1 for ranges in masters.values() for start, end in ranges)
            if covered != _SLOTS:
                return f"{covered} of {_SLOTS} slots served"
            alive = {s.port for s in self.servers if s.alive}
            dead = sorted(set(masters) - alive)
            if dead:
                return f"killed master {dead[0]} not failed over yet"
            for server in self.servers:
                if not server.alive:
                    continue
                info = self.client(server.port).execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return f"node {server.port} not ok"
            nodes = self._cluster_nodes()
            live_replicas = {
                n["port"]: n["master_id"]
                for n in nodes
                if "slave" in n["flags"] and "fail" not in n["flags"]
            }
            idle = sorted(alive - set(masters) - set(live_replicas))
            if idle:
                return f"node {idle[0]} is neither serving slots nor a replica yet"
            for port in masters:
                replication = self.client(port).info("replication")
                online = sum(
                    1
                    for key, value in replication.items()
                    if key.startswith("slave")
                    and isinstance(value, dict)
                    and value.get("state") == "online"
                )
                expected = sum(
                    1 for master_id in live_replicas.values() if master_id == self._id_of(port)
                )
                if online < expected:
                    return f"master {port}: {online} of {expected} replicas in sync"
        except Exception as exc:  # a node mid-failover: ask again
            return f"{type(exc).__name__}: {exc}"
        return None

    def _id_of(self, port: int) -> str:
        for node in self._cluster_nodes():
            if node["port"] == port:
                return str(node["id"])
        return ""

    # -- stopping -------------------------------------------------------------------------

    def close(self) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.process.terminate()
        for server in self.servers:
            try:
                server.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait(timeout=10)
            server.alive = False
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _find_prctl() -> Any:
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        return None  # not Linux


# Looked up here, in the parent: the child, between fork and exec, only calls it.
_prctl = _find_prctl()


def _die_with_parent() -> None:
    """In the child: SIGKILL when the process that started it dies, however it dies (a test
    run that crashes must not leave servers behind). Linux only; elsewhere nothing."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _make_certificates(directory: Path) -> None:
    """A throw-away certificate authority and a certificate for 127.0.0.1 it signs."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("genrsa", "-out", "ca.key", "2048")
    openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-days",
        "2",
        "-subj",
        "/CN=kvfabric-test-ca",
        "-out",
        "ca.crt",
    )
    openssl("genrsa", "-out", "server.key", "2048")
    openssl("req", "-new", "-key", "server.key", "-subj", "/CN=127.0.0.1", "-out", "server.csr")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    )


def _parse_node_line(line: str) -> dict[str, Any]:
    """One line of CLUSTER NODES: id, address, flags, master, ..., slot ranges."""
    fields = line.split()
    address = fields[1].split("@")[0]
    slots: list[tuple[int, int]] = []
    for part in fields[8:]:
        if part.startswith("["):  # a slot being migrated
            continue
        start, _, end = part.partition("-")
        slots.append((int(start), int(end or start)))
    return {
        "id": fields[0],
        "port": int(address.rsplit(":", 1)[1]),
        "flags": set(fields[2].split(",")),
        "master_id": fields[3],
        "slots": slots,
    }
