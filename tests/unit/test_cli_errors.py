"""The server commands as a new user meets them: real processes on 127.0.0.1.

Start-up problems are one ``kvfabric: error: ...`` line that says what to do, never a
traceback; addresses are accepted as users type them; the ready lines name the capacity and
every endpoint; a node without its controller says what it is waiting for.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvfabric.testing import free_port

# Every test starts kvfabric processes: left out of the fast loop (-m "not slow").
pytestmark = pytest.mark.slow

_KVFABRIC = [sys.executable, "-m", "kvfabric"]


def _error_line(*args: str) -> str:
    """Run ``kvfabric ARGS``; it must exit 2 with exactly one error line on stderr."""
    result = subprocess.run(
        [*_KVFABRIC, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvfabric: error: ")
    return lines[0]


@contextmanager
def _port_in_use() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@contextmanager
def _running(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvfabric ARGS`` started; yields the process and its first stdout line."""
    proc = subprocess.Popen(
        [*_KVFABRIC, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_controller_port_in_use_is_one_line_that_says_what_to_do() -> None:
    with _port_in_use() as port:
        for command in (("controller",), ("serve", "--capacity", "8MiB")):
            line = _error_line(*command, "--listen", f"tcp://127.0.0.1:{port}")
            assert f"cannot listen on tcp://127.0.0.1:{port}: the port is in use" in line
            assert "--listen" in line


def test_a_data_port_in_use_is_one_line() -> None:
    with _port_in_use() as port:
        line = _error_line("node", "--port", str(port), "--capacity", "8MiB")
    assert f"the data node's tcp transport cannot listen on 127.0.0.1:{port}" in line
    assert "--port" in line


def test_a_metrics_port_in_use_is_one_line() -> None:
    with _port_in_use() as port:
        line = _error_line(
            "controller", "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(port)
        )
    assert f"the metrics endpoint cannot listen on 127.0.0.1:{port}" in line
    assert "--metrics-port" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("controller", "--listen", "localhost"), "use HOST:PORT or tcp://HOST:PORT"),
        (("controller", "--listen", "127.0.0.1:70000"), "port must be 1-65535"),
        (("node", "--controller", "http://127.0.0.1:7100"), "use HOST:PORT or tcp://HOST:PORT"),
        (("stats", "--controller", "127.0.0.1"), "use HOST:PORT or tcp://HOST:PORT"),
        (("serve", "--capacity", "16G"), "write 16GiB (17179869184 bytes, binary) or 16GB"),
        (("serve", "--capacity", "16"), "smaller than one slot"),
        (("serve", "--capacity", "100TiB"), "more than this machine's memory"),
        (("serve", "--lease", "soon"), "--lease: not a duration: 'soon'"),
        (("serve", "--capacity", "64MiB", "--region-size", "0"), "--region-size 0 bytes"),
        (("demo", "--url", "embedded://?capacity=100TiB"), "more than this machine's memory"),
    ],
)
def test_bad_addresses_and_sizes_are_one_line_naming_the_option(
    args: tuple[str, ...], expected: str
) -> None:
    assert expected in _error_line(*args)


def test_stats_without_a_controller_says_where_it_looked_and_what_to_give() -> None:
    port = free_port()
    line = _error_line("stats", "--controller", f"127.0.0.1:{port}", "--timeout", "300ms")
    assert f"tcp://127.0.0.1:{port}" in line
    assert "--controller HOST:PORT" in line


def test_host_port_without_tcp_scheme_is_accepted_and_ready_lines_name_every_endpoint() -> None:
    port = free_port()
    with _running("controller", "--listen", f"127.0.0.1:{port}") as (_, controller_line):
        assert f"listening on tcp://127.0.0.1:{port}" in controller_line
        assert f"kvfabric://127.0.0.1:{port}" in controller_line
        with _running(
            "node", "--controller", f"kvfabric://127.0.0.1:{port}", "--capacity", "64MiB"
        ) as (_, node_line):
            expected = "serving 64.0 MiB (67108864 bytes, dram, 1 region, memory prepared in "
            assert expected in node_line
            assert "tcp@127.0.0.1:" in node_line
            assert "shm" in node_line
            assert f"controller at tcp://127.0.0.1:{port}" in node_line


def test_serve_names_capacity_data_and_metrics_endpoints() -> None:
    port = free_port()
    with _running(
        "serve", "--listen", f"127.0.0.1:{port}", "--capacity", "32MiB", "--metrics-port", "0"
    ) as (_, line):
        assert f"kvfabric serving on tcp://127.0.0.1:{port}" in line
        assert "32.0 MiB (33554432 bytes, dram, 1 region, memory prepared in " in line
        assert "tcp@127.0.0.1:" in line
        assert "metrics at http://127.0.0.1:" in line
        assert f"connect with kvfabric://127.0.0.1:{port}" in line


def test_a_node_without_its_controller_says_it_is_waiting_and_for_what() -> None:
    port = free_port()  # nothing listens there
    with _running(
        "node", "--controller", f"127.0.0.1:{port}", "--capacity", "8MiB", "--heartbeat", "0.2s"
    ) as (proc, line):
        assert "serving" in line
        assert proc.stderr is not None
        found: list[str] = []

        def read() -> None:
            assert proc.stderr is not None
            for log_line in proc.stderr:
                if "waiting for the controller" in log_line:
                    found.append(log_line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # A bound so that a broken build fails instead of hanging; not a timing assertion.
        reader.join(timeout=60)
        assert found, "the node never said it was waiting"
        assert f"tcp://127.0.0.1:{port}" in found[0]
        assert "kvfabric controller" in found[0]
    assert proc.returncode == 0  # SIGTERM still stops it cleanly


def test_help_shows_defaults_and_units() -> None:
    def help_of(command: str) -> str:
        result = subprocess.run(
            [*_KVFABRIC, command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return " ".join(result.stdout.split())

    serve = help_of("serve")
    for fragment in (
        "--capacity SIZE memory this node serves (default: 4GiB)",
        "(default: 30s)",  # lease
        "(default: 2s)",  # grace, timeout
        "(default: 1s)",  # heartbeat
        "(default: tcp://127.0.0.1:7100)",
        "KiB, MiB, GiB, TiB (binary",
        "--metrics-port PORT",
    ):
        assert fragment in serve
    assert "(default: tcp://127.0.0.1:7100)" in help_of("node")
    demo = help_of("demo")
    assert "about a second" in demo
    assert "--sessions SESSIONS chat sessions (default: 8)" in demo
    assert "stored once already" in demo


def test_plugins_gives_every_unavailable_plugin_a_reason_and_an_install_command() -> None:
    result = subprocess.run([*_KVFABRIC, "plugins"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table, _, rest = result.stdout.partition("\n\n")
    unavailable = [
        (row.split()[0], row.split()[1]) for row in table.splitlines() if " unavailable " in row
    ]
    lines = rest.splitlines()
    for kind, name in unavailable:
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {kind} {name}: "))
        entry = [lines[at]] + [line for line in lines[at + 1 : at + 2] if line.startswith("    ")]
        assert "pip install" in " ".join(entry), (kind, name, rest)
    assert "tcp.pool (default 8)" in rest
    assert "--transport-opt" in rest
