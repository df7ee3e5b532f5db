"""The commands run on a plain install: without pytest (the ``test`` extra) and without
``kvfabric.testing``. Every Python process these tests start, and every process those
start, gets a ``sitecustomize`` that makes both unimportable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every test starts kvfabric processes: left out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

_BLOCKER = '''
import sys


class _NoTestDependencies:
    """Makes pytest and kvfabric.testing unimportable, as on a plain install."""

    BLOCKED = ("pytest", "_pytest", "kvfabric.testing")

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in self.BLOCKED):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _NoTestDependencies())
'''


@pytest.fixture
def plain_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _run(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ModuleNotFoundError" not in result.stderr
    return result.stdout


def test_the_blocker_makes_pytest_and_the_conformance_suite_unimportable(
    plain_env: dict[str, str],
) -> None:
    for module in ("pytest", "kvfabric.testing"):
        result = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=plain_env,
        )
        assert result.returncode == 1
        assert f"No module named '{module}' (blocked)" in result.stderr


@pytest.mark.parametrize("command", ["bench", "demo", "serve", "node", "controller", "stats"])
def test_every_command_helps_without_test_dependencies(
    plain_env: dict[str, str], command: str
) -> None:
    assert "usage: kvfabric" in _run(["-m", "kvfabric", command, "--help"], plain_env)


def test_a_tiny_bench_and_the_benchmark_scripts_run_without_test_dependencies(
    plain_env: dict[str, str],
) -> None:
    # Tiny: what is tested is that every phase runs, not what it measures.
    tiny = ["--sizes", "64KiB", "--count", "2", "--repeat", "1", "--no-redis"]
    tiny += ["--busy-seconds", "0.05"]
    out = _run(["-m", "kvfabric", "bench", *tiny], plain_env)
    assert "kvfabric tcp" in out
    assert "memcpy" in out
    # The same bench by its script (every transport was measured just above).
    out = _run(["benchmarks/prefix_bench.py", *tiny, "--transports", "shm"], plain_env)
    assert "kvfabric shm" in out
    assert "usage:" in _run(["benchmarks/tcp_floor.py", "--help"], plain_env)
    assert "usage:" in _run(["benchmarks/embedded_bench.py", "--help"], plain_env)


def test_the_demo_runs_without_test_dependencies(plain_env: dict[str, str]) -> None:
    out = _run(["-m", "kvfabric", "demo", "--sessions", "2", "--turns", "1"], plain_env)
    assert "wrong values" in out
