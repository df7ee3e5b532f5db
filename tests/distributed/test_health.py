"""``/healthz`` and ``/readyz`` on every process's ``--metrics-port``, and a node that
loses its controller: real controller and node processes on 127.0.0.1."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvfabric._tools.local_cluster import ServerProcess, free_port
from kvfabric.testing import Cluster, wait_for


def _base(ready_line: str) -> str:
    match = re.search(r"(http://\S+)/metrics", ready_line)
    assert match, ready_line
    return match.group(1)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc.read().decode())


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(
        nodes=1,
        transports=("tcp",),
        controller_args=["--metrics-port", "0"],
        node_args=["--metrics-port", "0", "--heartbeat", "0.2s"],
    ) as c:
        yield c


def test_every_process_is_alive_and_ready_once_the_node_is_registered(cluster: Cluster) -> None:
    assert cluster.controller is not None
    assert cluster.nodes[0] is not None
    for process in (cluster.controller, cluster.nodes[0]):
        base = _base(process.ready_line)
        assert _get(base + "/healthz") == (200, "ok\n")
        status, body = wait_for(
            "ready", lambda base=base: _get(base + "/readyz"), until=lambda r: r[0] == 200
        )
        assert "not ready" not in body
    _, node_body = _get(_base(cluster.nodes[0].ready_line) + "/readyz")
    assert "ok memory" in node_body
    assert "ok registered" in node_body
    _, controller_body = _get(_base(cluster.controller.ready_line) + "/readyz")
    assert "ok controller" in controller_body
    assert "ok index" in controller_body
    # /metrics is still served beside them.
    status, text = _get(_base(cluster.controller.ready_line) + "/metrics")
    assert status == 200
    assert "kvfabric_up 1.0" in text


def test_a_node_that_loses_its_controller_warns_is_not_ready_and_logs_its_recovery(
    cluster: Cluster,
) -> None:
    node = cluster.nodes[0]
    assert node is not None
    base = _base(node.ready_line)
    wait_for("ready", lambda: _get(base + "/readyz")[0] == 200)
    cluster.kill_controller()
    _status, body = wait_for(
        "the node not ready", lambda: _get(base + "/readyz"), until=lambda r: r[0] == 503
    )
    assert "not ready registered: no answer from the controller at" in body
    wait_for("the warning", lambda: "WARNING lost the controller at" in node.log_path.read_text())
    wait_for(
        "the registered gauge at 0",
        lambda: re.search(r"kvfabric_node_registered\{[^}]*\} 0\.0", _get(base + "/metrics")[1]),
    )
    cluster.start_controller()
    wait_for("ready again", lambda: _get(base + "/readyz")[0] == 200)
    assert "answers again, after" in node.log_path.read_text()


def test_a_node_without_its_controller_is_alive_but_not_ready(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    logs = tmp_path_factory.mktemp("lonely")
    node = ServerProcess(
        [
            "node",
            "--controller",
            f"127.0.0.1:{free_port()}",
            "--capacity",
            "8MiB",
            "--transport",
            "tcp",
            "--metrics-port",
            "0",
        ],
        logs / "node.log",
        {},
        "serving",
    )
    try:
        base = _base(node.ready_line)
        assert _get(base + "/healthz")[0] == 200
        status, body = _get(base + "/readyz")
        assert status == 503
        assert "ok memory" in body
        assert "not ready registered: not registered with the controller at" in body
    finally:
        node.stop()


def test_serve_is_ready_with_every_check_of_both(tmp_path_factory: pytest.TempPathFactory) -> None:
    logs = tmp_path_factory.mktemp("serve")
    serve = ServerProcess(
        [
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--capacity",
            "16MiB",
            "--transport",
            "tcp",
            "--metrics-port",
            "0",
        ],
        logs / "serve.log",
        {},
        "serving on",
    )
    try:
        base = _base(serve.ready_line)
        assert _get(base + "/healthz")[0] == 200
        _status, body = wait_for(
            "ready", lambda: _get(base + "/readyz"), until=lambda r: r[0] == 200
        )
        for check in ("memory", "registered", "controller", "index"):
            assert f"ok {check}" in body
        assert "kvfabric_up 1.0" in _get(base + "/metrics")[1]
    finally:
        serve.stop()
