"""The CPUs a process can keep busy: its affinity, capped by its cgroups' CPU quota.

The control-group trees here are files in a temporary directory laid out as the kernel
lays out ``/sys/fs/cgroup`` and ``/proc/self/cgroup`` (this machine has no CPU quota to
read); the affinity is this process's own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfabric._runtime.cpus import usable_cpus
from kvfabric.transports.tcp.tuning import parse_read_lanes

AFFINITY = len(os.sched_getaffinity(0))


def _tree(root: Path, files: dict[str, str], self_cgroup: str) -> dict[str, str]:
    for name, text in files.items():
        path = root / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "cgroup").write_text(self_cgroup)
    return {"cgroup_root": str(root / "sys"), "self_cgroup": str(root / "cgroup")}


def test_cgroup_v2_quota_of_the_group_caps_the_affinity(tmp_path: Path) -> None:
    where = _tree(
        tmp_path,
        {"cpu.max": "max 100000\n", "pod/app/cpu.max": "100000 100000\n"},
        "0::/pod/app\n",
    )
    assert usable_cpus(**where) == 1


def test_the_tightest_quota_above_the_group_wins_and_a_fraction_rounds_up(
    tmp_path: Path,
) -> None:
    where = _tree(
        tmp_path,
        {"pod/cpu.max": "150000 100000\n", "pod/app/cpu.max": "max 100000\n"},
        "0::/pod/app\n",
    )
    assert usable_cpus(**where) == min(AFFINITY, 2)


def test_cgroup_v1_quota_counts_and_minus_one_is_no_quota(tmp_path: Path) -> None:
    limited = _tree(
        tmp_path / "limited",
        {
            "cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "100000\n",
            "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n",
        },
        "12:memory:/docker/c1\n4:cpu,cpuacct:/docker/c1\n",
    )
    assert usable_cpus(**limited) == 1
    unlimited = _tree(
        tmp_path / "unlimited",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
        "1:cpu:/\n0::/\n",
    )
    assert usable_cpus(**unlimited) == AFFINITY


@pytest.mark.parametrize(
    "files",
    [{}, {"cpu.max": "garbage\n"}, {"cpu.max": "100000 0\n"}],
    ids=["no files", "unreadable", "zero period"],
)
def test_no_quota_to_read_leaves_the_affinity(tmp_path: Path, files: dict[str, str]) -> None:
    assert usable_cpus(**_tree(tmp_path, files, "0::/\n")) == AFFINITY


def test_no_cgroup_file_leaves_the_affinity(tmp_path: Path) -> None:
    assert usable_cpus(cgroup_root=str(tmp_path), self_cgroup=str(tmp_path / "none")) == AFFINITY


def test_this_process_can_keep_at_least_one_cpu_and_at_most_its_affinity_busy() -> None:
    assert 1 <= usable_cpus() <= AFFINITY


def test_read_lanes_auto_follows_the_usable_cpus() -> None:
    assert parse_read_lanes("auto") == (2 if usable_cpus() >= 4 else 1)
