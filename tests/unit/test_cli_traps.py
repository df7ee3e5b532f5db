"""The traps an operator meets first, each with an error or a fix that names what to do:
real ``kvfabric`` processes on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvfabric
from kvfabric._tools.advertise import advertised_host, route_target
from kvfabric.testing import free_port

_KVFABRIC = [sys.executable, "-m", "kvfabric"]


def test_version() -> None:
    result = subprocess.run([*_KVFABRIC, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvfabric {kvfabric.__version__}"


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`kvfabric ... | head`: the reader is gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*_KVFABRIC, "plugins"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr
    assert "BrokenPipe" not in result.stderr
    assert result.returncode == 141


@pytest.mark.slow
def test_path_without_the_file_backend_names_the_fix(tmp_path: object) -> None:
    result = subprocess.run(
        [*_KVFABRIC, "node", "--path", "/tmp/kvfabric-data", "--capacity", "8MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "add --backend file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_node_bound_to_every_interface_advertises_a_usable_address() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            *_KVFABRIC,
            "node",
            "--host",
            "0.0.0.0",
            "--controller",
            f"127.0.0.1:{port}",
            "--capacity",
            "8MiB",
            "--transport",
            "tcp",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "tcp@127.0.0.1:" in line, line + err
    assert "0.0.0.0" not in line
    assert "advertising 127.0.0.1 to clients" in err


def test_what_is_advertised() -> None:
    assert advertised_host("10.0.0.2", None, "10.0.0.1") is None  # the bound address
    assert advertised_host("0.0.0.0", "node7.example", None) == "node7.example"
    assert advertised_host("0.0.0.0", None, "127.0.0.1") == "127.0.0.1"
    assert route_target("tcp://10.0.0.1:7100") == "10.0.0.1"
    assert route_target("redis://10.0.0.5:6379/0") == "10.0.0.5"
    assert route_target("0.0.0.0:7100") is None
