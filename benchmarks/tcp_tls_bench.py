"""What TLS costs the tcp data plane, against plain tcp, over 127.0.0.1 in one process tree.

    python benchmarks/tcp_tls_bench.py [--repeat 9]

Two real node processes (each with its controller), one plain and one with ``tcp.tls=true``
(a self-signed certificate made with the openssl command), both with a secret. For 64
chunks of 4 MiB: one client's batched read and write on each, and a small read on a fresh
connection (``tcp.pool=0``: the handshake, TLS included, paid on every call). Then a keyed
MAC alone over the same 256 MiB on one core, the work a per-reply MAC would add on each
side instead of TLS. Samples are taken round-robin, so load from elsewhere on the machine
hits every row alike. Prints medians, GB/s and the ratio to the plain row of the same op.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvfabric._control.security import Credentials
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric.spi.transport import NodeEndpoint, Segment, TransportClient, TransportConfig
from kvfabric.transports.tcp import TcpTransport

_COUNT, _SIZE = 64, 4 << 20
_SECRET = b"tcp tls bench"


def _certificate(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "node.pem", directory / "node.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def _endpoint(cluster: LocalCluster) -> NodeEndpoint:
    return next(e for e in cluster.node_infos()[0].endpoints if e.transport == "tcp")


def _client(endpoint: NodeEndpoint, **options: str) -> TransportClient:
    key = Credentials.from_secret(_SECRET).data_token
    config = TransportConfig(timeout=60.0, token=key, options=TcpTransport.parse_options(options))
    client = TcpTransport.create_client(config)
    client.connect(endpoint)
    return client


def _batch(client: TransportClient, op: str, segments: list[Segment]) -> Callable[[], None]:
    call = client.read if op == "read" else client.write

    def run() -> None:
        assert call(1, segments) == [None] * len(segments)

    return run


def _medians(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Median time of each, sampled round-robin so load from elsewhere hits all alike."""
    for fn in fns:
        fn()  # warm up: page faults, socket windows, the connection pool
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, times in zip(fns, samples, strict=True):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return [statistics.median(times) for times in samples]


def _rows(plain: NodeEndpoint, tls: NodeEndpoint, ca: Path) -> dict[str, Callable[[], None]]:
    payloads = [np.random.default_rng(i).bytes(_SIZE) for i in range(_COUNT)]
    dests = [np.empty(_SIZE, dtype=np.uint8) for _ in range(_COUNT)]
    tls_options = {"tls": "true", "tls_ca": str(ca)}
    rows: dict[str, Callable[[], None]] = {}
    for name, endpoint, options in (("plain", plain, {}), ("tls", tls, tls_options)):
        handle = endpoint.regions[0]

        def at(i: int, buf: Any, handle: Any = handle) -> Segment:
            return Segment(handle.region, handle.rkey, i * _SIZE, memoryview(buf).cast("B"))

        client = _client(endpoint, **options)
        fresh = _client(endpoint, pool="0", **options)
        small = [at(0, bytearray(4096))]
        rows[f"{name} read"] = _batch(client, "read", [at(i, d) for i, d in enumerate(dests)])
        rows[f"{name} write"] = _batch(client, "write", [at(i, p) for i, p in enumerate(payloads)])
        rows[f"{name} 4 KiB read, fresh connection"] = _batch(fresh, "read", small)
    data = b"".join(payloads)

    def hmac_sha256() -> None:
        hmac.digest(bytes(32), data, "sha256")

    def blake2b() -> None:
        hashlib.blake2b(data, key=bytes(32)).digest()

    rows["mac: HMAC-SHA256 of the batch, one core"] = hmac_sha256
    rows["mac: keyed BLAKE2b of the batch, one core"] = blake2b
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the tcp transport with and without TLS")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)

    total = _COUNT * _SIZE
    capacity = str(total + (16 << 20))
    with tempfile.TemporaryDirectory(prefix="kvfabric-tls-bench-") as directory:
        cert, key = _certificate(Path(directory))
        tls_args = [
            "--transport-opt", "tcp.tls=true",
            "--transport-opt", f"tcp.tls_cert={cert}",
            "--transport-opt", f"tcp.tls_key={key}",
        ]  # fmt: skip
        # Real node processes (and their controllers), as clients meet them.
        with (
            LocalCluster(nodes=1, transports=("tcp",), capacity=capacity, secret=_SECRET) as plain,
            LocalCluster(
                nodes=1, transports=("tcp",), capacity=capacity, secret=_SECRET, node_args=tls_args
            ) as tls,
        ):
            rows = _rows(_endpoint(plain), _endpoint(tls), cert)
            seconds = dict(zip(rows, _medians(list(rows.values()), args.repeat), strict=True))
    print(f"\n{_COUNT} x {_SIZE >> 20} MiB ({total >> 20} MiB), median of {args.repeat}")
    print(f"{'path':<40} {'median ms':>10} {'GB/s':>8} {'x plain':>8}")
    for name, took in seconds.items():
        # Each row against the plain row of its op; a MAC alone against a plain read.
        baseline = seconds.get(f"plain {name.split(' ', 1)[1]}", seconds["plain read"])
        rate = "" if "fresh" in name else f"{total / took / 1e9:>8.2f}"
        print(f"{name:<40} {took * 1e3:>10.2f} {rate:>8} {baseline / took:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
