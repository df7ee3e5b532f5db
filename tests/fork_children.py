"""Running work in forked children, as engines fork: ``os.fork``, ``multiprocessing`` with the
fork start method (a process each, and a pre-forked pool of workers), and a forking server.

Every child is bounded: one that has not answered within :data:`BOUND` seconds is killed and
the test fails saying it hung (the bound tells a hang from a slow machine, never a timing to
meet). Results come back pickled; the work must return plain values.

:func:`round_trip` is what each child does with a store it inherited, and
:func:`holding_locks` holds, on a parent thread, every lock the store's parts hold, so a fork
happens while they are taken.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import select
import signal
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvfabric import PutOutcome, Store
from kvfabric._plugins import PluginManager
from kvfabric.keys import chain_keys

__all__ = [
    "BOUND",
    "MECHANISMS",
    "ChildReport",
    "holding_locks",
    "in_children",
    "parent_still_whole",
    "round_trip",
]

BOUND = 60.0
"""Seconds a child may take before it counts as hung."""

MECHANISMS = ("os.fork", "multiprocessing", "pool", "forking-server")

Work = Callable[[], Any]


@attrs.frozen(kw_only=True)
class ChildReport:
    """What a child saw, for the parent to check."""

    pid: int
    namespace: bytes
    """The namespace of the child's keys (``chain_key`` over ``range(count)``)."""
    outcomes: list[str]
    own: list[bytes | None]
    expected: list[bytes]
    contains: int
    theirs: list[bytes | None]
    transports: list[str | None]
    counts: dict[str, int]
    """The child store's non-zero counters, said when a check fails."""


def round_trip(
    store: Store, theirs: Sequence[bytes], count: int = 64, size: int = 4096
) -> ChildReport:
    """Put ``count`` values of this child's own, read them back and count them, and read the
    parent's keys ``theirs``."""
    namespace = uuid.uuid4().bytes
    keys = chain_keys(list(range(count)), 1, namespace=namespace)
    tag = f"child {os.getpid()} ".encode()
    values = [(tag + str(i).encode()).ljust(size, b"c") for i in range(count)]
    outcomes = store.batched_put(keys, values)
    own = [None if v is None else bytes(v) for v in store.batched_get(keys)]
    contains = store.batched_contains(keys)
    seen = [None if v is None else bytes(v) for v in store.batched_get(list(theirs))]
    located = store.locate(keys[:1])
    transports = [store.records.transport_of(d.node) for d in located if d is not None]
    counts = {name: count for name, count in store.stats().items() if count}
    return ChildReport(
        pid=os.getpid(),
        namespace=namespace,
        outcomes=[o.name for o in outcomes],
        own=own,
        expected=values,
        contains=contains,
        theirs=seen,
        transports=transports,
        counts=counts,
    )


def check_child(report: ChildReport, theirs: Sequence[bytes] | None) -> None:
    """The child stored and read its own values exactly; ``theirs``: the parent's values it
    must have read (shared store), or None (a view of its own: it must have read none, and
    never a wrong one)."""
    assert report.pid != os.getpid()
    said = f"child {report.pid}: {_misread(report.own, report.expected)}; {report.counts}"
    assert report.outcomes == [PutOutcome.STORED.name] * len(report.expected), said
    assert report.own == report.expected, said
    assert report.contains == len(report.expected), said
    if theirs is None:
        assert report.theirs == [None] * len(report.theirs), said
    else:
        assert report.theirs == list(theirs), f"{_misread(report.theirs, theirs)}; {said}"


def _misread(got: Sequence[bytes | None], expected: Sequence[bytes]) -> str:
    """How ``got`` differs from ``expected``: misses and wrong values, counted apart."""
    misses = sum(g is None for g in got)
    wrong = sum(g is not None and g != e for g, e in zip(got, expected, strict=True))
    return f"{misses} misses and {wrong} wrong values of {len(expected)}"


def parent_still_whole(store: Store, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
    """The parent reads back every record it stored, exactly, and keeps storing."""
    assert store.batched_contains(keys) == len(keys)
    got = store.batched_get(keys)
    assert [None if g is None else bytes(g) for g in got] == list(values)
    more = chain_keys(list(range(32)), 1, namespace=uuid.uuid4().bytes)
    more_values = [b"parent after %d" % i for i in range(32)]
    assert store.batched_put(more, more_values) == [PutOutcome.STORED] * 32
    read = [bytes(g) if g is not None else None for g in store.batched_get(more)]
    # Said on failure: whether the misses were lookups, failed reads or held-off nodes.
    counts = {name: count for name, count in store.stats().items() if count}
    assert read == more_values, f"{sum(r is None for r in read)} misses of 32; {counts}"
    got = store.batched_get(keys)
    assert [None if g is None else bytes(g) for g in got] == list(values)
    stats = store.stats()
    failures = {
        name: stats[name]
        for name in (
            "controller_unavailable",
            "controller_errors",
            "transport_failures",
            "validation_failures",
            "put_failures",
        )
        if stats[name]
    }
    assert failures == {}


# -- children ----------------------------------------------------------------------------


def in_children(mechanism: str, work: Work, count: int = 2) -> list[Any]:
    """``work()``'s result in each of ``count`` children forked by ``mechanism`` (all alive at
    once); an exception in a child is raised here, a child past :data:`BOUND` fails."""
    run = {
        "os.fork": _by_os_fork,
        "multiprocessing": _by_processes,
        "pool": _by_pool,
        "forking-server": _by_forking_server,
    }[mechanism]
    outcomes = run(work, count)
    for outcome in outcomes:
        if isinstance(outcome, _Failed):
            raise AssertionError(f"a child ({mechanism}) failed: {outcome.error}")
    return outcomes


@attrs.frozen
class _Failed:
    error: str


def _outcome(work: Work) -> Any:
    try:
        return work()
    except BaseException as exc:  # the parent reports it
        return _Failed(f"{type(exc).__name__}: {exc}")


def _by_os_fork(work: Work, count: int) -> list[Any]:
    children: list[tuple[int, int]] = []
    for _ in range(count):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(read_end)
                data = pickle.dumps(_outcome(work))
                with os.fdopen(write_end, "wb") as out:
                    out.write(data)
            finally:
                os._exit(0)
        os.close(write_end)
        children.append((pid, read_end))
    deadline = time.monotonic() + BOUND
    results = []
    try:
        for pid, read_end in children:
            results.append(pickle.loads(_read_all(read_end, deadline, pid)))
    except BaseException:
        for pid, _ in children:
            _kill(pid)  # none is left behind, holding pytest's output open
        raise
    finally:
        for pid, read_end in children:
            os.close(read_end)
            _reap(pid)
    return results


def _read_all(fd: int, deadline: float, pid: int) -> bytes:
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            _kill(pid)
            raise AssertionError(f"child {pid} did not finish within {BOUND:g}s: it hung")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reap(pid: int) -> None:
    """Wait for the child to exit; past the bound (or once the test gave up on it), kill it."""
    deadline = time.monotonic() + BOUND
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            _kill(pid)
        time.sleep(0.01)


def _by_processes(work: Work, count: int) -> list[Any]:
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(count)]
    processes = [context.Process(target=_send_outcome, args=(work, sender)) for _, sender in pipes]
    for process in processes:
        process.start()
    deadline = time.monotonic() + BOUND
    results = []
    try:
        for process, (receiver, _) in zip(processes, pipes, strict=True):
            if not receiver.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"child {process.pid} did not answer within {BOUND:g}s")
            results.append(receiver.recv())
    finally:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return results


def _send_outcome(work: Work, sender: Any) -> None:
    sender.send(_outcome(work))


_pool_work: Work | None = None
_pool_barrier: Any = None


def _pool_task(_: int) -> Any:
    assert _pool_work is not None
    # Every worker takes one task: a worker waiting here takes no other.
    _pool_barrier.wait(BOUND)
    return _outcome(_pool_work)


def _by_pool(work: Work, count: int) -> list[Any]:
    """A pool of ``count`` workers forked up front (a pre-fork server), each doing the work
    once."""
    global _pool_work, _pool_barrier
    context = multiprocessing.get_context("fork")
    _pool_work, _pool_barrier = work, context.Barrier(count)
    pool = context.Pool(count)
    try:
        try:
            results = pool.map_async(_pool_task, range(count), chunksize=1).get(BOUND)
        except multiprocessing.TimeoutError:
            raise AssertionError(f"the pool's workers did not answer within {BOUND:g}s") from None
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        _pool_work = _pool_barrier = None
    return list(results)


class _ForkingServer(socketserver.ForkingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    block_on_close = False
    work: Work


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server = self.server
        assert isinstance(server, _ForkingServer)
        self.request.sendall(pickle.dumps(_outcome(server.work)))
        self.request.shutdown(socket.SHUT_WR)


def _by_forking_server(work: Work, count: int) -> list[Any]:
    """A server that forks a child per connection (``socketserver.ForkingMixIn``), serving
    from a thread of the parent while the parent's store stays in use."""
    server = _ForkingServer(("127.0.0.1", 0), _Handler)
    server.work = work
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        address = server.server_address
        conns = [socket.create_connection(address[:2], timeout=BOUND) for _ in range(count)]
        results = []
        for conn in conns:
            with conn:
                chunks = []
                while chunk := conn.recv(1 << 16):
                    chunks.append(chunk)
                results.append(pickle.loads(b"".join(chunks)))
        return results
    except TimeoutError:
        raise AssertionError(f"a forked server child did not answer within {BOUND:g}s") from None
    finally:
        server.shutdown()
        thread.join()
        for pid in list(server.active_children or ()):
            _kill(pid)
        server.server_close()


# -- locks held at the fork ----------------------------------------------------------------

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def locks_of(root: object) -> list[Any]:
    """Every lock reachable from ``root`` through kvfabric's objects and the thread pools,
    events and conditions they hold (not a thread's own, nor the plugin manager's: no store
    call takes it)."""
    seen: set[int] = set()
    found: list[Any] = []
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _LOCK_TYPES):
            found.append(obj)
        elif isinstance(obj, PluginManager | threading.Thread | type):
            continue  # a thread's own locks are its own; no store call takes the plugins'.
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("kvfabric", "concurrent.futures", "threading")):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    with contextlib.suppress(AttributeError):
                        stack.append(getattr(obj, slot))
    return found


@contextlib.contextmanager
def holding_locks(*roots: object) -> Iterator[int]:
    """Hold every lock of ``roots`` (:func:`locks_of`) on a parent thread while the body
    runs (it forks); yields how many were taken."""
    locks = [lock for root in roots for lock in locks_of(root)]
    taken = threading.Event()
    release = threading.Event()
    held: list[Any] = []

    def hold() -> None:
        for lock in locks:
            if lock.acquire(blocking=False):
                held.append(lock)
        taken.set()
        release.wait()
        for lock in reversed(held):
            lock.release()

    thread = threading.Thread(target=hold)
    thread.start()
    taken.wait()
    try:
        yield len(held)
    finally:
        release.set()
        thread.join()
