"""The lookup image served over a transport from a process of its own, not the controller.

Over a transport that is not one-sided (``tcp``), a lookup's read of the image needs a CPU
on the serving side: in the controller, that CPU would be taken per lookup by threads that
share its GIL with allocations and publishes. :class:`ImageProcessServer` moves that work
to a child process that maps the image read-only (the controller's memfd, opened by path)
and runs the transport's own server against it; the controller's CPU does nothing per
lookup, and a write sent to the image is refused (the mapping is read-only).

The child lives as long as the controller: it serves until its stdin closes (the
controller closed it, or died, kill -9 included) and ignores SIGINT (a Ctrl-C at the
controller's terminal is the controller's to handle). A child that died is started again
by :meth:`ImageProcessServer.revive` (the controller's loop calls it every tick, and it
never waits for the new child to start, so the loop keeps answering meanwhile); clients
reading the old address fall back to the control RPC and ask where the image went.

The pipe is private to the two processes (the controller's own child, on its stdin and
stdout), so what goes over it is pickled: the transport's name and configuration, and the
region to map, one way; the region's handle and the server's address, or why it could
not start, the other; then counters on request.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

import attrs

from kvfabric.errors import TransportError
from kvfabric.spi import MemoryKind, Region, RegionHandle, TransportConfig, TransportServer

__all__ = ["ImageProcessServer", "main"]

log = logging.getLogger(__name__)

# Starting the child imports kvfabric and the transport, which a loaded host may take
# seconds over.
_START_TIMEOUT = 30.0
# After a start that failed, the next try waits this long (each tick would be a busy loop).
_RETRY_AFTER = 1.0
_STATS_TIMEOUT = 1.0
_STOP_TIMEOUT = 2.0
_STATS = b"stats\n"


@attrs.frozen(kw_only=True)
class _Request:
    """What the child serves: the transport, and the image region to map by path."""

    transport: str
    config: TransportConfig
    path: str
    offset: int
    size: int
    region: int
    rkey: int


@attrs.frozen(kw_only=True)
class _Started:
    handle: RegionHandle | None
    address: bytes
    error: str = ""


class ImageProcessServer(TransportServer):
    """A :class:`~kvfabric.spi.TransportServer` for the lookup image alone, run in a child
    process; ``register`` starts it (one region: the image)."""

    def __init__(self, transport: str, config: TransportConfig) -> None:
        self.transport = transport
        self._config = config
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._request: _Request | None = None
        self._handle: RegionHandle | None = None
        self._address = b""
        self._closed = False
        self._starting: tuple[subprocess.Popen[bytes], float] | None = None
        """A child :meth:`revive` started and has not heard from yet, and its deadline."""
        self._retry_at = 0.0
        self.restarts = 0

    @property
    def address(self) -> bytes:
        return self._address

    def register(self, region: Region) -> RegionHandle:
        if region.path is None:
            raise TransportError(
                f"{self.transport}: the lookup image is served from a process of its own, "
                "which needs a region another process can map (one with a path)"
            )
        if self._request is not None:
            raise TransportError(f"{self.transport}: this server serves one image only")
        self._request = _Request(
            transport=self.transport,
            config=self._config,
            path=region.path,
            offset=region.path_offset,
            size=region.size,
            region=region.id,
            rkey=region.rkey,
        )
        with self._lock:
            return self._start()

    def revive(self) -> bool:
        """Start the child again if it died; True once a new one serves (its address may
        differ).

        Called every tick of the controller's loop, so it never waits for the child: a
        child takes a second or more to start on a loaded host, and a loop held that long
        would answer no client meanwhile. It starts one, and a later call adopts it once it
        has said where it serves (or gives up on it at its deadline and tries again).
        """
        with self._lock:
            if self._closed or self._request is None:
                return False
            if self._starting is not None:
                return self._adopt_started()
            child = self._child
            if child is not None:
                code = child.poll()
                if code is None:
                    return False
                log.warning(
                    "the lookup image's %s server (pid %d) exited with %s: starting it again",
                    self.transport,
                    child.pid,
                    code,
                )
                _reap(child)
                self._child = None
            elif time.monotonic() < self._retry_at:
                return False
            try:
                self._starting = (self._spawn(), time.monotonic() + _START_TIMEOUT)
            except TransportError as exc:
                self._failed_start(str(exc))
                return False
            return self._adopt_started()

    def _adopt_started(self) -> bool:
        """The starting child, if it has answered: True when it serves now."""
        assert self._starting is not None
        child, deadline = self._starting
        assert child.stdout is not None
        if not select.select([child.stdout], [], [], 0)[0]:
            if child.poll() is None and time.monotonic() < deadline:
                return False  # still starting
            self._starting = None
            _stop(child)
            self._failed_start("its process did not answer in time or exited")
            return False
        self._starting = None
        try:
            self._adopt(child, pickle.load(child.stdout))
        except (OSError, EOFError, pickle.UnpicklingError, TransportError) as exc:
            _stop(child)
            self._failed_start(str(exc) or type(exc).__name__)
            return False
        self.restarts += 1
        return True

    def _failed_start(self, why: str) -> None:
        log.warning("the lookup image's %s server did not start: %s", self.transport, why)
        self._retry_at = time.monotonic() + _RETRY_AFTER

    def stats(self) -> dict[str, int]:
        """The child's transport counters (none while it is down), and its restarts."""
        with self._lock:
            counters: dict[str, int] = {}
            child = self._child
            if child is not None and child.poll() is None:
                with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError, TimeoutError):
                    assert child.stdin is not None
                    assert child.stdout is not None
                    child.stdin.write(_STATS)
                    child.stdin.flush()
                    counters = _read_message(child.stdout, time.monotonic() + _STATS_TIMEOUT)
            return {**counters, "restarts": self.restarts}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
            starting, self._starting = self._starting, None
        for process in (child, starting[0] if starting is not None else None):
            if process is not None:
                _stop(process)

    # -- the child ------------------------------------------------------------------------

    def _start(self) -> RegionHandle:
        """Start the child and wait until it serves (at the controller's start)."""
        child = self._spawn()
        try:
            assert child.stdout is not None
            started = _read_message(child.stdout, time.monotonic() + _START_TIMEOUT)
        except (OSError, EOFError, pickle.UnpicklingError, TimeoutError) as exc:
            _stop(child)
            raise TransportError(
                f"{self.transport}: the lookup image's server process did not start ({exc})"
            ) from exc
        return self._adopt(child, started)

    def _spawn(self) -> subprocess.Popen[bytes]:
        """A child process, handed what it serves; it answers when it serves."""
        assert self._request is not None
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "kvfabric._control.image_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        except OSError as exc:
            raise TransportError(
                f"{self.transport}: the lookup image's server process did not start ({exc})"
            ) from exc
        try:
            assert child.stdin is not None
            child.stdin.write(pickle.dumps(self._request))
            child.stdin.flush()
        except OSError as exc:
            _stop(child)
            raise TransportError(
                f"{self.transport}: the lookup image's server process did not start ({exc})"
            ) from exc
        return child

    def _adopt(self, child: subprocess.Popen[bytes], started: object) -> RegionHandle:
        """Serve through ``child``, which answered ``started``."""
        if not isinstance(started, _Started) or started.handle is None:
            _stop(child)
            why = started.error if isinstance(started, _Started) else "an unexpected reply"
            raise TransportError(f"{self.transport}: {why}")
        self._child = child
        self._handle = started.handle
        self._address = started.address
        log.info(
            "lookup image served over %s by pid %d at %s",
            self.transport,
            child.pid,
            started.address.decode(errors="replace"),
        )
        return started.handle


def _read_message(stream: IO[bytes], deadline: float) -> Any:
    """One pickled message from the child, within ``deadline`` (TimeoutError)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
        raise TimeoutError("no answer from the image server process")
    # A pickled message is written whole in one flush: once its first byte is here, the rest
    # follows at once.
    return pickle.load(stream)


def _stop(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if child.stdin is not None:
            child.stdin.close()
    try:
        child.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
    _reap(child)


def _reap(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        child.wait(_STOP_TIMEOUT)
    if child.stdout is not None:
        child.stdout.close()
    with contextlib.suppress(OSError):
        if child.stdin is not None:
            child.stdin.close()


# -- the child's side ----------------------------------------------------------------------


def _serve(request: _Request, out: IO[bytes]) -> TransportServer | None:
    # Imported here: the controller imports this module without starting any transport.
    from kvfabric._plugins import plugin_manager

    try:
        fd = os.open(request.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(
                fd,
                request.size,
                mmap.MAP_SHARED,
                mmap.PROT_READ,
                offset=request.offset,
            )
        finally:
            os.close(fd)
        region = Region(
            id=request.region,
            size=request.size,
            rkey=request.rkey,
            kind=MemoryKind.DRAM,
            view=memoryview(mapping),
        )
        server = plugin_manager().transport(request.transport).create_server(request.config)
    except (OSError, ValueError, TransportError) as exc:
        pickle.dump(_Started(handle=None, address=b"", error=str(exc)), out)
        out.flush()
        return None
    try:
        handle = server.register(region)
    except TransportError as exc:
        server.close()
        pickle.dump(_Started(handle=None, address=b"", error=str(exc)), out)
        out.flush()
        return None
    pickle.dump(_Started(handle=handle, address=server.address), out)
    out.flush()
    return server


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    requests, out = sys.stdin.buffer, sys.stdout.buffer
    request = pickle.load(requests)
    server = _serve(request, out)
    if server is None:
        return 1
    try:
        # Serve until the controller closes our stdin (or dies); answer counters meanwhile.
        for line in requests:
            if line == _STATS:
                pickle.dump(server.stats(), out)
                out.flush()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    # Through the module's own name, so what it pickles names classes the controller has
    # (run with -m, this file is ``__main__``).
    from kvfabric._control import image_process

    raise SystemExit(image_process.main())
