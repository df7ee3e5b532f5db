"""``kvfabric bench``: kvfabric beside the floors and the stores users would pick instead, in one
process tree, on one workload (``count`` chunks per batch, of each size; medians of
``repeat``, of at least 9 for gets and floors, of 300 for lookups):

- floors (:mod:`bench_floors`): memcpy, a raw socket stream, raw and ZeroMQ small round trips;
- kvfabric over ``tcp``, ``shm`` and ``ucx`` (``UCX_TLS=sm``, where UCX is installed), each
  against a controller and data node of its own (:mod:`bench_kvfabric`): put on a fresh node
  and on a warm one, get, re-put, reads beside a busy Python thread, lookups of 16/64/1,024
  keys by the path they took, the controller's CPU per lookup; and lookups through the
  control RPC against a controller serving no lookup image;
- Redis (:mod:`bench_redis`), a ``redis-server`` started here;
- Mooncake Store and InfiniStore (:mod:`bench_peers`), where their venv is given, each in a
  private network namespace.

Then the tables and the targets kvfabric is held to, each marked met or not
(:mod:`bench_report`). Nothing here is asserted: timings belong in a table, not in a test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import IO

from kvfabric._runtime.huge_pages import shmem_huge_policy
from kvfabric._tools import bench_kvfabric as kv
from kvfabric._tools.bench_floors import floor_rows, round_trip_rows
from kvfabric._tools.bench_peers import PEERS, peers_python, run_peer
from kvfabric._tools.bench_redis import check_redis, redis_rows
from kvfabric._tools.bench_report import (
    Target,
    print_report,
    print_rounds_summary,
    size_name,
    targets,
)
from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import Phase

__all__ = ["BenchRow", "needed_capacity", "run_bench"]

# What the node holds beyond the fresh samples: the connection's first put, lookup chains.
_HEADROOM = 64 << 20


def needed_capacity(sizes: Sequence[int], count: int, repeat: int) -> int:
    """Bytes a node needs so every fresh-put sample lands in memory never written."""
    return repeat * count * sum(sizes) + _HEADROOM


def _progress(text: str) -> None:
    print(f"kvfabric bench: {text}", file=sys.stderr, flush=True)


def run_bench(
    sizes: tuple[int, ...] = (256 * 1024, 4 << 20),
    count: int = 64,
    repeat: int = 3,
    redis: bool = True,
    out: IO[str] = sys.stdout,
    *,
    transports: Sequence[str] = tuple(kv.TRANSPORTS),
    capacity: int | None = None,
    busy_seconds: float = 1.0,
    cpu_lookups: int = 1000,
    peers: bool = True,
    python_for_peers: str | None = None,
    rounds: int = 1,
) -> list[BenchRow]:
    """Measure everything, print the report to ``out``, return the rows (of every round).

    ``capacity``: each server's memory (default: what the fresh puts need);
    ``python_for_peers``: the interpreter of the peers' venv (else
    ``$KVFABRIC_PEERS_PYTHON``; without either, the peers' rows say how to install them);
    ``rounds``: measure everything that many times, a report per round, then each target
    over the rounds (its median, and in how many it was met).
    """
    if redis:
        check_redis()
    notes: list[str] = []
    needed = needed_capacity(sizes, count, repeat)
    if capacity is None or capacity < needed:
        if capacity is not None:
            notes.append(f"capacity raised to {size_name(needed)}: the fresh puts need that")
        capacity = needed
    notes.append(f"servers hold {size_name(capacity)} each; busy-thread loops {busy_seconds:g} s")
    plan = kv.KvfabricPlan(
        sizes=sizes,
        count=count,
        repeat=repeat,
        capacity=capacity,
        busy_seconds=busy_seconds,
        cpu_lookups=cpu_lookups,
    )
    every_row: list[BenchRow] = []
    per_round: list[list[Target]] = []
    for number in range(1, rounds + 1):
        round_name = f" round {number} of {rounds}" if rounds > 1 else ""
        load_at_start = os.getloadavg()[0]
        rows, problems, round_notes = _one_round(
            plan, redis, peers, python_for_peers, transports, round_name
        )
        # Other work on the machine moves every row: say how busy it was.
        round_notes.append(
            f"{os.cpu_count()} CPUs; load average {load_at_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end"
        )
        # The nodes' memory is on 2 MiB pages only where the host allows it, which moves the
        # shm rows most (a TLB miss per 4 KiB read otherwise); the memcpy floor's numpy
        # buffers ask for them too.
        round_notes.append(
            "the nodes' regions ask for 2 MiB pages; the host's policy for shared memory: "
            f"{shmem_huge_policy() or 'unknown'} (see docs/architecture.md, huge pages)"
        )
        print_report(
            rows,
            sizes=sizes,
            count=count,
            repeat=repeat,
            problems=problems,
            notes=[*notes, *round_notes],
            out=out,
            heading=round_name,
        )
        every_row += rows
        per_round.append(targets(rows, sizes, count))
    if rounds > 1:
        print_rounds_summary(per_round, out)
    return every_row


def _one_round(
    plan: kv.KvfabricPlan,
    redis: bool,
    peers: bool,
    python_for_peers: str | None,
    transports: Sequence[str],
    round_name: str,
) -> tuple[list[BenchRow], dict[str, str], list[str]]:
    """Every system measured once: the rows, per system why it has none (or not all), and
    notes on how the peers ran."""
    sizes, count, repeat = plan.sizes, plan.count, plan.repeat
    notes: list[str] = []
    problems: dict[str, str] = {}
    rows: list[BenchRow] = []
    _progress(f"floors{round_name}")
    for size in sizes:
        rows += floor_rows(count, size, repeat)
    rows += round_trip_rows()
    for name in transports:
        reason = kv.unavailable(name)
        if reason is not None:
            problems[f"kvfabric {name}"] = f"not measured: {reason}"
            continue
        if name == "ucx":
            notes.append("kvfabric ucx runs with UCX_TLS=sm (same host, shared memory)")
        _progress(f"kvfabric {name}")
        rows += kv.transport_rows(name, plan)
    _progress("kvfabric lookups through the control RPC")
    rpc, why = kv.rpc_rows(plan)
    rows += rpc
    if why:
        problems["kvfabric rpc"] = why
    if redis:
        _progress("redis")
        rows += redis_rows(sizes, count, repeat)
    if peers:
        python = peers_python(python_for_peers)
        for name in PEERS:
            _progress(name)
            result = run_peer(
                name,
                python,
                sizes=sizes,
                count=count,
                repeat=repeat,
                busy_seconds=plan.busy_seconds,
                capacity=plan.capacity,
            )
            rows += result.rows
            if result.problem:
                problems[name] = result.problem
            elif result.rows:
                # Lookup notes name the call, in the lookups table; these say how it ran.
                notes += sorted(
                    {
                        f"{name}: {r.note}"
                        for r in result.rows
                        if r.note and r.phase != Phase.CONTAINS
                    }
                )
    return rows, problems, notes
