"""``kvfabric bench serving`` finds the clone's serving benchmark, or says how to get one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvfabric._tools import bench_serving
from kvfabric._tools.cli import main
from kvfabric.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_the_script_is_found_from_inside_the_clone() -> None:
    assert bench_serving.find_serving_bench(REPO / "docs") == REPO / bench_serving.SCRIPT


def test_outside_a_clone_the_editable_install_s_source_tree_is_used(tmp_path: Path) -> None:
    source = Path(bench_serving.__file__).resolve().parents[2]
    if source != REPO:
        pytest.skip("kvfabric is installed from a wheel here, not editable from this clone")
    assert bench_serving.find_serving_bench(tmp_path) == REPO / bench_serving.SCRIPT


def test_without_a_clone_the_error_says_where_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An installed wheel: this module's source tree has no benchmarks/ beside it.
    monkeypatch.setattr(bench_serving, "__file__", str(tmp_path / "a" / "b" / "c.py"))
    with pytest.raises(ConfigError, match="runs from a kvfabric clone"):
        bench_serving.find_serving_bench(tmp_path)


@pytest.mark.skipif(
    all(importlib.util.find_spec(m) for m in ("aiohttp", "matplotlib", "vllm")),
    reason="this environment has what the serving benchmark needs",
)
def test_a_python_without_vllm_is_told_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serving", "--quick"]) == 2
    assert "pip install -e '.[vllm,bench]'" in capsys.readouterr().err
