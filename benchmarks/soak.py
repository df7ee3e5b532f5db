"""Soak: real processes under churn, faults and hostile traffic, counting what must stay zero.

    python benchmarks/soak.py                               # 2 minutes, 40 fault rounds
    python benchmarks/soak.py --minutes 20 --fuzz 100000    # the long run (>= 1 M key ops)

(``tests/distributed/test_soak.py`` imports this module for a bounded run; its client
processes are spawned by module name, so it stays importable as ``soak``.)

A controller and two data nodes (``tcp`` and ``shm``, a small capacity so eviction never
stops) serve 8 client processes doing mixed put / contains / get / delete on overlapping keys;
every value is derived from its key, so any wrong byte is caught. Meanwhile:

- a fault thread kills (``SIGKILL``) a data node, the controller or a writer process at
  random, restarts it, and times how long until a fresh probe stores and reads again;
- fuzzers send mutated and random control frames to the controller and mutated and random
  requests to the nodes' tcp data ports.

It prints per-key operations, wrong values (must be 0), calls that outlived their bound
(must be 0), the ``NO_SPACE`` share of puts once the store is full, recovery times, fuzzed
frames sent and the servers' RSS before and after.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import random
import socket
import statistics
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import zmq

import kvfabric
from kvfabric import PutOutcome
from kvfabric._tools.local_cluster import LocalCluster
from kvfabric._wire import member_bodies as mb
from kvfabric._wire import protocol as p
from kvfabric._wire import write_bodies as wb
from kvfabric.keys import fold_key
from kvfabric.spi import AllocationRequest, GrantRef

__all__ = ["SoakConfig", "SoakReport", "run_soak"]

# A client call must return within this (controller and node timeouts are 1-2 s; the rest is
# slack for a loaded machine): anything longer is a hang, counted as "outlived".
CALL_BOUND = 15.0
FAULT_SETTLE = 2.0
"""Seconds after service is back that still count as the fault's window: a restarted node or
controller is re-publishing restored records then, and restoring space is never evicted."""


@attrs.frozen(kw_only=True)
class SoakConfig:
    seconds: float = 120.0
    clients: int = 8
    keys: int = 3000
    value_sizes: tuple[int, int] = (1024, 256 * 1024)
    capacity: str = "48MiB"
    fault_rounds: int = 40
    fuzz_frames: int = 20_000
    faults: bool = True
    seed: int = 0


@attrs.frozen(kw_only=True)
class SoakReport:
    ops: int
    wrong_values: int
    outlived: int
    puts_after_full: int
    no_space_after_full: int
    puts_in_faults: int
    no_space_in_faults: int
    outcomes: dict[str, int]
    recoveries: list[tuple[str, float]]
    fuzzed_control: int
    fuzzed_data: int
    rss_before: dict[str, int]
    rss_after: dict[str, int]

    @property
    def no_space_share(self) -> float:
        """Of the puts once full, outside fault windows: what churn alone costs."""
        return self.no_space_after_full / max(self.puts_after_full, 1)

    @property
    def no_space_share_in_faults(self) -> float:
        """Of the puts once full that overlapped a fault window: while a node or the
        controller is down or restoring, its space cannot be granted or evicted."""
        return self.no_space_in_faults / max(self.puts_in_faults, 1)


def value_for(key: bytes, sizes: tuple[int, int]) -> bytes:
    """The one value a key may ever hold: its size and bytes come from the key."""
    seed = int.from_bytes(key[:8], "little")
    low, high = sizes
    size = low + seed % (high - low + 1)
    return np.random.default_rng(seed).bytes(size)


def _client(url: str, config: SoakConfig, index: int, stop: Any, fault: Any, out: Any) -> None:
    """One client process: mixed operations until ``stop`` is set; totals go to ``out``.
    Puts that overlap a fault window (``fault`` set at their start or end) are counted
    apart."""
    # Misses during faults are expected here and counted below; their warnings are noise.
    logging.getLogger("kvfabric").setLevel(logging.ERROR)
    rng = random.Random(config.seed * 1000 + index)
    keys = [fold_key(i, b"soak") for i in range(config.keys)]
    totals: Counter[str] = Counter()
    with kvfabric.connect(url) as store:
        while not stop.is_set():
            batch = [keys[i] for i in rng.sample(range(len(keys)), rng.randint(4, 24))]
            op = rng.random()
            started = time.monotonic()
            if op < 0.4:
                in_fault = fault.is_set()
                outcomes = store.batched_put(
                    batch, [value_for(k, config.value_sizes) for k in batch]
                )
                in_fault = in_fault or fault.is_set()
                full = store.stats()["evictions"] > 0 or totals["evictions_seen"] > 0
                where = "in_faults" if in_fault else "after_full"
                for outcome in outcomes:
                    totals[f"put_{outcome.value}"] += 1
                    if full:
                        totals[f"puts_{where}"] += 1
                        totals[f"no_space_{where}"] += outcome is PutOutcome.NO_SPACE
                totals["evictions_seen"] = store.stats()["evictions"]
            elif op < 0.6:
                store.batched_contains(batch)
            elif op < 0.95:
                for key, got in zip(batch, store.batched_get(batch), strict=True):
                    if got is not None and bytes(got) != value_for(key, config.value_sizes):
                        totals["wrong_values"] += 1
                    totals["get_hits" if got is not None else "get_misses"] += 1
            else:
                store.delete(batch[:2])
            totals["ops"] += len(batch)
            totals["outlived"] += time.monotonic() - started > CALL_BOUND
    out.put(dict(totals))


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _server_rss(cluster: LocalCluster) -> dict[str, int]:
    rss = {}
    if cluster.controller is not None:
        rss["controller"] = _rss(cluster.controller.popen.pid)
    for i, node in enumerate(cluster.nodes):
        if node is not None:
            rss[f"node{i}"] = _rss(node.popen.pid)
    return rss


def _probe(url: str, config: SoakConfig) -> Callable[[], bool]:
    """A fresh client that stores and reads back one key: the service works."""
    counter = iter(range(10**9))

    def check() -> bool:
        key = fold_key(next(counter), b"probe" + os.urandom(4))
        value = value_for(key, config.value_sizes)
        with kvfabric.connect(url) as store:
            if store.batched_put([key], [value]) != [PutOutcome.STORED]:
                return False
            got = store.batched_get([key])[0]
            return got is not None and bytes(got) == value

    return check


def _wait_recovered(check: Callable[[], bool], limit: float = 60.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            if check():
                return time.monotonic() - started
        except Exception:  # a probe that fails is retried; the report keeps only the time
            pass
        time.sleep(0.1)
    return float("inf")


def _mutations(rng: random.Random) -> list[bytes]:
    """Valid control frames of every kind, to be mutated."""
    keys = [rng.randbytes(32) for _ in range(rng.randint(0, 8))]
    return [
        p.encode(p.MsgType.LOOKUP_PREFIX, 1, p.write_keys(keys)),
        p.encode(p.MsgType.RESOLVE, 1, p.write_keys(keys)),
        p.encode(p.MsgType.UNPUBLISH, 1, p.write_keys(keys)),
        p.encode(
            p.MsgType.ALLOCATE,
            1,
            wb.write_allocation_requests([AllocationRequest(key=k, length=100) for k in keys]),
        ),
        p.encode(p.MsgType.PUBLISH, 1, wb.write_grants([GrantRef(key=k, version=1) for k in keys])),
        p.encode(p.MsgType.HEARTBEAT, 1, mb.write_heartbeat(1, 1, {"x": 1})),
        p.encode(p.MsgType.NODES, 1),
        p.encode(p.MsgType.STATS, 1),
    ]


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    choice = rng.random()
    if choice < 0.3 and data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif choice < 0.5:
        data = data[: rng.randrange(len(data) + 1)]
    elif choice < 0.7:
        data += rng.randbytes(rng.randint(1, 64))
    elif choice < 0.85:
        data = bytearray(rng.randbytes(rng.randint(0, 200)))
    elif len(data) >= 4:
        # A count or length field set to something wild.
        at = rng.randrange(0, len(data) - 3)
        struct.pack_into(
            "<I", data, at, rng.choice([0, 1, 0xFFFF, 0xFFFFFFFF, rng.randrange(1 << 32)])
        )
    return bytes(data)


def _fuzz_control(endpoint: str, count: int, stop: threading.Event, seed: int) -> int:
    rng = random.Random(seed)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 100
    sock.connect(endpoint)
    sent = 0
    try:
        while sent < count and not stop.is_set():
            frames = _mutations(rng)
            try:
                sock.send(_mutate(rng.choice(frames), rng), zmq.NOBLOCK)
                sent += 1
            except zmq.ZMQError:
                time.sleep(0.01)
            while sock.poll(0):
                sock.recv()
            if sent % 200 == 0:
                time.sleep(0.001)  # keep the fuzzers from starving the real clients
    finally:
        sock.close()
    return sent


def _fuzz_data(
    addresses: Callable[[], list[tuple[str, int]]], count: int, stop: threading.Event, seed: int
) -> int:
    rng = random.Random(seed)
    sent = 0
    while sent < count and not stop.is_set():
        targets = addresses()
        if not targets:
            time.sleep(0.1)
            continue
        try:
            with socket.create_connection(rng.choice(targets), timeout=0.5) as conn:
                for _ in range(rng.randint(1, 20)):
                    conn.sendall(rng.randbytes(rng.randint(1, 120)))
                    sent += 1
        except OSError:
            time.sleep(0.01)
    return sent


def _tcp_addresses(cluster: LocalCluster) -> list[tuple[str, int]]:
    out = []
    for info in cluster.node_infos():
        for endpoint in info.endpoints:
            if endpoint.transport == "tcp":
                host, _, port = endpoint.address.decode().rpartition(":")
                out.append((host, int(port)))
    return out


def run_soak(config: SoakConfig, log: Callable[[str], None] = print) -> SoakReport:
    ctx = mp.get_context("spawn")
    with LocalCluster(nodes=2, transports=("tcp", "shm"), capacity=config.capacity) as cluster:
        url = cluster.url(timeout="2s", control_timeout="1s", retry_interval="200ms")
        rss_before = _server_rss(cluster)
        stop = ctx.Event()
        fault = ctx.Event()  # set from a kill until FAULT_SETTLE after service is back
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_client, args=(url, config, i, stop, fault, results), daemon=True)
            for i in range(config.clients)
        ]
        for proc in procs:
            proc.start()
        fuzz_stop = threading.Event()
        fuzzed = {"control": 0, "data": 0}

        def fuzz_control() -> None:
            fuzzed["control"] = _fuzz_control(
                cluster.endpoint, config.fuzz_frames, fuzz_stop, config.seed
            )

        def fuzz_data() -> None:
            fuzzed["data"] = _fuzz_data(
                lambda: _tcp_addresses(cluster), config.fuzz_frames, fuzz_stop, config.seed
            )

        fuzzers = [threading.Thread(target=fuzz_control), threading.Thread(target=fuzz_data)]
        for fuzzer in fuzzers:
            fuzzer.start()
        recoveries: list[tuple[str, float]] = []
        rng = random.Random(config.seed)
        started = time.monotonic()
        rounds = config.fault_rounds if config.faults else 0
        interval = config.seconds / (rounds + 1)
        probe = _probe(cluster.url(timeout="2s", control_timeout="1s"), config)
        for n in range(rounds):
            time.sleep(max(0.0, started + (n + 1) * interval - time.monotonic()))
            victim = rng.choice(["node", "node", "controller", "writer"])
            fault.set()
            if victim == "node":
                index = rng.randrange(len(cluster.nodes))
                cluster.kill_node(index)
                cluster.start_node(index)
            elif victim == "controller":
                cluster.kill_controller()
                cluster.start_controller()
            else:
                index = rng.randrange(len(procs))
                procs[index].kill()
                procs[index].join()
                procs[index] = ctx.Process(
                    target=_client, args=(url, config, 100 + n, stop, fault, results), daemon=True
                )
                procs[index].start()
            recovery = _wait_recovered(probe)
            recoveries.append((victim, recovery))
            log(f"fault {n + 1}/{rounds}: {victim} killed; service back in {recovery:.2f}s")
            time.sleep(FAULT_SETTLE)  # restored records are being re-published meanwhile
            fault.clear()
        time.sleep(max(0.0, started + config.seconds - time.monotonic()))
        stop.set()
        fuzz_stop.set()
        totals: Counter[str] = Counter()
        alive = [proc for proc in procs if proc.is_alive()]
        for _ in alive:
            try:
                totals.update(results.get(timeout=60))
            except Exception:  # a client that never reported is itself a hang
                totals["outlived"] += 1
        for proc in procs:
            proc.join(timeout=10)
        for fuzzer in fuzzers:
            fuzzer.join(timeout=30)
        rss_after = _server_rss(cluster)
    outcomes = {k.removeprefix("put_"): v for k, v in totals.items() if k.startswith("put_")}
    return SoakReport(
        ops=totals["ops"],
        wrong_values=totals["wrong_values"],
        outlived=totals["outlived"],
        puts_after_full=totals["puts_after_full"],
        no_space_after_full=totals["no_space_after_full"],
        puts_in_faults=totals["puts_in_faults"],
        no_space_in_faults=totals["no_space_in_faults"],
        outcomes=outcomes,
        recoveries=recoveries,
        fuzzed_control=fuzzed["control"],
        fuzzed_data=fuzzed["data"],
        rss_before=rss_before,
        rss_after=rss_after,
    )


def print_report(report: SoakReport) -> None:
    mib = 1 << 20
    print(f"per-key operations          {report.ops:>12,}")
    print(f"wrong values                {report.wrong_values:>12}   (must be 0)")
    print(f"calls past {CALL_BOUND:g}s            {report.outlived:>12}   (must be 0)")
    print(f"puts once full              {report.puts_after_full:>12,}   (outside faults)")
    print(f"NO_SPACE share once full    {report.no_space_share:>12.2%}   (outside faults)")
    print(
        f"NO_SPACE share in faults    {report.no_space_share_in_faults:>12.2%}   "
        f"(of {report.puts_in_faults:,} puts from a kill to {FAULT_SETTLE:g}s after service"
        " is back)"
    )
    print(f"put outcomes                {report.outcomes}")
    print(f"fuzzed control frames       {report.fuzzed_control:>12,}")
    print(f"fuzzed data-port requests   {report.fuzzed_data:>12,}")
    by_kind: dict[str, list[float]] = {}
    for kind, seconds in report.recoveries:
        by_kind.setdefault(kind, []).append(seconds)
    for kind, times in sorted(by_kind.items()):
        print(
            f"recovery after {kind:<10}   {len(times):>3} rounds, "
            f"median {statistics.median(times):.2f}s, max {max(times):.2f}s"
        )
    for name in sorted(set(report.rss_before) | set(report.rss_after)):
        print(
            f"RSS {name:<10}  {report.rss_before.get(name, 0) / mib:>7.1f} MiB -> "
            f"{report.rss_after.get(name, 0) / mib:>7.1f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--faults", type=int, default=40, help="kill -9 rounds")
    parser.add_argument("--fuzz", type=int, default=20_000, help="fuzzed frames per fuzzer")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = SoakConfig(
        seconds=args.minutes * 60,
        clients=args.clients,
        fault_rounds=args.faults,
        fuzz_frames=args.fuzz,
        seed=args.seed,
    )
    print_report(run_soak(config))


if __name__ == "__main__":
    main()
