"""kvfabric's rows in ``kvfabric bench``: each transport against a controller and a data node of
its own (real processes, :class:`kvfabric._tools.local_cluster.LocalCluster`), a client in this
process.

Per transport, in this order (a fresh node first, so its first puts meet untouched memory):

- put fresh: ``count`` new keys per sample into a node just started (medians of ``repeat``
  samples, no warm-up sample: each sample writes memory no put wrote before);
- the node's memory filled once with puts (untimed), then per size: put warm (new keys
  into slots written before; the previous batch is deleted, untimed, so its slots come
  back), get (``batched_get(into=...)``, descriptors from a ``batched_contains`` before it,
  untimed; the bytes compared once), re-put (the same keys again: nothing to write);
- reads (``batched_contains`` + ``batched_get``) of the largest batch in a loop alone, then
  beside a busy pure-Python thread in this process, and the share of its rate the thread kept;
  then beside the same loop in a process of its own (CPU contention without the GIL);
- lookups: ``batched_contains`` of 16, 64, 1,024 and ``count`` stored keys, each labelled with
  the path the client's counters say it took (one-sided through the index's lookup image, or
  the control RPC), and the controller's CPU time per lookup of ``count`` keys, read from
  ``/proc/<pid>/stat`` around many lookups less the same time idle.

:func:`rpc_rows` measures the same lookups against a controller serving no lookup image
(``--transport none``), so the control RPC is measured beside the one-sided reads.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import attrs
import numpy as np

import kvfabric
from kvfabric._plugins import plugin_manager
from kvfabric._runtime.cpus import usable_cpus
from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import (
    GET_SAMPLES,
    LOOKUP_SAMPLES,
    WARM_UP_BYTES,
    Phase,
    beside_busy,
    beside_busy_process,
    median_seconds,
)
from kvfabric._tools.local_cluster import LocalCluster, image_server_pids
from kvfabric.errors import PluginError
from kvfabric.keys import chain_keys

__all__ = [
    "LOOKUP_KEYS",
    "TRANSPORTS",
    "KvfabricPlan",
    "rpc_rows",
    "scoped_environ",
    "transport_rows",
]

# Per bench transport: the transport's name and the environment its node and client need.
# ucx runs over shared memory (UCX_TLS=sm): the same-host case it is measured beside shm for.
TRANSPORTS: dict[str, tuple[str, dict[str, str]]] = {
    "tcp": ("tcp", {}),
    "shm": ("shm", {}),
    "ucx": ("ucx", {"UCX_TLS": "sm"}),
}
LOOKUP_KEYS = (16, 64, 1024)
# Rounds of the controller-CPU measure; the least is kept (see _lookup_rows).
_CPU_ROUNDS = 3
# The lookup chain's values: a lookup's cost does not depend on them, only the count.
_SMALL_VALUE = 4096
# The fill's batches: large, so filling takes few round trips whatever sizes are measured.
_FILL_CHUNK = 4 << 20
_FILL_COUNT = 16


@attrs.frozen(kw_only=True)
class KvfabricPlan:
    sizes: tuple[int, ...]
    count: int
    repeat: int
    capacity: int  # bytes of the node's memory
    busy_seconds: float  # per side of the busy-thread loop
    cpu_lookups: int  # lookups timed for the controller's CPU per lookup


def unavailable(name: str) -> str | None:
    """Why transport ``name`` cannot run here, or None."""
    transport, _ = TRANSPORTS[name]
    try:
        plugin_manager().transport(transport)
    except PluginError as exc:
        return str(exc).splitlines()[0]
    return None


@contextmanager
def scoped_environ(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` set in ``os.environ`` for the block (servers started in it inherit them),
    the previous values restored after."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _keys(count: int) -> list[bytes]:
    return chain_keys(list(range(count)), 1, namespace=uuid.uuid4().bytes)


def _values(count: int, size: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    return [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the command name, which may hold spaces: state is field 3, utime 14.
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transport_rows(name: str, plan: KvfabricPlan) -> list[BenchRow]:
    transport, env = TRANSPORTS[name]
    system = f"kvfabric {name}"
    count, repeat = plan.count, plan.repeat
    values = {size: _values(count, size) for size in plan.sizes}
    dests = {size: [np.ones(size, dtype=np.uint8) for _ in range(count)] for size in plan.sizes}

    def row(phase: str, size: int, seconds: float, **more: Any) -> BenchRow:
        return BenchRow(system=system, phase=phase, size=size, count=count, seconds=seconds, **more)

    rows: list[BenchRow] = []
    with (
        scoped_environ(env),
        _cluster(transport, plan.capacity, env) as cluster,
        kvfabric.connect(cluster.url(transport=transport, timeout="60s")) as store,
    ):
        # Connections and the first allocation, before anything is timed: WARM_UP_BYTES, as
        # every peer writes first. It opens every connection a large put uses (tcp's two
        # write lanes; a 4 KiB put opened one), so no timed put pays for a handshake.
        half = WARM_UP_BYTES // 2
        store.batched_put(_keys(2), [np.ones(half, dtype=np.uint8) for _ in range(2)])
        for size in plan.sizes:

            def fresh_put(size: int = size) -> None:
                store.batched_put(_keys(count), values[size])

            rows.append(
                row(Phase.PUT_FRESH, size, median_seconds(fresh_put, repeat, warm_up=False))
            )
        _fill(store, plan.capacity)
        for size in plan.sizes:
            written: list[list[bytes]] = []

            def next_keys(written: list[list[bytes]] = written) -> None:
                if written:
                    store.delete(written[-1])
                written.append(_keys(count))

            def put(size: int = size, written: list[list[bytes]] = written) -> None:
                store.batched_put(written[-1], values[size])

            rows.append(row(Phase.PUT_WARM, size, median_seconds(put, repeat, next_keys)))
            keys = written[-1]
            if store.batched_contains(keys) != count:
                raise RuntimeError(f"{system}: a warm put was not stored")

            def get(size: int = size, keys: list[bytes] = keys) -> None:
                got = store.batched_get(keys, into=dests[size])
                if any(g is None for g in got):
                    raise RuntimeError(f"{system}: a get missed")

            rows.append(
                row(
                    Phase.GET,
                    size,
                    median_seconds(
                        get, max(repeat, GET_SAMPLES), partial(store.batched_contains, keys)
                    ),
                )
            )
            if not all(
                np.array_equal(d, v) for d, v in zip(dests[size], values[size], strict=True)
            ):
                raise RuntimeError(f"{system}: a get returned other bytes than were put")
            rows.append(
                row(
                    Phase.RE_PUT,
                    size,
                    median_seconds(partial(store.batched_put, keys, values[size]), repeat),
                )
            )
            if size == max(plan.sizes):

                def reads(size: int = size, keys: list[bytes] = keys) -> None:
                    if store.batched_contains(keys) != count:
                        raise RuntimeError(f"{system}: a contains missed")
                    get(size, keys)

                alone, beside, kept = beside_busy(reads, plan.busy_seconds)
                cores = _cores_busy(reads, plan.busy_seconds, _server_pids(cluster))
                rows.append(row(Phase.READS_ALONE, size, alone, cores=cores, cpus=usable_cpus()))
                rows.append(row(Phase.READS_BUSY, size, beside, kept=kept))
                process = beside_busy_process(reads, plan.busy_seconds)
                rows.append(row(Phase.READS_BUSY_PROCESS, size, process))
        rows += _lookup_rows(system, store, _controller_pid(cluster), plan)
        if store.stats()["validation_failures"]:
            raise RuntimeError(f"{system}: validation failures during the benchmark")
    return rows


def _cluster(transport: str, capacity: int, env: dict[str, str]) -> LocalCluster:
    """A controller and one node serving ``transport``; the controller serves its lookup
    image over it too where it can (it serves tcp and shm by default)."""
    args = ["--grace", "0s"]
    if transport not in ("tcp", "shm"):
        try:
            return LocalCluster(
                nodes=1,
                transports=(transport,),
                capacity=str(capacity),
                controller_args=[*args, "--transport", f"tcp,shm,{transport}"],
                env=env,
            )
        except RuntimeError:
            pass  # a controller that cannot serve it: lookups as its default says
    return LocalCluster(
        nodes=1, transports=(transport,), capacity=str(capacity), controller_args=args, env=env
    )


def rpc_rows(plan: KvfabricPlan) -> tuple[list[BenchRow], str]:
    """Lookups through the control RPC: a controller that serves no lookup image.

    Returns the rows, or none and why (a controller without ``--transport``: its lookups
    are RPCs already, and the transport rows say so).
    """
    try:
        cluster = LocalCluster(
            nodes=1,
            transports=("tcp",),
            capacity=str(64 << 20),
            controller_args=["--grace", "0s", "--transport", "none"],
        )
    except RuntimeError as exc:
        return [], f"a controller without a lookup image did not start: {str(exc)[:200]}"
    with cluster, kvfabric.connect(cluster.url(transport="tcp")) as store:
        return _lookup_rows("kvfabric rpc", store, _controller_pid(cluster), plan), ""


def _server_pids(cluster: LocalCluster) -> list[int]:
    """The processes a client of ``cluster`` reads from: nodes, controller, image servers."""
    pids = [node.popen.pid for node in cluster.nodes if node is not None]
    controller = _controller_pid(cluster)
    return [*pids, controller, *image_server_pids(controller)]


def _cores_busy(fn: Callable[[], object], seconds: float, servers: Sequence[int]) -> float:
    """``fn`` in a loop for about ``seconds``: the CPU it kept busy, in cores, this process
    (every thread: the client's helpers count) and ``servers`` together."""
    fn()
    started = time.perf_counter()
    cpu = time.process_time() + sum(cpu_seconds(pid) for pid in servers)
    while time.perf_counter() - started < seconds:
        fn()
    spent = time.process_time() + sum(cpu_seconds(pid) for pid in servers) - cpu
    return spent / (time.perf_counter() - started)


def _controller_pid(cluster: LocalCluster) -> int:
    assert cluster.controller is not None
    return cluster.controller.popen.pid


def _fill(store: kvfabric.Store, capacity: int) -> None:
    """Write the node's whole memory once (the oldest records are evicted as it fills)."""
    values = _values(_FILL_COUNT, _FILL_CHUNK)
    for _ in range(capacity // (_FILL_CHUNK * _FILL_COUNT) + 2):
        store.batched_put(_keys(_FILL_COUNT), values)


def _path(before: dict[str, int], after: dict[str, int], calls: int) -> str:
    """Which way ``calls`` lookups went, from the client's counters."""
    onesided = after.get("onesided_lookups", 0) - before.get("onesided_lookups", 0)
    rpcs = after["control_rpcs"] - before["control_rpcs"]
    if onesided >= calls and rpcs == 0:
        return "one-sided"
    if onesided == 0:
        return "control RPC"
    return f"{onesided}/{calls} one-sided, {rpcs} RPCs"


def _lookup_rows(
    system: str, store: kvfabric.Store, controller_pid: int, plan: KvfabricPlan
) -> list[BenchRow]:
    counts = sorted({*LOOKUP_KEYS, plan.count})
    chain = _keys(max(counts))
    store.batched_put(chain, [np.ones(_SMALL_VALUE, dtype=np.uint8)] * len(chain))
    if store.batched_contains(chain) != len(chain):
        raise RuntimeError(f"{system}: the lookup chain was not stored")
    rows = []
    samples = max(plan.repeat, LOOKUP_SAMPLES)
    for n in counts:
        keys = chain[:n]
        before = store.stats()
        seconds = median_seconds(partial(store.batched_contains, keys), samples)
        path = _path(before, store.stats(), samples + 1)
        rows.append(
            BenchRow(
                system=system, phase=Phase.CONTAINS, size=0, count=n, seconds=seconds, note=path
            )
        )
    keys = chain[: plan.count]
    # The controller's own CPU, and apart from it that of the processes it serves its
    # image from (tcp): the work a lookup costs the serving side moved, it did not vanish.
    servers = image_server_pids(controller_pid)

    def cpu_now() -> tuple[float, float]:
        return cpu_seconds(controller_pid), sum(cpu_seconds(pid) for pid in servers)

    # Per lookup: CPU over the lookups less the same time idle (the controller's own
    # heartbeats and leases), the least of a few rounds. CPU time is counted in clock ticks
    # (10 ms): one tick of background work landing in a busy window and not in its idle
    # one reads as 10 us a lookup over 1,000 of them; a cost the lookups do have shows in
    # every round.
    before = store.stats()
    costs: list[list[float]] = []
    for _ in range(_CPU_ROUNDS):
        cpu, started = cpu_now(), time.perf_counter()
        for _ in range(plan.cpu_lookups):
            store.batched_contains(keys)
        busy = [b - a for a, b in zip(cpu, cpu_now(), strict=True)]
        wall = time.perf_counter() - started
        cpu = cpu_now()
        time.sleep(wall)
        idle = [b - a for a, b in zip(cpu, cpu_now(), strict=True)]
        costs.append([max(0.0, b - i) / plan.cpu_lookups for b, i in zip(busy, idle, strict=True)])
    after = store.stats()
    controller_cost, server_cost = (min(column) for column in zip(*costs, strict=True))
    lookups = plan.cpu_lookups * _CPU_ROUNDS
    rpcs = (after["control_rpcs"] - before["control_rpcs"]) / lookups
    served = f"; image server process {server_cost * 1e6:.0f} us" if servers else ""
    rows.append(
        BenchRow(
            system=system,
            phase=Phase.CONTROLLER_CPU,
            size=0,
            count=len(keys),
            seconds=controller_cost,
            note=f"{_path(before, after, lookups)}; {rpcs:g} control RPCs per lookup{served}",
        )
    )
    return rows
