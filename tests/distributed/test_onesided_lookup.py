"""Lookups that answer themselves, against real controller and node processes on 127.0.0.1.

The controller serves its index's lookup image over ``tcp`` and ``shm`` (its default); a
client on this host maps it, and one forced onto ``tcp`` reads it through the controller's
own tcp server. Counted exactly: a one-sided lookup of N keys costs no control RPC, the
controller serves no lookup, and over tcp it costs one data-plane request to the image's
server; a bucket torn on purpose costs exactly one control RPC and is never trusted.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvfabric
from kvfabric._control.client import ControlClient
from kvfabric._control.remote_index import RemoteIndex
from kvfabric._runtime.image import IMAGE_BUCKET_SIZE, IMAGE_HEADER_SIZE, IMAGE_NODE, ImageGeometry
from kvfabric._wire.protocol import ImageLocation
from kvfabric.keys import chain_keys
from kvfabric.spi import Segment, TransportConfig
from kvfabric.testing import Cluster, wait_for
from kvfabric.transports.tcp import TcpTransport


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("tcp", "shm"), capacity="64MiB") as c:
        yield c


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _value(key: bytes, size: int = 256) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def _location(cluster: Cluster) -> ImageLocation:
    client = ControlClient(cluster.endpoint, timeout=2.0)
    try:
        location = RemoteIndex(client).image_location()
    finally:
        client.close()
    assert location is not None
    return location


class _WritableImage:
    """The controller's image mapped writable, to tear a bucket on purpose (a test's
    privilege: clients map it read-only)."""

    def __init__(self, location: ImageLocation) -> None:
        fd = os.open(location.path, os.O_RDWR)
        try:
            self.mapping = mmap.mmap(fd, location.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.geometry = ImageGeometry.from_header(self.mapping)

    def bucket_of(self, key: bytes) -> int:
        home = self.geometry.home(key)
        for bucket in range(home, home + self.geometry.window):
            at = IMAGE_HEADER_SIZE + bucket * IMAGE_BUCKET_SIZE
            if self.mapping[at + 8 : at + 16] == key[8:16]:
                return at
        raise AssertionError("key not in the image")

    def close(self) -> None:
        self.mapping.close()


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_a_mapped_lookup_costs_no_control_rpc_and_no_controller_work(
    cluster: Cluster, n: int
) -> None:
    with kvfabric.connect(cluster.url()) as store:
        keys = _keys(n + 1)
        store.batched_put(keys[:n], [_value(k) for k in keys[:n]])
        before, controller_before = store.stats(), cluster.stats()["controller"]
        for _ in range(3):
            assert store.batched_contains(keys) == n
        got = store.batched_get(keys[:n])
        after, controller_after = store.stats(), cluster.stats()["controller"]
    assert [bytes(v) for v in got if v is not None] == [_value(k) for k in keys[:n]]
    assert after["control_rpcs"] == before["control_rpcs"]
    assert after["onesided_lookups"] - before["onesided_lookups"] == 3
    assert after["image_round_trips"] == before["image_round_trips"]  # mapped: none
    for counter in ("rpcs", "rpc_lookup_prefix", "rpc_resolve"):
        assert controller_after.get(counter, 0) == controller_before.get(counter, 0), counter


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_a_lookup_over_tcp_is_one_data_plane_request_and_no_control_rpc(
    cluster: Cluster, n: int
) -> None:
    with kvfabric.connect(cluster.url(transport="tcp")) as store:
        keys = _keys(n + 1)
        store.batched_put(keys[:n], [_value(k) for k in keys[:n]])
        # The client's mirror of the image catches up with the put's N rewrites (in one
        # read too: tests/distributed/test_lookup_after_put.py); the steady state:
        store.batched_contains(keys)
        before, controller_before = store.stats(), cluster.stats()["controller"]
        assert store.batched_contains(keys) == n
        after, controller_after = store.stats(), cluster.stats()["controller"]
        assert store.batched_exists(keys[-2:]) == [True, False]
    assert after["control_rpcs"] == before["control_rpcs"]
    assert after["onesided_lookups"] - before["onesided_lookups"] == 1
    assert after["image_round_trips"] - before["image_round_trips"] == 1
    assert controller_after["rpcs"] == controller_before["rpcs"]
    served = "image_tcp_requests"
    assert controller_after[served] - controller_before[served] == 1


def test_the_tcp_image_is_served_by_a_process_of_its_own_that_refuses_writes(
    cluster: Cluster,
) -> None:
    """The controller's CPU serves no tcp lookup: a child process maps the image read-only
    and serves it; a write sent to it (a client holding the data-plane secret) is refused
    segment by segment and changes nothing."""
    assert len(cluster.image_server_pids()) == 1
    location = _location(cluster)
    endpoint = next(e for e in location.endpoints if e.transport == "tcp")
    handle = endpoint.regions[0]
    client = TcpTransport.create_client(TransportConfig(timeout=5.0))
    try:
        client.connect(endpoint)
        before = bytearray(IMAGE_HEADER_SIZE)
        assert client.read(
            IMAGE_NODE, [Segment(handle.region, handle.rkey, 0, memoryview(before))]
        ) == [None]
        errors = client.write(
            IMAGE_NODE, [Segment(handle.region, handle.rkey, 0, memoryview(bytes(64)))]
        )
        assert errors[0] is not None
        assert "read-only" in str(errors[0])
        after = bytearray(IMAGE_HEADER_SIZE)
        assert client.read(
            IMAGE_NODE, [Segment(handle.region, handle.rkey, 0, memoryview(after))]
        ) == [None]
    finally:
        client.close()
    # Bytes 24..40 are the controller's heartbeat stamp, which it rewrites on its own.
    assert after[:24] + after[40:] == before[:24] + before[40:]
    assert cluster.stats()["controller"]["image_tcp_refused_segments"] >= 1


def test_a_killed_image_server_is_started_again_and_clients_find_it() -> None:
    """kill -9 of the tcp image's process: lookups answer by RPC meanwhile (a miss at worst,
    never more hits than stored), the controller starts another without holding its loop,
    and clients find its new address (they ask where the image went at most once a
    second)."""
    with Cluster(nodes=1, transports=("tcp",), capacity="16MiB") as c:
        with kvfabric.connect(c.url(transport="tcp")) as store:
            keys = _keys(32)
            store.batched_put(keys, [_value(k) for k in keys])
            assert store.batched_contains(keys) == 32
            (first,) = c.image_server_pids()
            os.kill(first, signal.SIGKILL)
            seen: list[int] = []

            def lookup() -> tuple[int, dict[str, Any], dict[str, Any]]:
                """A lookup's hits, with the stats before and after it."""
                seen.append(store.batched_contains(keys))
                before = store.stats()
                hits = store.batched_contains(keys)
                seen.append(hits)
                return hits, before, store.stats()

            _, before, after = wait_for(
                "a whole lookup without a control RPC again",
                lookup,
                until=lambda got: got[0] == 32 and got[2]["control_rpcs"] == got[1]["control_rpcs"],
            )
            assert all(0 <= n <= 32 for n in seen), seen
            assert after["onesided_lookups"] - before["onesided_lookups"] == 1
            assert store.stats()["image_unavailable"] >= 1
            got = store.batched_get(keys)
            assert [bytes(v) if v is not None else None for v in got] == [_value(k) for k in keys]
            assert store.stats()["validation_failures"] == 0
        (second,) = c.image_server_pids()
        assert second != first
        assert c.stats()["controller"]["image_server_restarts"] == 1


def test_the_image_server_exits_with_its_controller_even_on_kill_9() -> None:
    with Cluster(nodes=1, transports=("tcp",), capacity="16MiB") as c:
        (server,) = c.image_server_pids()
        c.kill_controller()
        wait_for("the image server exited", lambda: not _alive(server))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_torn_bucket_costs_exactly_one_control_rpc_and_is_never_trusted(
    cluster: Cluster,
) -> None:
    image = _WritableImage(_location(cluster))
    try:
        with kvfabric.connect(cluster.url()) as store:
            keys = _keys(16)
            values = [_value(k) for k in keys]
            store.batched_put(keys, values)
            at = image.bucket_of(keys[9])
            # Caught mid-rewrite (odd sequence number), as a probe in place can see it.
            seq = int.from_bytes(image.mapping[at : at + 4], "little")
            image.mapping[at : at + 4] = (seq + 1).to_bytes(4, "little")
            before, controller_before = store.stats(), cluster.stats()["controller"]
            assert store.batched_contains(keys) == 16
            after, controller_after = store.stats(), cluster.stats()["controller"]
            assert after["control_rpcs"] - before["control_rpcs"] == 1
            assert after["image_fallbacks"] - before["image_fallbacks"] == 1
            assert after["onesided_lookups"] == before["onesided_lookups"]
            lookups = controller_after["rpc_lookup_prefix"] - controller_before.get(
                "rpc_lookup_prefix", 0
            )
            assert lookups == 1
            assert [bytes(v) if v is not None else None for v in store.batched_get(keys)] == values
            assert store.stats()["validation_failures"] == after["validation_failures"]
            image.mapping[at : at + 4] = seq.to_bytes(4, "little")  # the rewrite done
            assert store.batched_contains(keys) == 16
            assert store.stats()["control_rpcs"] - before["control_rpcs"] == 1
    finally:
        image.close()


def test_a_controller_serving_no_image_answers_every_lookup_by_rpc() -> None:
    with Cluster(nodes=1, capacity="16MiB", controller_args=["--transport", "none"]) as c:
        assert "no lookup image" in (c.controller.ready_line if c.controller else "")
        with kvfabric.connect(c.url()) as store:
            keys = _keys(8)
            store.batched_put(keys, [_value(k) for k in keys])
            before = store.stats()
            assert store.batched_contains(keys) == 8
            after = store.stats()
    assert after["control_rpcs"] - before["control_rpcs"] == 1
    assert after["onesided_lookups"] == 0


def test_after_a_controller_restart_lookups_read_the_new_controllers_image() -> None:
    with Cluster(nodes=1, capacity="16MiB") as c:
        url = c.url(control_timeout="300ms", retry_interval="200ms")
        with kvfabric.connect(url) as store:
            keys = _keys(10)
            store.batched_put(keys, [_value(k) for k in keys])
            assert store.batched_contains(keys) == 10
            c.kill_controller()
            # The dead controller's image was right when it stopped, so it is trusted until
            # its heartbeat is too old (image_reader.MAX_AGE); then lookups miss (no
            # controller to ask).
            wait_for(
                "lookups miss once the dead controller's image is too old",
                lambda: store.batched_contains(keys),
                until=lambda hits: hits == 0,
            )
            assert store.stats()["image_unavailable"] > 0
            c.start_controller()
            c.wait_nodes(1)  # the node re-registers and reports its records
            wait_for(
                "every key found again",
                lambda: store.batched_contains(keys),
                until=lambda hits: hits == 10,
                context=c.tail,
            )
            # The lookup after the one that saw the new epoch learns where the image is
            # (one NODES and one IMAGE call); from then on:
            store.batched_contains(keys)
            before = store.stats()
            assert store.batched_contains(keys) == 10
            after = store.stats()
            assert [bytes(v) for v in store.batched_get(keys) if v] == [_value(k) for k in keys]
    # The new controller's image answers: no control RPC.
    assert after["control_rpcs"] == before["control_rpcs"]
    assert after["onesided_lookups"] - before["onesided_lookups"] == 1


def test_one_sided_hits_keep_their_keys_from_eviction() -> None:
    """Lookups the index never sees still count as use: the client reports them (one
    ``TOUCH`` a second at most), so the keys an engine keeps finding outlive the rest."""
    with Cluster(nodes=1, capacity="4MiB") as c, kvfabric.connect(c.url()) as store:
        hot, cold = _keys(64), _keys(64)
        store.batched_put(hot, [_value(k, 16384) for k in hot])
        store.batched_put(cold, [_value(k, 16384) for k in cold])
        before = store.stats()
        assert store.batched_contains(hot) == 64
        wait_for(
            "the hits reported",
            lambda: store.stats()["touch_rpcs"],
            until=lambda touches: touches != before["touch_rpcs"],
        )
        assert store.stats()["touch_rpcs"] - before["touch_rpcs"] == 1
        assert c.stats()["controller"]["touch_rpcs"] >= 1
        filler = _keys(128)
        for start in range(0, 128, 16):  # about 2 MiB more: half of the rest must go
            store.batched_put(
                filler[start : start + 16], [_value(k, 16384) for k in filler[start : start + 16]]
            )
        assert c.stats()["index"]["evictions"] > 0
        hot_kept = sum(store.batched_exists(hot))
        cold_kept = sum(store.batched_exists(cold))
    print(f"kept after eviction: {hot_kept}/64 looked-up keys, {cold_kept}/64 others")
    assert hot_kept == 64
    assert cold_kept < 64


_RACER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import kvfabric
    from kvfabric.keys import chain_keys

    url, role, seed, seconds, namespace = sys.argv[1:6]
    keys = chain_keys(list(range(1024)), 1, namespace=bytes.fromhex(namespace))
    value = lambda k: np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(8192)
    rng = np.random.default_rng(int(seed))
    wrong = lookups = reads = 0
    with kvfabric.connect(url) as store:
        end = time.monotonic() + float(seconds)
        while time.monotonic() < end:
            start = int(rng.integers(0, 1024 - 64))
            batch = keys[start : start + 64]
            if role == "writer":
                store.batched_put(batch, [value(k) for k in batch])
                if rng.random() < 0.3:
                    store.delete(batch[::3])
                continue
            hits = store.batched_contains(batch)
            lookups += 1
            for k, v in zip(batch[:hits], store.batched_get(batch[:hits])):
                reads += v is not None
                wrong += v is not None and bytes(v) != value(k)
        stats = store.stats()
    print(wrong, lookups, reads, stats["onesided_lookups"], stats["validation_failures"])
    """
)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_lookups_racing_with_writer_processes_never_read_another_keys_value(
    transport: str,
) -> None:
    """Two writer processes put and delete (a store four times too small, so it evicts
    all the time) while two reader processes look up one-sided and read: 0 wrong values."""
    with Cluster(nodes=1, capacity="2MiB", controller_args=["--grace", "0"]) as c:
        namespace = uuid.uuid4().hex
        url = c.url(transport=transport)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RACER, url, role, str(seed), "4", namespace],
                stdout=subprocess.PIPE,
                text=True,
            )
            for seed, role in enumerate(["writer", "writer", "reader", "reader"])
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs
        evictions = c.stats()["index"]["evictions"]
    results = [list(map(int, out.split())) for out in outputs[2:]]
    wrong = sum(r[0] for r in results)
    print(
        f"{transport}: {sum(r[1] for r in results)} lookups ({sum(r[3] for r in results)} "
        f"one-sided), {sum(r[2] for r in results)} values read, {wrong} wrong, "
        f"{sum(r[4] for r in results)} stale descriptors caught, {evictions} evictions"
    )
    assert wrong == 0
    assert sum(r[3] for r in results) > 0
    assert evictions > 0
