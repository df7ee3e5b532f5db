"""A secret problem is told apart from a dead controller, on both sides.

Real controller processes on 127.0.0.1, one with a secret and one without, and
``kvfabric stats`` as the client: a wrong secret, a missing one, one where none is
expected and no controller at all each give their own message; the controller logs the
peer and the reason, and counts each refusal by reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric._tools.local_cluster import ServerProcess, free_port
from kvfabric.testing import wait_for

_KVFABRIC = [sys.executable, "-m", "kvfabric"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("secrets")
    (where / "right").write_text("the controller's secret\n")
    (where / "wrong").write_text("another secret\n")
    return where


@pytest.fixture(scope="module")
def secured(secrets_dir: Path) -> Iterator[ServerProcess]:
    port = free_port()
    server = ServerProcess(
        [
            "controller",
            "--listen",
            f"127.0.0.1:{port}",
            "--transport",
            "none",
            "--secret-file",
            str(secrets_dir / "right"),
        ],
        secrets_dir / "secured.log",
        _env(),
        "listening on",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_controller(secrets_dir: Path) -> Iterator[ServerProcess]:
    port = free_port()
    server = ServerProcess(
        ["controller", "--listen", f"127.0.0.1:{port}", "--transport", "none"],
        secrets_dir / "open.log",
        _env(),
        "listening on",
    )
    yield server
    server.stop()


def _address(server: ServerProcess) -> str:
    return server.args[server.args.index("--listen") + 1]


def _stats(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_KVFABRIC, "stats", "--controller", address, "--format", "json", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )


def _controller_counters(server: ServerProcess, secret: Path | None) -> dict[str, int]:
    extra = ["--secret-file", str(secret)] if secret else []
    result = _stats(_address(server), *extra)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout)["controller"])


def _counted_on_a_later_try(
    server: ServerProcess, secret: Path | None, reason: str, client_args: list[str]
) -> None:
    """A mismatch of mechanisms (one side has a secret, the other none) is seen by whichever
    side reads the other's greeting first; when the client hangs up first, the controller
    sees only a handshake dropped, which is no refusal. So the client tries until the
    controller has seen one: what is asserted is that what it sees it counts, by reason."""

    def tried() -> dict[str, int]:
        _stats(_address(server), *client_args)
        return _controller_counters(server, secret)

    wait_for(
        f"a refusal counted as {reason}",
        tried,
        until=lambda c: c.get(f"auth_refused_{reason}", 0) >= 1,
    )
    text = server.log_path.read_text()
    assert "refused a connection from" in text


def test_a_wrong_secret_is_named_as_such_and_counted(
    secured: ServerProcess, secrets_dir: Path
) -> None:
    result = _stats(_address(secured), "--secret-file", str(secrets_dir / "wrong"))
    assert result.returncode == 2
    assert "refused this client's secret (they differ)" in result.stderr
    assert "Traceback" not in result.stderr
    counters = wait_for(
        "the refusal counted",
        lambda: _controller_counters(secured, secrets_dir / "right"),
        until=lambda c: c.get("auth_refused_wrong_secret", 0) >= 1,
    )
    assert counters["auth_refused"] >= 1
    wait_for(
        "the refusal logged with the peer",
        lambda: (
            "refused a connection from" in secured.log_path.read_text()
            and "secret differs" in secured.log_path.read_text()
        ),
    )


def test_a_missing_secret_is_named_as_such_and_counted(
    secured: ServerProcess, secrets_dir: Path
) -> None:
    result = _stats(_address(secured))
    assert result.returncode == 2
    assert "requires a secret and this client has none" in result.stderr
    _counted_on_a_later_try(secured, secrets_dir / "right", "no_secret", [])


def test_a_secret_where_none_is_expected_is_named_as_such_and_counted(
    open_controller: ServerProcess, secrets_dir: Path
) -> None:
    with_secret = ["--secret-file", str(secrets_dir / "right")]
    result = _stats(_address(open_controller), *with_secret)
    assert result.returncode == 2
    assert "has no secret but this client has one" in result.stderr
    _counted_on_a_later_try(open_controller, None, "unexpected_secret", with_secret)


def test_no_controller_is_not_taken_for_a_secret_problem(secrets_dir: Path) -> None:
    result = _stats(f"127.0.0.1:{free_port()}", "--secret-file", str(secrets_dir / "right"))
    assert result.returncode == 2
    assert "no answer from the controller" in result.stderr
    assert "secret (they differ)" not in result.stderr
    assert "`kvfabric controller` or `kvfabric serve` runs one" in result.stderr


def test_the_right_secret_counts_no_refusal(secured: ServerProcess, secrets_dir: Path) -> None:
    counters = _controller_counters(secured, secrets_dir / "right")
    assert counters["rpcs"] >= 0
    assert "auth_refused" in counters


def test_a_node_with_a_wrong_secret_says_so_while_it_waits(
    secured: ServerProcess, secrets_dir: Path
) -> None:
    node = ServerProcess(
        [
            "node",
            "--controller",
            _address(secured),
            "--capacity",
            "8MiB",
            "--transport",
            "tcp",
            "--heartbeat",
            "0.2s",
            "--secret-file",
            str(secrets_dir / "wrong"),
        ],
        secrets_dir / "node.log",
        _env(),
        "serving",
    )
    try:
        wait_for(
            "the waiting notice naming the secret",
            lambda: "refused this client's secret" in node.log_path.read_text(),
        )
        assert "waiting for the controller" in node.log_path.read_text()
    finally:
        node.stop()
