"""Conformance tests every transport must pass (the server side runs in its own process).

A plugin author subclasses :class:`TransportConformance` and overrides the one fixture it
must (``transport_name``; it fails until overridden) and, if the server needs it,
``transport_env``. Every other fixture is the suite's own. Tests read the transport's
declared capabilities where the right outcome depends on them (a one-sided transport may
still serve a read from a stopped or killed node; a two-sided one cannot), and assert
outcomes (bytes, errors, counts), never timings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import crc32c
import numpy as np
import pytest

import kvfabric
from kvfabric._plugins import plugin_manager
from kvfabric.errors import ConfigError, TransportError, TransportTimeoutError
from kvfabric.spi import (
    Capabilities,
    MemoryKind,
    NodeEndpoint,
    NodeInfo,
    OptionSpec,
    Segment,
    Transport,
    TransportClient,
    TransportConfig,
)
from kvfabric.testing.polling import wait_until_stopped

__all__ = [
    "MakeClient",
    "RegionServer",
    "TransportConformance",
    "open_client",
    "round_trip_works",
    "segment_for",
]

_MIB = 1 << 20
_REGION_SERVER = Path(__file__).with_name("region_server.py")
# A bound only a hang reaches: a test that must not wait for a timeout sets this one, and
# tells a real failure (an error now) from waiting it out (a TransportTimeoutError).
_PATIENT = 60.0
# Long enough that a busy 2-core machine serves a healthy read well within it.
_STALL_TIMEOUT = 3.0


class RegionServer:
    """:mod:`kvfabric.testing.region_server` in a child process; ``endpoint`` reaches it
    (node 1). The child runs the module's file by path: ``-m`` would import this package, and
    pytest with it, in every server a test starts."""

    def __init__(
        self,
        transport: str,
        *,
        backend: str = "dram",
        capacity: int = 8 * _MIB,
        region_size: int = 4 * _MIB,
        token: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(_REGION_SERVER),
                "--transport",
                transport,
                "--backend",
                backend,
                "--capacity",
                str(capacity),
                "--region-size",
                str(region_size),
                "--token",
                token,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=10)
            raise RuntimeError(
                f"region server for {transport!r} exited ({self.process.returncode})"
            )
        info = NodeInfo.from_bytes(bytes.fromhex(line.decode().strip()))
        info = attrs.evolve(info, id=1)
        self.info = info
        self.endpoint = attrs.evolve(
            next(e for e in info.endpoints if e.transport == transport), node=1
        )

    def stop(self) -> None:
        """SIGSTOP the server and wait until it is stopped."""
        os.kill(self.process.pid, signal.SIGSTOP)
        wait_until_stopped(self.process.pid)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def segment_for(endpoint: NodeEndpoint, region: int, offset: int, buf: Any) -> Segment:
    """A segment of ``buf`` at ``offset`` in the endpoint's ``region``-th region."""
    handle = endpoint.regions[region]
    return Segment(handle.region, handle.rkey, offset, memoryview(buf).cast("B"))


def open_client(
    transport: str,
    endpoint: NodeEndpoint,
    *,
    timeout: float = 2.0,
    token: bytes = b"",
    options: Mapping[str, str] | None = None,
) -> TransportClient:
    """A client of the named transport, connected to ``endpoint`` (as node 1); ``options``:
    the transport's own (``{"pool": "2"}`` for ``tcp.pool=2``)."""
    cls = plugin_manager().transport(transport)
    config = TransportConfig(timeout=timeout, token=token, options=cls.parse_options(options or {}))
    client = cls.create_client(config)
    client.connect(endpoint)
    return client


def round_trip_works(transport: str, endpoint: NodeEndpoint, *, token: bytes = b"") -> bool:
    """A fresh, good client can still write and read back through the node."""
    data = os.urandom(4096)
    client = open_client(transport, endpoint, token=token)
    try:
        assert client.write(1, [segment_for(endpoint, 0, 8192, data)]) == [None]
        dest = bytearray(4096)
        assert client.read(1, [segment_for(endpoint, 0, 8192, dest)]) == [None]
        return dest == data
    finally:
        client.close()


class MakeClient(Protocol):
    """The ``make_client`` fixture: a connected client, closed when the test ends."""

    def __call__(self, endpoint: NodeEndpoint, timeout: float = 2.0) -> TransportClient: ...


def _pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _refused(error: TransportError | None, reason: str) -> bool:
    return isinstance(error, TransportError) and reason in str(error)


class TransportConformance:
    """Mixin: override ``transport_name`` (and ``transport_env`` if the server needs it)."""

    # -- the fixtures a plugin overrides ---------------------------------------------------

    @pytest.fixture
    def transport_name(self) -> str:
        """The transport's entry-point name. Override it: the suite fails until you do."""
        pytest.fail(f"{type(self).__name__} must override the transport_name fixture")

    @pytest.fixture
    def transport_env(self) -> dict[str, str]:
        """Extra environment for the server process (e.g. ``UCX_TLS``); optional."""
        return {}

    # -- the suite's own fixtures ----------------------------------------------------------

    @pytest.fixture
    def transport_cls(self, transport_name: str) -> type[Transport]:
        return plugin_manager().transport(transport_name)

    @pytest.fixture(scope="class")
    def _shared_servers(self) -> Iterator[dict[tuple[str, ...], RegionServer]]:
        servers: dict[tuple[str, ...], RegionServer] = {}
        yield servers
        for server in servers.values():
            server.close()

    @pytest.fixture
    def server(
        self,
        transport_name: str,
        transport_env: dict[str, str],
        _shared_servers: dict[tuple[str, ...], RegionServer],
    ) -> RegionServer:
        """A server the class's tests share: each writes what it reads, none stops or kills
        it, and starting a process costs more than most tests (restarted if one died)."""
        key = (transport_name, *sorted(f"{k}={v}" for k, v in transport_env.items()))
        server = _shared_servers.get(key)
        if server is None or server.process.poll() is not None:
            server = _shared_servers[key] = RegionServer(transport_name, env=transport_env)
        return server

    @pytest.fixture
    def own_server(
        self, transport_name: str, transport_env: dict[str, str]
    ) -> Iterator[RegionServer]:
        """A server of the test's own, for a test that stops or kills it."""
        server = RegionServer(transport_name, env=transport_env)
        yield server
        server.close()

    @pytest.fixture
    def endpoint(self, server: RegionServer) -> NodeEndpoint:
        return server.endpoint

    @pytest.fixture
    def make_client(self, transport_cls: type[Transport]) -> Iterator[MakeClient]:
        clients: list[TransportClient] = []

        def make(endpoint: NodeEndpoint, timeout: float = 2.0) -> TransportClient:
            config = TransportConfig(timeout=timeout, options=transport_cls.parse_options({}))
            client = transport_cls.create_client(config)
            clients.append(client)
            client.connect(endpoint)
            return client

        yield make
        for client in clients:
            client.close()

    @pytest.fixture
    def client(self, make_client: MakeClient, endpoint: NodeEndpoint) -> TransportClient:
        return make_client(endpoint)

    # -- what the class declares -----------------------------------------------------------

    def test_capabilities_preference_and_options_are_declared_as_data(
        self, transport_cls: type[Transport], transport_name: str
    ) -> None:
        caps = transport_cls.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.memory_kinds
        assert all(isinstance(k, MemoryKind) for k in caps.memory_kinds)
        assert transport_cls.name == transport_name
        assert isinstance(transport_cls.preference, int)
        assert all(isinstance(o, OptionSpec) for o in transport_cls.options)
        defaults = transport_cls.parse_options({})
        assert defaults == {o.name: o.default for o in transport_cls.options}

    def test_an_undeclared_option_is_refused_with_the_declared_ones(
        self, transport_cls: type[Transport], transport_name: str
    ) -> None:
        with pytest.raises(ConfigError) as caught:
            kvfabric.connect(f"embedded://?transport={transport_name}&{transport_name}.nope=1")
        assert "nope" in str(caught.value)
        for option in transport_cls.options:
            assert option.name in str(caught.value)

    def test_every_region_is_registered_with_its_rkey(self, server: RegionServer) -> None:
        handles = {h.region: h for h in server.endpoint.regions}
        for region in server.info.regions:
            assert handles[region.id].rkey == region.rkey
            assert handles[region.id].size == region.size

    def test_its_own_node_on_this_host_is_reachable(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        assert client.reachable(endpoint)

    # -- moving bytes ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("offset", "length"), [(0, 1), (3, 4099), (4096, 64 * 1024), (100, _MIB), (0, 4 * _MIB)]
    )
    def test_write_then_read_round_trips(
        self, client: TransportClient, endpoint: NodeEndpoint, offset: int, length: int
    ) -> None:
        data = _pattern(length, length)
        assert client.write(1, [segment_for(endpoint, 0, offset, data)]) == [None]
        dest = bytearray(length)
        assert client.read(1, [segment_for(endpoint, 0, offset, dest)]) == [None]
        assert dest == data

    def test_batch_lands_each_segment_in_its_own_buffer(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        count, size = 256, 12_000
        blobs = [_pattern(size, i) for i in range(count)]
        writes = [
            segment_for(endpoint, i % 2, (i // 2) * 16_384, blob) for i, blob in enumerate(blobs)
        ]
        assert client.write(1, writes) == [None] * count
        dests = [bytearray(size) for _ in range(count)]
        reads = [
            segment_for(endpoint, i % 2, (i // 2) * 16_384, dest) for i, dest in enumerate(dests)
        ]
        assert client.read(1, reads) == [None] * count
        assert dests == blobs

    def test_threads_sharing_a_client_each_land_their_own_bytes(
        self, make_client: MakeClient, endpoint: NodeEndpoint
    ) -> None:
        blobs = [_pattern(64 * 1024, 100 + i) for i in range(16)]
        client = make_client(endpoint, _PATIENT)
        failures: list[str] = []

        def place(i: int, buf: Any) -> Segment:
            return segment_for(endpoint, i % 2, (i // 2) * 128 * 1024, buf)

        def work(seed: int) -> None:
            for round_ in range(25):
                picks = [(seed + round_ + k) % 16 for k in range(4)]
                dests = [bytearray(64 * 1024) for _ in picks]
                reads = [place(i, d) for i, d in zip(picks, dests, strict=True)]
                try:
                    errors = client.read(1, reads)
                except TransportError as exc:
                    failures.append(f"thread {seed}: {exc}")
                    return
                if errors != [None] * 4 or dests != [blobs[i] for i in picks]:
                    failures.append(f"thread {seed}, round {round_}: wrong bytes")

        assert client.write(1, [place(i, b) for i, b in enumerate(blobs)]) == [None] * 16
        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []

    def test_read_lands_in_the_callers_buffer(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        data = _pattern(256 * 1024, 7)
        client.write(1, [segment_for(endpoint, 1, 8192, data)])
        array = np.zeros(256 * 1024, dtype=np.uint8)
        assert client.read(1, [segment_for(endpoint, 1, 8192, array)]) == [None]
        assert array.tobytes() == data

    def test_a_multidimensional_contiguous_buffer_moves_as_its_bytes(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        source = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
        handle = endpoint.regions[0]
        assert source.data.ndim == 2
        assert client.write(1, [Segment(handle.region, handle.rkey, 0, source.data)]) == [None]
        dest = np.zeros((64, 256), dtype=np.float32)
        assert client.read(1, [Segment(handle.region, handle.rkey, 0, dest.data)]) == [None]
        assert np.array_equal(dest, source)

    # -- small reads (the lookup image's) --------------------------------------------------

    def test_a_small_read_lands_every_segment_and_says_so(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        data = _pattern(8192, 40)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        header, log = bytearray(64), bytearray(6144)
        reads = [segment_for(endpoint, 0, 0, header), segment_for(endpoint, 0, 2048, log)]
        for _ in range(3):  # again and again, as an image reader does
            header[:], log[:] = bytes(64), bytes(6144)
            assert client.read_small(1, reads) is True
            assert header == data[:64]
            assert log == data[2048 : 2048 + 6144]

    def test_a_small_read_with_a_refused_segment_says_so_and_the_next_one_works(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        data = _pattern(4096, 41)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        handle = endpoint.regions[0]
        dest = bytearray(64)
        for bad in (
            Segment(handle.region, handle.rkey ^ 1, 0, memoryview(bytearray(64))),
            Segment(handle.region, handle.rkey, handle.size - 8, memoryview(bytearray(64))),
            Segment(999, handle.rkey, 0, memoryview(bytearray(64))),
        ):
            assert client.read_small(1, [segment_for(endpoint, 0, 0, dest), bad]) is False
        dest[:] = bytes(64)
        assert client.read_small(1, [segment_for(endpoint, 0, 0, dest)]) is True
        assert dest == data[:64]

    def test_a_small_read_from_a_node_never_connected_is_a_transport_error(
        self, client: TransportClient
    ) -> None:
        with pytest.raises(TransportError):
            client.read_small(77, [Segment(0, 1, 0, memoryview(bytearray(8)))])

    # -- checksums with the bytes ---------------------------------------------------------

    def test_a_checksummed_read_gives_each_span_the_crc_of_what_landed(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        # Records as a reader frames them: a header, then one or more payload pieces; a
        # span per payload, and an empty payload whose span is empty.
        pieces = [_pattern(n, 20 + n) for n in (64, 300_000, 4096, 1, 64, 64, 1 << 20)]
        offsets = [0]
        for piece in pieces[:-1]:
            offsets.append(offsets[-1] + len(piece))
        writes = [segment_for(endpoint, 0, o, p) for o, p in zip(offsets, pieces, strict=True)]
        assert client.write(1, writes) == [None] * len(pieces)
        dests = [bytearray(len(p)) for p in pieces]
        reads = [segment_for(endpoint, 0, o, d) for o, d in zip(offsets, dests, strict=True)]
        spans = [(1, 3), (4, 4), (5, 7)]
        errors, crcs = client.read_checksummed(1, reads, spans)
        assert errors == [None] * len(pieces)
        assert dests == pieces
        assert crcs == [crc32c.crc32c(b"".join(pieces[a:b])) for a, b in spans]

    def test_a_checksummed_read_refuses_a_bad_segment_and_lands_and_checksums_the_rest(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        data = _pattern(8192, 30)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        handle = endpoint.regions[0]
        refused = bytearray(b"\xaa" * 16)
        dest = bytearray(8192)
        reads = [
            Segment(handle.region, handle.rkey ^ 1, 0, memoryview(refused)),
            segment_for(endpoint, 0, 0, dest),
        ]
        errors, crcs = client.read_checksummed(1, reads, [(0, 1), (1, 2)])
        assert _refused(errors[0], "rkey")
        assert errors[1] is None
        assert refused == b"\xaa" * 16
        assert dest == data
        assert crcs[1] == crc32c.crc32c(data)

    def test_a_checksummed_write_stores_payloads_then_the_trailer_made_of_their_crcs(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        payloads = [_pattern(n, 40 + n) for n in (200_000, 5000, 1 << 20)]
        # Record i's payload at 64 + its offset, its 8-byte trailer (its CRC, twice) at 0 of
        # the other region, as a header is written after its payload.
        offsets = [64, 64 + 200_000, 64 + 205_000]
        writes = [segment_for(endpoint, 0, o, p) for o, p in zip(offsets, payloads, strict=True)]
        made: list[list[int]] = []

        def trailer(crcs: list[int]) -> list[Segment]:
            made.append(list(crcs))
            return [
                segment_for(endpoint, 1, 8 * i, crc.to_bytes(4, "little") * 2)
                for i, crc in enumerate(crcs)
            ]

        spans = [(0, 1), (1, 3)]
        errors, crcs = client.write_checksummed(1, writes, spans, trailer)
        assert errors == [None] * (len(writes) + len(spans))
        want = [crc32c.crc32c(payloads[0]), crc32c.crc32c(payloads[1] + payloads[2])]
        assert crcs == want
        # A transport that streams its trailer first plans it from placeholder CRCs.
        assert made[-1] == want
        dests = [bytearray(len(p)) for p in payloads] + [bytearray(16)]
        reads = [segment_for(endpoint, 0, o, d) for o, d in zip(offsets, dests[:-1], strict=True)]
        assert client.read(1, [*reads, segment_for(endpoint, 1, 0, dests[-1])]) == [None] * 4
        assert dests[:-1] == payloads
        assert dests[-1] == b"".join(c.to_bytes(4, "little") * 2 for c in want)

    # -- what is refused before anything moves ------------------------------------------

    def test_wrong_rkey_is_refused_without_bytes(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        good = _pattern(4096, 1)
        client.write(1, [segment_for(endpoint, 0, 0, good)])
        handle = endpoint.regions[0]
        dest = bytearray(b"\xaa" * 4096)
        ok_dest = bytearray(4096)
        bad = Segment(handle.region, handle.rkey ^ 0x5A5A, 0, memoryview(dest))
        errors = client.read(1, [bad, segment_for(endpoint, 0, 0, ok_dest)])
        assert _refused(errors[0], "rkey")
        assert errors[1] is None
        assert dest == b"\xaa" * 4096
        assert ok_dest == good

    def test_write_with_wrong_rkey_changes_nothing(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        original = _pattern(4096, 2)
        client.write(1, [segment_for(endpoint, 0, 0, original)])
        handle = endpoint.regions[0]
        bad = Segment(handle.region, handle.rkey + 1, 0, memoryview(b"\x00" * 4096))
        assert _refused(client.write(1, [bad])[0], "rkey")
        dest = bytearray(4096)
        client.read(1, [segment_for(endpoint, 0, 0, dest)])
        assert dest == original

    @pytest.mark.parametrize("where", ["past_end", "straddling_end", "negative"])
    def test_out_of_bounds_is_refused_without_bytes(
        self, client: TransportClient, endpoint: NodeEndpoint, where: str
    ) -> None:
        size = endpoint.regions[0].size
        offset = {"past_end": size + 4096, "straddling_end": size - 100, "negative": -64}[where]
        dest = bytearray(b"\xbb" * 1000)
        errors = client.read(1, [segment_for(endpoint, 0, offset, dest)])
        assert _refused(errors[0], "bounds")
        assert dest == b"\xbb" * 1000
        assert _refused(client.write(1, [segment_for(endpoint, 0, offset, dest)])[0], "bounds")

    def test_unknown_region_is_refused(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        handle = endpoint.regions[0]
        dest = bytearray(16)
        errors = client.read(1, [Segment(999, handle.rkey, 0, memoryview(dest))])
        assert _refused(errors[0], "unknown region")

    def test_a_read_only_destination_is_refused_and_the_rest_lands(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        data = _pattern(4096, 4)
        client.write(1, [segment_for(endpoint, 0, 0, data)])
        backing = bytearray(b"\xcc" * 4096)
        handle = endpoint.regions[0]
        read_only = Segment(handle.region, handle.rkey, 0, memoryview(backing).toreadonly())
        ok_dest = bytearray(4096)
        errors = client.read(1, [read_only, segment_for(endpoint, 0, 0, ok_dest)])
        assert _refused(errors[0], "read-only")
        assert errors[1] is None
        assert backing == b"\xcc" * 4096
        assert ok_dest == data

    def test_a_read_into_immutable_bytes_is_refused_and_the_object_is_unchanged(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        # 128 KiB: past the size where copies go through ctypes.memmove, which writes
        # through any address it is given, read-only or not.
        size = 128 * 1024
        client.write(1, [segment_for(endpoint, 0, 0, _pattern(size, 5))])
        immutable = b"\x01" * size
        errors = client.read(1, [segment_for(endpoint, 0, 0, immutable)])
        assert _refused(errors[0], "read-only")
        assert immutable == b"\x01" * size

    def test_a_non_contiguous_buffer_is_refused_both_ways(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        original = _pattern(8192, 6)
        client.write(1, [segment_for(endpoint, 0, 0, original)])
        handle = endpoint.regions[0]
        backing = bytearray(8192)
        strided = memoryview(backing)[::2]
        columns = np.zeros((64, 128), dtype=np.uint8)[:, ::2].data
        for view in (strided, columns):
            segment = Segment(handle.region, handle.rkey, 0, view)
            assert _refused(client.read(1, [segment])[0], "contiguous")
            assert _refused(client.write(1, [segment])[0], "contiguous")
        assert backing == bytes(8192)
        dest = bytearray(8192)
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == original

    def test_zero_length_segment_is_fine(
        self, client: TransportClient, endpoint: NodeEndpoint
    ) -> None:
        assert client.read(1, [segment_for(endpoint, 0, 64, bytearray(0))]) == [None]

    # -- the peer table -----------------------------------------------------------------

    def test_node_never_connected_is_a_transport_error(self, client: TransportClient) -> None:
        with pytest.raises(TransportError):
            client.read(77, [Segment(0, 1, 0, memoryview(bytearray(8)))])

    def test_a_disconnected_or_closed_client_refuses_reads(
        self, make_client: MakeClient, endpoint: NodeEndpoint
    ) -> None:
        client = make_client(endpoint)
        client.disconnect(1)
        with pytest.raises(TransportError):
            client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))])
        client.connect(endpoint)
        assert client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))]) == [None]
        client.close()
        with pytest.raises(TransportError):
            client.read(1, [segment_for(endpoint, 0, 0, bytearray(8))])

    def test_reconnecting_replaces_the_node_only_when_its_endpoint_changed(
        self,
        make_client: MakeClient,
        server: RegionServer,
        transport_name: str,
        transport_env: dict[str, str],
    ) -> None:
        first = server.endpoint
        first_data = _pattern(1000, 8)
        client = make_client(first)
        assert client.write(1, [segment_for(first, 0, 0, first_data)]) == [None]
        client.connect(first)  # the same endpoint again: nothing changes
        dest = bytearray(1000)
        assert client.read(1, [segment_for(first, 0, 0, dest)]) == [None]
        assert dest == first_data
        other = RegionServer(transport_name, env=transport_env)
        try:
            second = other.endpoint  # node 1 again, somewhere else
            client.connect(second)
            second_data = _pattern(1000, 9)
            assert client.write(1, [segment_for(second, 0, 0, second_data)]) == [None]
            dest = bytearray(1000)
            assert client.read(1, [segment_for(second, 0, 0, dest)]) == [None]
            assert dest == second_data
        finally:
            other.close()
        witness = make_client(first)
        dest = bytearray(1000)
        assert witness.read(1, [segment_for(first, 0, 0, dest)]) == [None]
        assert dest == first_data  # the write after the reconnect went to the new node

    # -- faults -------------------------------------------------------------------------

    def test_killed_node_fails_fast_not_at_the_timeout(
        self,
        make_client: MakeClient,
        transport_cls: type[Transport],
        own_server: RegionServer,
    ) -> None:
        """A dead node is an error at once (a two-sided transport), or, for a one-sided one
        that still reaches memory it mapped, the very bytes that were written: never a wait
        for the timeout."""
        server = own_server
        endpoint = server.endpoint
        data = _pattern(64 * 1024, 3)
        client = make_client(endpoint, _PATIENT)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        server.kill()
        outcomes = []
        for _ in range(2):  # on what the client held (a connection, an endpoint), then afresh
            dest = bytearray(len(data))
            started = time.monotonic()
            try:
                errors = client.read(1, [segment_for(endpoint, 0, 0, dest)])
            except TransportTimeoutError as exc:
                pytest.fail(f"a read from a killed node waited for the timeout: {exc}")
            except TransportError as exc:
                outcomes.append(f"failed after {time.monotonic() - started:.3f} s: {exc}")
                continue
            assert transport_cls.capabilities.one_sided, (
                "a two-sided transport read from a node that no longer runs"
            )
            assert errors == [None]
            assert dest == data
            outcomes.append("read from memory the client still maps")
        print(f"\nkilled node: {outcomes}")

    def test_stalled_node_times_out_then_a_fresh_read_works(
        self,
        make_client: MakeClient,
        transport_cls: type[Transport],
        own_server: RegionServer,
    ) -> None:
        """A stopped node's read ends at the timeout (two-sided), or lands the written bytes
        (one-sided, where the node's CPU is not needed); once it runs again, reads work."""
        server = own_server
        endpoint = server.endpoint
        data = _pattern(64 * 1024, 10)
        client = make_client(endpoint, _STALL_TIMEOUT)
        assert client.write(1, [segment_for(endpoint, 0, 0, data)]) == [None]
        server.stop()
        try:
            dest = bytearray(len(data))
            try:
                errors = client.read(1, [segment_for(endpoint, 0, 0, dest)])
            except TransportTimeoutError:
                outcome = "timed out"
            else:
                assert transport_cls.capabilities.one_sided, (
                    "a two-sided transport was served by a stopped node"
                )
                assert errors == [None]
                assert dest == data
                outcome = "served without the node's CPU"
        finally:
            server.resume()
        print(f"\nstopped node: {outcome}")
        dest = bytearray(len(data))
        assert client.read(1, [segment_for(endpoint, 0, 0, dest)]) == [None]
        assert dest == data
