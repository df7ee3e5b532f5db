"""The redis index publishes no KV events yet: asking for them is refused at start, clearly.

docs/kv-events.md ("Limits") says so and sketches what one stream per cluster would take.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from redis_servers import RedisDeployment

from kvfabric.testing import free_port

pytestmark = pytest.mark.slow


def test_a_controller_on_the_redis_index_refuses_kv_events_naming_the_limit(
    redis_single: RedisDeployment,
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfabric",
            "controller",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--index",
            "redis",
            "--index-opt",
            f"redis.url={redis_single.url}",
            "--kv-events",
            f"tcp://*:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--kv-events: the redis index reports no KV events" in done.stderr
    assert "docs/kv-events.md" in done.stderr
