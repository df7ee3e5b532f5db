"""InfiniStore on ``kvfabric bench``'s workload, over TCP.

Run by ``kvfabric bench`` under the peers' interpreter, inside a private network namespace
(InfiniStore binds 0.0.0.0 whatever it is told). The server is a process of its own with a
``--capacity`` memory pool (whole GiB, as InfiniStore sizes it), started as its own
``infinistore`` command would, less the management HTTP server (not used here), the
OOM-score change (refused inside the namespace) and uvloop (see ``_serve``). Its pool is
registered with an RDMA device even for TCP clients; where the machine has none,
``stand_in_verbs.c`` (built here with ``cc``, LD_PRELOADed into the server only) stands in
for the NIC, populating the pool as pinning it would.

InfiniStore's TCP client moves one key per call: ``tcp_write_cache`` from a pointer,
``tcp_read_cache`` into a new array per key (it has no read-into over TCP), and a lookup of
many keys is ``get_match_last_index`` (one round trip). Per size: put fresh (new keys,
medians of ``--repeat`` samples) and get; for the largest batch, contains of its keys and
reads (contains + get) alone and beside a busy Python thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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

SYSTEM = "infinistore"
_SERVICE_PORT = 22345  # the namespace is private: fixed ports cannot collide
_MANAGE_PORT = 18080
_HERE = Path(__file__).resolve().parent
# A sample that comes back wrong is measured again on a new connection, at most this often.
_ATTEMPTS = 5
T = TypeVar("T")


def _import() -> Any:
    try:
        import infinistore  # type: ignore[import-not-found]
    except ImportError as exc:
        unavailable(
            f"InfiniStore does not import ({exc}): pip install --no-deps 'infinistore==0.2.35' "
            "numpy in the peers' venv; it needs libibverbs (apt-get install libibverbs1)"
        )
    return infinistore


def _serve(capacity: int) -> None:
    """The server: InfiniStore's start-up (``register_server``), then its loop, until killed.

    Its own server hands the loop of uvloop to the libuv InfiniStore bundles (1.41); the
    libuv of uvloop releases after 0.17 runs watchers that one cannot (the server aborts on
    an assertion). So the loop here is made and run by InfiniStore's bundled libuv itself.
    """
    import ctypes

    infinistore = _import()
    import infinistore._infinistore as native  # type: ignore[import-not-found]

    libs = Path(infinistore.__file__).resolve().parent.parent / "infinistore.libs"
    found = sorted(libs.glob("libuv*.so*"))
    if not found:
        raise RuntimeError(f"InfiniStore's bundled libuv is not in {libs}")
    libuv = ctypes.CDLL(str(found[0]))
    libuv.uv_default_loop.restype = ctypes.c_void_p
    libuv.uv_run.argtypes = [ctypes.c_void_p, ctypes.c_int]
    loop = libuv.uv_default_loop()
    config = infinistore.ServerConfig(
        manage_port=_MANAGE_PORT,
        service_port=_SERVICE_PORT,
        log_level="warning",
        prealloc_size=max(1, -(-capacity // (1 << 30))),  # whole GiB, rounded up
    )
    config.verify()
    if native.register_server(loop, config) < 0:
        raise RuntimeError("InfiniStore's register_server failed")
    print("ready", flush=True)
    libuv.uv_run(loop, 0)  # UV_RUN_DEFAULT; ctypes lets the GIL go meanwhile


def _stand_in_verbs(workdir: Path) -> str | None:
    """The NIC stand-in, built for the server; None where a real RDMA device exists."""
    if Path("/sys/class/infiniband").exists() and any(Path("/sys/class/infiniband").iterdir()):
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        unavailable("no RDMA device and no C compiler to build its stand-in (apt-get install gcc)")
    out = workdir / "stand_in_verbs.so"
    built = subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", str(_HERE / "stand_in_verbs.c"), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        unavailable(
            "no RDMA device, and its stand-in did not build (apt-get install libibverbs-dev): "
            + built.stderr.strip()[-300:]
        )
    return str(out)


@contextlib.contextmanager
def _server(capacity: int, workdir: Path) -> Iterator[str]:
    env = dict(os.environ)
    stand_in = _stand_in_verbs(workdir)
    if stand_in is not None:
        env["LD_PRELOAD"] = stand_in
    log = workdir / "server.log"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--capacity", str(capacity)],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child holds it
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # its own log lines may come first
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the InfiniStore server did not start: {log.read_text()[-2000:]}")
        yield "with a stand-in for the RDMA NIC" if stand_in else ""
    finally:
        proc.kill()
        proc.wait()


class _WrongReply(Exception):
    """A read that came back with other bytes, another size, or an error."""


class _Client:
    """InfiniStore's TCP client over two connections, taken in turn, request by request.

    Its server answers a get with the header and the value's chunks in write callbacks, and
    only takes the connection's next request for a new one once the last chunk's callback
    has run; a request that arrives before is answered as a repeat of the previous get (the
    rest of the stream misaligned, and a failed read crashes the client). A client that
    sends its next request as soon as the value is in hits that nearly every time on one
    connection; taking two in turn leaves each connection's callback a whole request of the
    other's to run in. A sample that still comes back wrong is measured again on new
    connections, and the rows say how often that happened.
    """

    def __init__(self, infinistore: Any) -> None:
        self._config = infinistore.ClientConfig(
            host_addr="127.0.0.1",
            service_port=_SERVICE_PORT,
            connection_type=infinistore.TYPE_TCP,
            log_level="warning",
        )
        self._lib = infinistore
        self._conns: list[Any] = []
        self._turn = 0
        self.retries = 0
        self.connect()

    def connect(self) -> None:
        for conn in self._conns:
            conn.close()
        self._conns = [self._lib.InfinityConnection(self._config) for _ in range(2)]
        with contextlib.redirect_stdout(sys.stderr):  # it prints "connecting to ..."
            for conn in self._conns:
                conn.connect()

    @property
    def conn(self) -> Any:
        self._turn ^= 1
        return self._conns[self._turn]

    def close(self) -> None:
        for conn in self._conns:
            conn.close()

    def retrying(self, measure: Callable[[], T]) -> T:
        for _ in range(_ATTEMPTS):
            try:
                return measure()
            except _WrongReply:
                self.retries += 1
                self.connect()
        raise RuntimeError(f"InfiniStore's TCP reads came back wrong {_ATTEMPTS} times in a row")

    def note(self, text: str) -> str:
        if not self.retries:
            return text
        return f"{text}; {self.retries} sample(s) came back wrong, measured again"


def main() -> None:
    if "--serve" in sys.argv:
        sys.argv.remove("--serve")
        _serve(parse_args(__doc__.splitlines()[0]).capacity)
        return
    args = parse_args(__doc__.splitlines()[0])
    infinistore = _import()
    import numpy as np

    count, repeat = args.count, args.repeat
    biggest = max(args.sizes)
    src = np.random.default_rng(1).integers(0, 256, count * biggest, dtype=np.uint8)
    with tempfile.TemporaryDirectory() as workdir, _server(args.capacity, Path(workdir)) as how:
        client = _Client(infinistore)
        # The connection's first request, before anything is timed.
        client.conn.tcp_write_cache(
            uuid.uuid4().hex, src.ctypes.data, min(WARM_UP_BYTES, src.nbytes)
        )
        batches: dict[int, list[str]] = {}
        for size in args.sizes:

            def put(size: int = size) -> None:
                keys = [f"{uuid.uuid4().hex}-{i}" for i in range(count)]
                for i, key in enumerate(keys):
                    client.conn.tcp_write_cache(key, src.ctypes.data + i * size, size)
                batches[size] = keys

            seconds = median_seconds(put, repeat, warm_up=False)
            emit(SYSTEM, Phase.PUT_FRESH, size, count, seconds, how)
        for size in args.sizes:
            keys = batches[size]
            expected = src[: count * size].reshape(count, size)
            got: list[Any] = []

            def get(size: int = size, keys: list[str] = keys, got: list[Any] = got) -> None:
                try:
                    got[:] = [client.conn.tcp_read_cache(key) for key in keys]
                except Exception as exc:
                    raise _WrongReply(str(exc)) from exc
                if any(g is None or len(g) != size for g in got):
                    raise _WrongReply("a value of another size")

            def checked_get(
                get: Any = get, got: list[Any] = got, expected: Any = expected
            ) -> float:
                seconds = median_seconds(get, max(repeat, GET_SAMPLES))
                if not all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True)):
                    raise _WrongReply("other bytes than were put")
                return seconds

            def contains(keys: list[str] = keys) -> None:
                # The index of the last key it holds: all of them, stored in this order.
                if client.conn.get_match_last_index(keys) != count - 1:
                    raise RuntimeError("InfiniStore lost a key")

            seconds = client.retrying(checked_get)
            note = client.note("a new array per key; two connections in turn")
            emit(SYSTEM, Phase.GET, size, count, seconds, note)
            if size == biggest:
                samples = max(repeat, LOOKUP_SAMPLES)
                seconds = median_seconds(contains, samples)
                emit(SYSTEM, Phase.CONTAINS, 0, count, seconds, "get_match_last_index")

                def reads(get: Any = get, contains: Any = contains) -> None:
                    contains()
                    get()

                alone, beside, kept = client.retrying(
                    lambda reads=reads: beside_busy(reads, args.busy_seconds)
                )
                emit(SYSTEM, Phase.READS_ALONE, size, count, alone, client.note(""))
                emit(SYSTEM, Phase.READS_BUSY, size, count, beside, client.note(""), kept)
        client.close()


if __name__ == "__main__":
    main()
