"""The ``ucx`` transport: the shipped conformance suites, then what only UCX shows.

tox's ``ucx`` env runs this file twice: with ``UCX_TLS=sm`` (CMA, one-sided) and with
``UCX_TLS=tcp`` (RMA emulated by the node's progress thread). Tests whose outcome depends
on which one is in force say so in their name and skip under the other. Servers are real
processes on 127.0.0.1; nothing asserts a timing (what is measured is printed). What every
transport must do (killed and stalled nodes, refusals, reconnects) is in the conformance
suite; here is what only UCX shows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator

import attrs
import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric._plugins import plugin_manager
from kvfabric._runtime.codec import Writer
from kvfabric._runtime.native import gil_handoffs, gil_reacquisitions
from kvfabric.errors import PluginUnavailableError, TransportError
from kvfabric.keys import chain_keys
from kvfabric.spi import NodeEndpoint, Segment, TransportConfig
from kvfabric.testing import (
    Cluster,
    RegionServer,
    StoreConformance,
    TransportConformance,
    open_client,
    round_trip_works,
    segment_for,
    wait_for,
)

_MIB = 1 << 20
TLS = os.environ.get("UCX_TLS", "")


def _ucx_missing() -> str:
    try:
        plugin_manager().transport("ucx")
    except PluginUnavailableError as exc:
        return str(exc)
    return ""


_MISSING = _ucx_missing()
# tox's ucx envs set this: there a missing UCX is a failure, not a skip.
_REQUIRED = os.environ.get("KVFABRIC_REQUIRE_UCX") == "1"
needs_ucx = pytest.mark.skipif(
    bool(_MISSING) and not _REQUIRED, reason=f"ucx unavailable: {_MISSING}"
)
only_sm = pytest.mark.skipif(TLS != "sm", reason="shows CMA one-sidedness: run with UCX_TLS=sm")
only_tcp = pytest.mark.skipif(TLS != "tcp", reason="shows RMA emulation: run with UCX_TLS=tcp")


def _tls_env() -> dict[str, str]:
    return {"UCX_TLS": TLS} if TLS else {}


@needs_ucx
class TestUcxTransport(TransportConformance):
    @pytest.fixture
    def transport_name(self) -> str:
        return "ucx"

    @pytest.fixture
    def transport_env(self) -> dict[str, str]:
        return _tls_env()


@needs_ucx
class TestEmbeddedStoreOverUcx(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str) -> str:
        # The timeout bounds a hang, not the machine's speed: under UCX_TLS=tcp on a busy
        # host a 256 MiB put took more than the default 2 s.
        # dram.prefault off: a new store for each test, and preparing 512 MiB ahead
        # costs more than most tests (what they check does not depend on it).
        url = f"embedded://{unique_name}?capacity=512MiB&transport=ucx&timeout=60s"
        return f"{url}&dram.prefault=false"


@pytest.fixture(scope="module")
def ucx_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=1, transports=("ucx",), capacity="512MiB") as cluster:
        yield cluster


@needs_ucx
class TestClusterStoreOverUcx(StoreConformance):
    """The store suite against real controller and node processes, reading over ucx."""

    @pytest.fixture
    def store_url(self, ucx_cluster: Cluster) -> str:
        return ucx_cluster.url(transport="ucx", timeout="60s")


# -- helpers -------------------------------------------------------------------------------


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _as_bytes(values: list[memoryview | None]) -> list[bytes | None]:
    return [bytes(v) if v is not None else None for v in values]


@pytest.fixture
def server() -> Iterator[RegionServer]:
    server = RegionServer("ucx", env=_tls_env())
    yield server
    server.close()


# -- one-sidedness, end to end -------------------------------------------------------------


def _read_64_chunks_from_a_stopped_node(
    transport: str, timeout: str
) -> tuple[list[bytes | None], list[bytes], float]:
    """Put 64 chunks, prefetch them with a lookup, SIGSTOP the node, then get them."""
    with Cluster(nodes=1, transports=(transport,), capacity="256MiB", env=_tls_env()) as cluster:
        keys = _keys(64)
        values = [os.urandom(_MIB) for _ in keys]
        with kvfabric.connect(cluster.url(transport=transport, timeout="30s")) as writer:
            assert writer.batched_put(keys, values) == [PutOutcome.STORED] * 64
        with kvfabric.connect(cluster.url(transport=transport, timeout=timeout)) as reader:
            assert reader.batched_contains(keys) == 64  # every descriptor is now prefetched
            cluster.signal_node(0, signal.SIGSTOP)
            try:
                started = time.monotonic()
                got = _as_bytes(reader.batched_get(keys))
                elapsed = time.monotonic() - started
            finally:
                cluster.signal_node(0, signal.SIGCONT)
    return got, values, elapsed


@needs_ucx
@only_sm
def test_ucx_sm_reads_complete_and_validate_while_the_node_is_stopped() -> None:
    got, values, elapsed = _read_64_chunks_from_a_stopped_node("ucx", "5s")
    print(f"\nucx sm, node SIGSTOPped: 64 x 1 MiB read and validated in {elapsed * 1e3:.1f} ms")
    assert got == values


@needs_ucx
@only_tcp
def test_ucx_tcp_reads_from_a_stopped_node_end_in_misses_within_the_timeout() -> None:
    got, _, elapsed = _read_64_chunks_from_a_stopped_node("ucx", "1s")
    print(f"\nucx tcp, node SIGSTOPped: 64 misses after {elapsed:.2f} s (timeout 1 s)")
    assert got == [None] * 64


@needs_ucx
@only_tcp
def test_a_stopped_node_does_not_hold_up_reads_from_another_node() -> None:
    """One client, two nodes: reads from the healthy node complete while a read from the
    stopped one is still waiting (its timeout is far away); once continued, it lands."""
    stalled, healthy = RegionServer("ucx", env=_tls_env()), RegionServer("ucx", env=_tls_env())
    client = plugin_manager().transport("ucx").create_client(TransportConfig(timeout=60.0))
    try:
        client.connect(stalled.endpoint)
        healthy_endpoint = attrs.evolve(healthy.endpoint, node=2)
        client.connect(healthy_endpoint)
        data = os.urandom(64 * 1024)
        assert client.write(1, [segment_for(stalled.endpoint, 0, 0, data)]) == [None]
        assert client.write(2, [segment_for(healthy_endpoint, 0, 0, data)]) == [None]
        stalled.stop()
        stalled_dest = bytearray(len(data))
        outcome: list[object] = []

        def read_stalled() -> None:
            try:
                outcome.append(client.read(1, [segment_for(stalled.endpoint, 0, 0, stalled_dest)]))
            except TransportError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=read_stalled)
        waiter.start()
        reads = 0
        until = time.monotonic() + 1.0  # long enough for the stalled read to be posted
        while time.monotonic() < until or reads < 10:
            dest = bytearray(len(data))
            assert client.read(2, [segment_for(healthy_endpoint, 0, 0, dest)]) == [None]
            assert dest == data
            reads += 1
        assert waiter.is_alive(), f"the stalled read ended early: {outcome}"
        print(f"\n{reads} reads from the healthy node while the stopped node's read waited")
        stalled.resume()
        waiter.join()
        assert outcome == [[None]]
        assert stalled_dest == data
    finally:
        stalled.resume()
        client.close()
        stalled.close()
        healthy.close()


# -- faults --------------------------------------------------------------------------------


@needs_ucx
def test_refused_segments_never_reach_the_node_and_it_keeps_serving(
    server: RegionServer,
) -> None:
    """UCX itself checks nothing: over tcp a wild address would crash the node."""
    endpoint = server.endpoint
    handle = endpoint.regions[0]
    client = open_client("ucx", endpoint)
    try:
        wild = [
            Segment(handle.region, handle.rkey, 1 << 40, memoryview(bytearray(4096))),
            Segment(handle.region, handle.rkey, handle.size - 1, memoryview(bytearray(2))),
            Segment(handle.region, handle.rkey ^ 1, 0, memoryview(bytearray(64))),
            Segment(handle.region, handle.rkey, -4096, memoryview(bytearray(64))),
        ]
        assert all(isinstance(e, TransportError) for e in client.read(1, wild))
        assert all(isinstance(e, TransportError) for e in client.write(1, wild))
    finally:
        client.close()
    assert server.process.poll() is None
    assert round_trip_works("ucx", endpoint)


_READER = """
import sys
from kvfabric._runtime.codec import Reader
from kvfabric._plugins import plugin_manager
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportConfig

endpoint = NodeEndpoint.read_from(Reader(bytes.fromhex(sys.argv[1])))
count, chunk = int(sys.argv[2]), int(sys.argv[3])
per_region = endpoint.regions[0].size // chunk
client = plugin_manager().transport("ucx").create_client(TransportConfig(timeout=30))
client.connect(endpoint)
reads = []
for i in range(count):
    handle = endpoint.regions[i // per_region]
    offset = (i % per_region) * chunk
    reads.append(Segment(handle.region, handle.rkey, offset, memoryview(bytearray(chunk))))
client.read(1, reads)
print("reading", flush=True)
while True:
    client.read(1, reads)
"""


def _endpoint_hex(endpoint: NodeEndpoint) -> str:
    writer = Writer()
    endpoint.write_to(writer)
    return writer.getvalue().hex()


@contextlib.contextmanager
def _reader_process(endpoint: NodeEndpoint, count: int, chunk: int) -> Iterator[None]:
    """Another client process reading ``count`` chunks in a loop until the block ends."""
    child = subprocess.Popen(
        [sys.executable, "-c", _READER, _endpoint_hex(endpoint), str(count), str(chunk)],
        stdout=subprocess.PIPE,
        env={**os.environ, **_tls_env()},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"reading"
        yield
    finally:
        child.kill()
        child.wait()


@needs_ucx
@pytest.mark.xfail(
    TLS == "tcp",
    reason="UCX's software RMA over tcp aborts the node when a reply cannot be sent to a "
    "client that vanished ('unexpected error' in ucp_request_try_send; see docs/ucx.md)",
    strict=False,
)
def test_a_client_killed_mid_batch_leaves_the_node_serving(server: RegionServer) -> None:
    endpoint = server.endpoint
    with _reader_process(endpoint, count=2, chunk=endpoint.regions[0].size):
        # Reads in flight for a while: leaving the block kills the reader mid-batch.
        time.sleep(0.3)
    # Time for the node to meet the vanished client: a crash it would cause has no
    # outcome to poll for, so the check is that the node is still there afterwards.
    time.sleep(0.2)
    assert server.process.poll() is None
    assert round_trip_works("ucx", endpoint)


@needs_ucx
def test_ucx_log_lines_never_corrupt_the_stdout_handshake() -> None:
    """UCX logs to stdout by default; at info level it prints while the node starts."""
    server = RegionServer("ucx", env={**_tls_env(), "UCX_LOG_LEVEL": "info"})
    try:
        assert round_trip_works("ucx", server.endpoint)
    finally:
        server.close()


# -- the GIL -------------------------------------------------------------------------------


def _count_for(seconds: float) -> float:
    """Pure-Python work: increments per second."""
    n = 0
    started = time.perf_counter()
    end = started + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n / (time.perf_counter() - started)


@needs_ucx
def test_a_python_thread_keeps_running_while_reads_are_in_flight() -> None:
    """The counter's rate during reads here, against idle and against the same reads run by
    another process (which costs it CPU, not the GIL): the second ratio is the GIL's share."""
    server = RegionServer("ucx", env=_tls_env(), capacity=256 * _MIB, region_size=64 * _MIB)
    endpoint = server.endpoint
    client = open_client("ucx", endpoint, timeout=30.0)
    chunk = 4 * _MIB
    dests = [np.ones(chunk, dtype=np.uint8) for _ in range(64)]
    reads = [segment_for(endpoint, i // 16, (i % 16) * chunk, d) for i, d in enumerate(dests)]
    try:
        assert client.read(1, reads) == [None] * 64  # warm: endpoint, pages, protocols
        idle_rate = max(_count_for(0.3) for _ in range(3))  # this host is shared: best of 3
        rates: list[float] = []
        counter = threading.Thread(target=lambda: rates.append(_count_for(1.0)))
        batches = 0
        started = time.perf_counter()
        counter.start()
        while counter.is_alive():
            assert client.read(1, reads) == [None] * 64
            batches += 1
        seconds = time.perf_counter() - started
        counter.join()
        with _reader_process(endpoint, count=64, chunk=chunk):
            elsewhere_rate = _count_for(1.0)
    finally:
        client.close()
        server.close()
    share = rates[0] / idle_rate
    gil_share = rates[0] / elsewhere_rate
    gbps = batches * 64 * chunk / seconds / 1e9
    print(
        f"\nUCX_TLS={TLS or 'default'}: while {batches} batches of 64 x 4 MiB were read here "
        f"({gbps:.2f} GB/s), a counting thread kept {share:.2f} of its idle rate and "
        f"{gil_share:.2f} of its rate while another process did the same reads "
        f"(which kept {elsewhere_rate / idle_rate:.2f} of idle)"
    )
    assert batches >= 1


@needs_ucx
@pytest.mark.usefixtures("long_switch_interval")
def test_a_64_record_read_and_put_take_the_gil_back_once_per_batch() -> None:
    """Posts, progress, completion checks and CRCs run in kvfabric's native loops, which take
    the GIL back once per wait (counted by the module). A put waits twice where its headers'
    flush is a network round trip (UCX_TLS=tcp): the payloads' flush, then the headers'. A
    get's CRC pass, last in its call, ends on a helper thread while the GIL comes back."""
    name = f"ucx-gil-{os.urandom(4).hex()}"
    url = f"embedded://{name}?capacity=640MiB&transport=ucx&timeout=60s"
    values = [
        np.random.default_rng(i).integers(0, 256, 4 * _MIB, dtype=np.uint8) for i in range(64)
    ]
    dests = [np.ones(4 * _MIB, dtype=np.uint8) for _ in range(64)]
    with kvfabric.connect(url) as store:
        keys = _keys(64)
        before = gil_reacquisitions()
        outcomes = store.batched_put(keys, values)
        put_returns = gil_reacquisitions() - before
        assert store.batched_contains(keys) == 64
        before, handoffs = gil_reacquisitions(), gil_handoffs()
        got = store.batched_get(keys, into=dests)
        get_returns = gil_reacquisitions() - before
        get_handoffs = gil_handoffs() - handoffs
    assert {o.value for o in outcomes} == {"stored"}
    assert all(np.array_equal(g, v) for g, v in zip(got, values, strict=True))
    assert get_returns == 1
    assert get_handoffs == 1
    assert put_returns == (2 if TLS == "tcp" else 1)


# -- selection without UCX -----------------------------------------------------------------


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


_HINT = "pip install 'kvfabric[ucx]'"


def test_selecting_ucx_without_its_library_gives_the_install_hint() -> None:
    missing = {"KVFABRIC_UCX_LIB": "/nonexistent/libucp.so.0"}
    listed = _run("from kvfabric._tools.cli import main; main(['plugins'])", **missing)
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if " ucx " in f" {line} ")
    assert "unavailable" in row
    assert _HINT in listed.stdout  # with the reason, under "unavailable here"
    selected = _run(
        """
        import kvfabric
        from kvfabric.errors import PluginUnavailableError
        try:
            kvfabric.connect("embedded://?transport=ucx")
        except PluginUnavailableError as exc:
            print("refused:", exc)
        """,
        **missing,
    )
    assert "refused:" in selected.stdout
    if importlib.util.find_spec("cffi") is not None:  # else the missing cffi is the reason
        assert "/nonexistent/libucp.so.0" in selected.stdout
    assert _HINT in selected.stdout
    for result in (listed, selected):
        assert "Traceback" not in result.stderr


def test_kvfabric_node_without_ucx_says_how_to_install_it() -> None:
    node = subprocess.run(
        [sys.executable, "-m", "kvfabric", "node", "--transport", "ucx,tcp"],
        env={**os.environ, "KVFABRIC_UCX_LIB": "/nonexistent/libucp.so.0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert node.returncode == 2
    assert _HINT in node.stderr
    assert "Traceback" not in node.stderr


def test_selecting_ucx_without_cffi_gives_the_install_hint() -> None:
    result = _run(
        """
        import sys
        sys.modules["cffi"] = None  # as if it were not installed
        from kvfabric.errors import PluginUnavailableError
        from kvfabric._plugins import plugin_manager
        import kvfabric.transports.ucx  # imports without its native dependencies
        try:
            plugin_manager().transport("ucx")
        except PluginUnavailableError as exc:
            print("refused:", exc)
        """
    )
    assert "refused:" in result.stdout
    assert "cffi" in result.stdout
    assert _HINT in result.stdout
    assert "Traceback" not in result.stderr


# -- a node serving several transports -----------------------------------------------------


def _node_stats_reported_since_now(cluster: Cluster) -> dict[str, int]:
    """The node's counters from a heartbeat sent after this call (they ride heartbeats)."""
    seen = cluster.stats()["controller"].get("rpc_heartbeat", 0)
    # Two more: the first may have left the node before this call.
    stats = wait_for(
        "two more heartbeats",
        cluster.stats,
        until=lambda stats: stats["controller"].get("rpc_heartbeat", 0) >= seen + 2,
    )
    return next(v for k, v in stats.items() if k.startswith("node"))


@needs_ucx
def test_a_node_serving_ucx_shm_and_tcp_is_read_over_ucx_when_asked() -> None:
    with Cluster(nodes=1, transports=("ucx", "shm", "tcp"), env=_tls_env()) as cluster:
        keys = _keys(8)
        values = [os.urandom(100_000) for _ in keys]
        with kvfabric.connect(cluster.url(transport="ucx")) as forced:
            assert forced.batched_put(keys, values) == [PutOutcome.STORED] * 8
            assert _as_bytes(forced.batched_get(keys)) == values
        with kvfabric.connect(cluster.url()) as chosen:  # picks shm: preferred, same host
            assert _as_bytes(chosen.batched_get(keys)) == values
        # tcp, which the node also serves, moved none of it.
        assert _node_stats_reported_since_now(cluster)["tcp_requests"] == 0
