"""The README's two commands are the set-up contract; the CLI does what it says."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    demo, tests = _readme_commands()[:2]
    assert demo.endswith("kvfabric demo")
    assert "tox run" in tests


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_demo_runs_and_reports_no_rpc_per_lookup_and_no_wrong_values() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric", "demo", "--sessions", "3", "--turns", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # Summary lines: "  LABEL   VALUE   what it means".
    summary = [line for line in result.stdout.splitlines() if line.startswith("  ")]
    report = {parts[0]: parts[1:] for parts in (re.split(r"\s{2,}", s.strip()) for s in summary)}
    # The lookup reads the index's lookup image; the load needs no RPC either.
    assert report["control RPCs per lookup+get"][0] == "0.00"
    assert report["wrong values"][0] == "0"
    assert report["validation failures"][0] == "0"
    assert "stored once already" in report["bytes stored"][1]
    assert "ratio" in report["lookup+get throughput"][1]
    # Progress goes to stderr and says what it counts.
    assert "6/6 requests done" in result.stderr


def test_cli_reports_errors_without_a_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric", "demo", "--url", "embedded://?capcity=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "kvfabric: error: unknown option 'capcity'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to copy the checkout")
@pytest.mark.slow
def test_readme_demo_command_works_on_a_fresh_checkout(tmp_path: Path) -> None:
    """Command 1 on a copy of the tracked tree, with its own new virtualenv."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    checkout = tmp_path / "kvfabric"
    for name in files:
        source = ROOT / name
        if source.is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    result = subprocess.run(
        ["bash", "-c", _readme_commands()[0]],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrong values" in result.stdout
    assert "RPCs per lookup+get" in result.stdout


def test_every_kvfabric_option_the_readme_names_exists() -> None:
    from kvfabric._tools.cli import build_parser

    commands = ("demo", "plugins", "controller", "node", "serve", "bench", "stats")
    top = io.StringIO()
    with contextlib.redirect_stdout(top), pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    helps = [top.getvalue()]
    for command in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        helps.append(out.getvalue())
    known = set(re.findall(r"--[a-z][a-z-]+", "\n".join(helps)))
    # Options of other programs the README quotes (vLLM, tox, mypy, pip, unshare).
    others = {
        "--kv-transfer-config",
        "--prefix-caching-hash-algo",
        "--skip-env",
        "--strict",
        "--no-deps",
        "--net",
        "--map-root-user",
    }
    named = set(re.findall(r"--[a-z][a-z-]+", (ROOT / "README.md").read_text()))
    assert named - others - known == set()


def test_nothing_a_user_reads_names_an_issue_number() -> None:
    # Measurements and history live in docs/performance.md and the CHANGELOG, never as
    # "issue 12" in what a user reads: the README, the docs and every command's --help.
    from kvfabric._tools.cli import build_parser

    texts = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md"]}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").rglob("*.md")}
    for command in ("demo", "plugins", "controller", "node", "serve", "bench", "stats"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        texts[f"kvfabric {command} --help"] = out.getvalue()
    naming = {
        where: found
        for where, text in texts.items()
        if (found := re.findall(r"\bissues? #?\d+", text, flags=re.IGNORECASE))
    }
    assert naming == {}
