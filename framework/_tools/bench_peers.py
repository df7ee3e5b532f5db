"""The peers in ``kvfabric bench``: Mooncake Store and InfiniStore on kvfabric's workload.

They are not kvfabric's dependencies: they live in a virtual environment of their own, whose
interpreter ``--peers-python`` (or ``KVFABRIC_PEERS_PYTHON``) names, and run only where that is
given. Both bind 0.0.0.0 whatever they are told, so each runs inside a private network
namespace holding only ``lo`` (``unshare --net --map-root-user``), its servers and its client
together, never on the host's interfaces. The scripts that drive them are
``benchmarks/peers/*_peer.py`` in a clone of the repository; they print their rows as JSON
lines, which become :class:`BenchRow` s here. A peer that cannot run gives its reason
instead, which the report prints in its place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs

import kvfabric
from kvfabric._tools.bench_row import BenchRow
from kvfabric._tools.bench_timing import ROW_MARKER, UNAVAILABLE_MARKER

__all__ = ["PEERS", "PeerResult", "peers_python", "run_peer"]

# Per peer: its script and how to install it into the peers' venv.
PEERS: dict[str, tuple[str, str]] = {
    "mooncake": (
        "mooncake_peer.py",
        "pip install 'mooncake-transfer-engine-non-cuda==0.3.13' nvidia-cuda-runtime-cu12",
    ),
    "infinistore": (
        "infinistore_peer.py",
        "pip install --no-deps 'infinistore==0.2.35' && pip install numpy "
        "(and apt-get install libibverbs1 libibverbs-dev gcc)",
    ),
}
_TIMEOUT = 900.0


@attrs.frozen(kw_only=True)
class PeerResult:
    name: str
    rows: list[BenchRow]
    # Why the peer has no (or not all) rows; empty when it ran through.
    problem: str = ""


def peers_python(explicit: str | None) -> str | None:
    """The peers' interpreter: ``--peers-python``, else ``$KVFABRIC_PEERS_PYTHON``."""
    return explicit or os.environ.get("KVFABRIC_PEERS_PYTHON") or None


def _scripts() -> Path | None:
    """``benchmarks/peers`` of the clone kvfabric runs from (an editable install)."""
    here = Path(kvfabric.__file__).resolve().parent.parent / "benchmarks" / "peers"
    return here if here.is_dir() else None


def _not_installed(name: str) -> str:
    return (
        f"not installed: {PEERS[name][1]} in a separate venv, then "
        "--peers-python VENV/bin/python (see README, Benchmark)"
    )


def _namespace_command() -> list[str] | str:
    """The command prefix that runs what follows in a private network namespace with only
    ``lo`` up, or why there is none."""
    unshare = shutil.which("unshare")
    ip = shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(p)), None
    )
    if unshare is None or ip is None:
        return "needs unshare and ip (util-linux, iproute2) for a private network namespace"
    probe = subprocess.run(
        [unshare, "--net", "--map-root-user", "--", ip, "link", "set", "lo", "up"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return (
            "cannot make a private network namespace (unshare --net --map-root-user: "
            f"{probe.stderr.strip()[:200]}); it binds 0.0.0.0, so it runs only inside one"
        )
    return [
        unshare,
        "--net",
        "--map-root-user",
        "--",
        "sh",
        "-c",
        f'{ip} link set lo up && exec "$@"',
        "sh",
    ]


def run_peer(
    name: str,
    python: str | None,
    *,
    sizes: tuple[int, ...],
    count: int,
    repeat: int,
    busy_seconds: float,
    capacity: int,
) -> PeerResult:
    """Run one peer's script in its own namespace; its rows, or why there are none."""
    if python is None:
        return PeerResult(name=name, rows=[], problem=_not_installed(name))
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return PeerResult(name=name, rows=[], problem=f"--peers-python {python}: not a program")
    scripts = _scripts()
    if scripts is None:
        return PeerResult(
            name=name,
            rows=[],
            problem="its script is in benchmarks/peers/ of a clone: run kvfabric bench "
            "from an editable install of one (pip install -e .)",
        )
    prefix = _namespace_command()
    if isinstance(prefix, str):
        return PeerResult(name=name, rows=[], problem=prefix)
    args = [
        *("--sizes", ",".join(str(s) for s in sizes), "--count", str(count)),
        *("--repeat", str(repeat), "--busy-seconds", str(busy_seconds)),
        *("--capacity", str(capacity)),
    ]
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.run(
                [*prefix, python, str(scripts / PEERS[name][0]), *args],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                timeout=_TIMEOUT,
            )
            stdout, returncode = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout
            stdout = out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
            returncode = -1
        log.seek(0)
        tail = log.read().decode(errors="replace").strip().splitlines()[-3:]
    rows: list[BenchRow] = []
    problem = ""
    for line in stdout.splitlines():
        if line.startswith(ROW_MARKER):
            rows.append(BenchRow.from_json(json.loads(line[len(ROW_MARKER) :])))
        elif line.startswith(UNAVAILABLE_MARKER):
            problem = line[len(UNAVAILABLE_MARKER) :].strip()
    if not problem and returncode != 0:
        how = "timed out" if returncode == -1 else f"exited with {returncode}"
        problem = f"its run {how}: {' | '.join(tail)[-400:]}"
    return PeerResult(name=name, rows=rows, problem=problem)
