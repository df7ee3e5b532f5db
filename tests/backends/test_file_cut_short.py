"""A node's region file cut short under it (another process truncating it): an shm client
that maps it afterwards cannot map past its end (Python's mmap refuses a mapping longer than
the file): it reads misses instead of dying of SIGBUS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from kvfabric.testing import Cluster

_CLIENT = textwrap.dedent(
    """
    import sys
    import kvfabric
    from kvfabric.keys import chain_keys
    keys = chain_keys(list(range(8)), 1, namespace=b"cut-short")
    with kvfabric.connect(sys.argv[1]) as store:
        if sys.argv[2] == "put":
            outcomes = store.batched_put(keys, [bytes([i]) * 65536 for i in range(8)])
            print(sum(o is kvfabric.PutOutcome.STORED for o in outcomes))
        else:
            got = store.batched_get(keys)
            print(sum(g is not None for g in got))
    """
)


def _client(url: str, what: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CLIENT, url, what],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_client_mapping_a_region_file_cut_short_reads_misses_and_survives() -> None:
    with Cluster(nodes=1, transports=("shm",), capacity="64MiB", backend="file") as cluster:
        url = cluster.url(transport="shm")
        stored = _client(url, "put")
        assert stored.returncode == 0, stored.stderr
        assert stored.stdout.split() == ["8"]
        for region in cluster.node_path(0).glob("region-*.kvf"):
            os.truncate(region, 4096)
        read = _client(url, "get")
        # Not -SIGBUS: the client refused to map past the file's end and read misses.
        assert read.returncode == 0, read.stderr
        assert read.stdout.split() == ["0"]
