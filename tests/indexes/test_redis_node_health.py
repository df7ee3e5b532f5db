"""A node of the Redis index whose Redis goes away: it warns at once, its ``/readyz`` and
its ``registered`` gauge say so, and it logs its recovery. Real processes on 127.0.0.1."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from redis_fixtures import need_redis
from redis_servers import RedisDeployment

from kvfabric.testing import Cluster, wait_for


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc.read().decode())


@pytest.fixture
def redis_alone() -> Iterator[RedisDeployment]:
    """A server of this test's own: the test kills and restarts it."""
    need_redis()
    with RedisDeployment.single() as deployment:
        yield deployment


def test_a_node_that_loses_its_redis_is_not_ready_until_it_is_back(
    redis_alone: RedisDeployment,
) -> None:
    with Cluster(
        redis=redis_alone.url,
        nodes=1,
        transports=("tcp",),
        node_args=["--metrics-port", "0", "--heartbeat", "0.2s"],
    ) as cluster:
        node = cluster.nodes[0]
        assert node is not None
        match = re.search(r"(http://\S+)/metrics", node.ready_line)
        assert match, node.ready_line
        base = match.group(1)
        wait_for("ready", lambda: _get(base + "/readyz")[0] == 200)
        port = redis_alone.servers[0].port
        redis_alone.kill(port)
        _status, body = wait_for(
            "not ready", lambda: _get(base + "/readyz"), until=lambda r: r[0] == 503
        )
        assert "no answer from the redis index" in body
        wait_for("the warning", lambda: "WARNING lost the redis index" in node.log_path.read_text())
        redis_alone.restart(port)
        wait_for("ready again", lambda: _get(base + "/readyz")[0] == 200)
        wait_for("the recovery logged", lambda: "answers again" in node.log_path.read_text())
