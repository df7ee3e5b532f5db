"""Mooncake Store on ``kvfabric bench``'s workload, over its TCP transfer engine.

Run by ``kvfabric bench`` under the peers' interpreter, inside a private network namespace
(Mooncake binds 0.0.0.0 whatever it is told). Three processes, as kvfabric's rows have: the
master (``mooncake_master`` with its HTTP metadata server), a store node that mounts
``--capacity`` bytes of memory as its global segment, and the client here, which mounts none,
so every byte crosses the transfer engine to the node. The client's buffers are registered
once, and it moves them with ``batch_put_from`` / ``batch_get_into`` (no copies in Python);
a lookup is ``batch_is_exist``. Per size: put fresh (new keys into the node's memory, medians
of ``--repeat`` samples) and get; for the largest batch, contains of its keys and reads
(contains + get) alone and beside a busy Python thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from peer_common import (
    GET_SAMPLES,
    LOOKUP_SAMPLES,
    WARM_UP_BYTES,
    Phase,
    beside_busy,
    emit,
    median_seconds,
    parse_args,
    unavailable,
)

SYSTEM = "mooncake"
_RPC_PORT = 50051  # the namespace is private: fixed ports cannot collide
_METADATA_PORT = 8080
_MASTER = f"127.0.0.1:{_RPC_PORT}"
_METADATA = f"http://127.0.0.1:{_METADATA_PORT}/metadata"
_CLIENT_BUFFER = 16 << 20  # the client's own transfer buffer; data moves from registered ones


def _preload_cudart() -> None:
    """The non-CUDA wheel's store module still links libcudart.so.12; the
    nvidia-cuda-runtime-cu12 wheel ships it, outside the loader's path."""
    with contextlib.suppress(ImportError):
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        for root in nvidia.cuda_runtime.__path__:
            lib = Path(root) / "lib" / "libcudart.so.12"
            if lib.exists():
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _store() -> Any:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    _preload_cudart()
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]
    except ImportError as exc:
        unavailable(
            f"Mooncake Store does not import ({exc}): pip install "
            "'mooncake-transfer-engine-non-cuda==0.3.13' nvidia-cuda-runtime-cu12 "
            "in the peers' venv"
        )
    return MooncakeDistributedStore()


def _setup(store: Any, segment: int) -> None:
    rc = store.setup("127.0.0.1", _METADATA, segment, _CLIENT_BUFFER, "tcp", "", _MASTER)
    if rc != 0:
        raise RuntimeError(f"Mooncake store setup returned {rc}")


def _serve_node(capacity: int) -> None:
    """The store node: mounts ``capacity`` bytes, then lives until its stdin closes."""
    store = _store()
    _setup(store, capacity)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def _servers(capacity: int, logs: Path) -> Iterator[None]:
    master_bin = Path(sys.executable).parent / "mooncake_master"
    master = subprocess.Popen(
        [
            str(master_bin),
            f"--rpc_port={_RPC_PORT}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={_METADATA_PORT}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(logs / "master.log", "wb"),  # noqa: SIM115 - the child holds it
    )
    node: subprocess.Popen[str] | None = None
    try:
        _wait_port(_RPC_PORT)
        _wait_port(_METADATA_PORT)
        node = subprocess.Popen(
            [sys.executable, __file__, "--node", "--capacity", str(capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(logs / "node.log", "wb"),  # noqa: SIM115 - the child holds it
            text=True,
        )
        assert node.stdout is not None
        if node.stdout.readline().strip() != "ready":
            raise RuntimeError(
                f"the Mooncake node did not start: {(logs / 'node.log').read_text()}"
            )
        yield
    finally:
        for proc in (node, master):
            if proc is not None:
                proc.kill()
                proc.wait()


def _check(results: list[int], what: str, ok: int = 0) -> None:
    bad = [r for r in results if r != ok]
    if bad:
        raise RuntimeError(f"Mooncake {what} failed: {bad[:4]}")


def main() -> None:
    if "--node" in sys.argv:
        sys.argv.remove("--node")
        _serve_node(parse_args(__doc__.splitlines()[0]).capacity)
        return
    args = parse_args(__doc__.splitlines()[0])
    import numpy as np

    store = _store()
    count, repeat = args.count, args.repeat
    biggest = max(args.sizes)
    src = np.random.default_rng(1).integers(0, 256, count * biggest, dtype=np.uint8)
    dst = np.ones(count * biggest, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as logs, _servers(args.capacity, Path(logs)):
        _setup(store, 0)
        for buf in (src, dst):
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("Mooncake register_buffer failed")
        # Connections to the node, before anything is timed.
        warm_up = min(WARM_UP_BYTES, src.nbytes)
        _check(store.batch_put_from([uuid.uuid4().hex], [src.ctypes.data], [warm_up]), "put")
        batches: dict[int, list[str]] = {}
        for size in args.sizes:
            ptrs = [src.ctypes.data + i * size for i in range(count)]

            def put(size: int = size, ptrs: list[int] = ptrs) -> None:
                keys = [f"{uuid.uuid4().hex}-{i}" for i in range(count)]
                _check(store.batch_put_from(keys, ptrs, [size] * count), "batch_put_from")
                batches[size] = keys

            seconds = median_seconds(put, repeat, warm_up=False)
            emit(SYSTEM, Phase.PUT_FRESH, size, count, seconds)
        for size in args.sizes:
            keys = batches[size]
            into = [dst.ctypes.data + i * size for i in range(count)]

            def contains(keys: list[str] = keys) -> None:
                _check(store.batch_is_exist(keys), "batch_is_exist", ok=1)

            def get(size: int = size, keys: list[str] = keys, into: list[int] = into) -> None:
                _check(store.batch_get_into(keys, into, [size] * count), "batch_get_into", size)

            emit(SYSTEM, Phase.GET, size, count, median_seconds(get, max(repeat, GET_SAMPLES)))
            if not np.array_equal(dst[: count * size], src[: count * size]):
                raise RuntimeError("Mooncake returned other bytes than were put")
            if size == biggest:
                samples = max(repeat, LOOKUP_SAMPLES)
                seconds = median_seconds(contains, samples)
                emit(SYSTEM, Phase.CONTAINS, 0, count, seconds, "batch_is_exist")

                def reads(get: Any = get, contains: Any = contains) -> None:
                    contains()
                    get()

                alone, beside, kept = beside_busy(reads, args.busy_seconds)
                emit(SYSTEM, Phase.READS_ALONE, size, count, alone)
                emit(SYSTEM, Phase.READS_BUSY, size, count, beside, kept=kept)
        store.close()


if __name__ == "__main__":
    main()
