"""The ``file`` backend on a full disk: real processes on a small real filesystem.

A few-MiB ext4 image on a loop device stands in for the disk (on tmpfs a scan through the
mapping allocates every page, which hides the case). No process may die of SIGBUS — not
the engine's (a client writing into the node's files over ``shm``), not the node's — and a
start that cannot have its space is one error line that names the sizes and the path, and
leaves behind nothing it made. ``file.prefault=false`` (nothing touched at start) is the
case that used to fault; both settings are run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvfabric
from kvfabric.testing import Cluster, free_port, wait_for

_KVFABRIC = [sys.executable, "-m", "kvfabric"]
_DISK_BYTES = 32 << 20
_CAPACITY = "8MiB"
_VALUES = 320
_VALUE_BYTES = 16 << 10

PREFAULT = pytest.mark.parametrize("prefault", ["false", "true"])


def _mount_error() -> str | None:
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB ext4 filesystem mounted on a loop device; unmounted however the test ends."""
    reason = _mount_error()
    if reason:
        pytest.skip(reason)
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(_DISK_BYTES)
    # -m 0: no blocks reserved for root, so root (the test) fills the disk as anyone would.
    made = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a loop device is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            # Something still holds a file there (a process the test could not stop):
            # detach now, the kernel finishes when it lets go.
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` up with a file of its own; returns the file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, 4096):
            _write_until_full(fd, b"\xa5" * chunk)
    finally:
        os.close(fd)
    statvfs = os.statvfs(disk)
    assert statvfs.f_bavail * statvfs.f_frsize < _VALUE_BYTES, "the disk did not fill"
    return filler


def _write_until_full(fd: int, block: bytes) -> None:
    while True:
        try:
            os.write(fd, block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return


def _node_args(path: Path, prefault: str, capacity: str = _CAPACITY) -> list[str]:
    return [
        "node",
        "--controller",
        f"127.0.0.1:{free_port()}",
        "--backend",
        "file",
        "--path",
        str(path),
        "--capacity",
        capacity,
        "--backend-opt",
        f"file.prefault={prefault}",
    ]


def _failed_start(args: list[str]) -> str:
    """Run ``kvfabric ARGS``, which must exit 2 with one error line; returns the line."""
    result = subprocess.run(
        [*_KVFABRIC, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvfabric: error: file backend at ")
    return lines[0]


class _DiskCluster(Cluster):
    """A cluster whose one node keeps its files on the small disk."""

    def __init__(self, directory: Path, prefault: str) -> None:
        self.directory = directory
        super().__init__(
            nodes=1,
            transports=("shm",),
            capacity=_CAPACITY,
            backend="file",
            node_args=["--backend-opt", f"file.prefault={prefault}"],
        )

    def node_path(self, index: int) -> Path:
        return self.directory


# A client in a process of its own (an engine): puts over shm, reads back, prints both.
_CLIENT = """
import sys, kvfabric
from kvfabric.keys import chain_keys
url, count, size, put = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "put"
keys = chain_keys(list(range(count)), 1, namespace=b"full-disk")
values = [bytes([i % 251]) * size for i in range(count)]
with kvfabric.connect(url) as store:
    if put:
        print(",".join(o.name for o in store.batched_put(keys, values)))
    got = store.batched_get(keys)
    print(sum(g is not None and bytes(g) == v for g, v in zip(got, values)))
    print(sum(g is not None and bytes(g) != v for g, v in zip(got, values)))
"""


def _client(url: str, *, put: bool) -> tuple[list[str], int, int]:
    """Run the client; it must exit 0 (not by SIGBUS). Outcomes, exact reads, wrong reads."""
    result = subprocess.run(
        [sys.executable, "-c", _CLIENT, url, str(_VALUES), str(_VALUE_BYTES), str(put and "put")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != -signal.SIGBUS, "the client died of SIGBUS"
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    outcomes = lines[0].split(",") if put else []
    return outcomes, int(lines[-2]), int(lines[-1])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@PREFAULT
def test_a_capacity_over_the_free_space_is_refused_and_leaves_nothing_behind(
    small_disk: Path, prefault: str
) -> None:
    new = small_disk / "node"
    line = _failed_start(_node_args(new, prefault, capacity="200MiB"))
    assert "a capacity of 200.0 MiB needs 200.0 MiB more disk space" in line
    assert f"{new} has " in line
    assert " free;" in line
    assert not new.exists()  # the directory the node made is gone again
    existing = small_disk / "kept"
    existing.mkdir()
    _failed_start(_node_args(existing, prefault, capacity="200MiB"))
    assert list(existing.iterdir()) == []  # the directory stays, and holds nothing new
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize > _DISK_BYTES // 2


@PREFAULT
def test_a_node_that_fits_keeps_clients_and_itself_alive_when_the_disk_fills(
    small_disk: Path, prefault: str
) -> None:
    directory = small_disk / "node"
    with _DiskCluster(directory, prefault) as cluster:
        _fill(small_disk)
        outcomes, exact, wrong = _client(cluster.url(transport="shm"), put=True)
        assert outcomes == ["STORED"] * _VALUES
        assert (exact, wrong) == (_VALUES, 0)
        # The node killed and started again on the full disk: its files are whole, so it
        # starts, finds every record and serves it.
        cluster.kill_node(0)
        cluster.start_node(0)
        cluster.wait_nodes(1)
        url = cluster.url(transport="shm")
        everything = (_VALUES, 0)
        wait_for("the restarted node's records", lambda: _client(url, put=False)[1:] == everything)


def test_with_prefault_off_the_files_are_still_allocated_in_full(tmp_path: Path) -> None:
    url = f"embedded://?backend=file&path={tmp_path}&capacity=8MiB&region_size=4MiB"
    with kvfabric.connect(url + "&file.prefault=false"):
        regions = sorted(tmp_path.glob("region-*.kvf"))
        assert len(regions) == 2
        for region in regions:
            assert region.stat().st_blocks * 512 >= 4 << 20


def _punch_hole(path: Path, offset: int, length: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fd = os.open(path, os.O_RDWR)
    try:
        punch_hole_keep_size = 0x02 | 0x01
        if libc.fallocate(fd, punch_hole_keep_size, offset, length) != 0:
            raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")
    finally:
        os.close(fd)


@PREFAULT
@pytest.mark.parametrize("damage", ["cut short", "sparse"])
def test_a_restart_onto_files_it_cannot_back_is_refused_and_keeps_them(
    small_disk: Path, prefault: str, damage: str
) -> None:
    directory = small_disk / "node"
    region = directory / "region-0.kvf"
    with _DiskCluster(directory, prefault) as cluster:
        outcomes, _, _ = _client(cluster.url(transport="shm"), put=True)
        assert outcomes == ["STORED"] * _VALUES
        cluster.kill_node(0)
        # Someone else cut the file short or punched a hole in it, then filled the disk.
        size = region.stat().st_size
        if damage == "cut short":
            os.truncate(region, size // 2)
        else:
            _punch_hole(region, size // 2, size // 2)
        before = (region.stat().st_size, _digest(region))
        filler = _fill(small_disk)
        line = _failed_start(_node_args(directory, prefault))
        assert "8.0 MiB" in line
        assert " free;" in line
        assert "region-0.kvf (records of an earlier run) kept" in line
        assert (region.stat().st_size, _digest(region)) == before
        # With room again, the node starts and serves what its files still hold.
        filler.unlink()
        cluster.start_node(0)
        cluster.wait_nodes(1)
        url = cluster.url(transport="shm")
        reads: list[tuple[int, int]] = []

        def kept_records_read() -> bool:
            reads.append(_client(url, put=False)[1:])
            return reads[-1][0] > 0

        # Checked on the read that found them: on a loaded host the restarted node may miss
        # a heartbeat, be dropped and report its records again, and a read between misses.
        wait_for("the kept records", kept_records_read)
        assert [wrong for _, wrong in reads] == [0] * len(reads)  # never a wrong value
        assert reads[-1][0] < _VALUES  # those in the lost half are misses
