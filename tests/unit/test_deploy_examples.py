"""The deployment examples in docs/deploy/ are what the commands take: the config file and
the environment files load through the real option parser, the systemd units pass
``systemd-analyze verify`` (where installed), and the engines' store URLs parse."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric._tools.cli import _parse
from kvfabric.adapters.vllm_options import bytes_option
from kvfabric.urls import parse_url

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy"
CONFIG = DEPLOY / "kvfabric.toml"


@pytest.fixture(autouse=True)
def _no_kvfabric_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVFABRIC_"):
            monkeypatch.delenv(name)


def _env_file(name: str) -> dict[str, str]:
    values = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value
    return values


@pytest.mark.parametrize("command", ["controller", "node", "serve"])
def test_the_config_file_loads_for_each_command(command: str) -> None:
    args = _parse([command, "--config", str(CONFIG)])
    assert args.secret_file == "/etc/kvfabric/secret"
    assert args.metrics_host == "0.0.0.0"


def test_the_tables_give_each_command_its_own() -> None:
    controller = _parse(["controller", "--config", str(CONFIG)])
    node = _parse(["node", "--config", str(CONFIG)])
    assert (controller.listen, controller.metrics_port) == ("10.0.0.1:7100", 9100)
    assert (node.controller, node.capacity, node.metrics_port) == ("10.0.0.1:7100", "64GiB", 9101)


@pytest.mark.parametrize(
    ("command", "env_file"), [("controller", "controller.env"), ("node", "node.env")]
)
def test_the_environment_files_load_over_the_config_file(
    monkeypatch: pytest.MonkeyPatch, command: str, env_file: str
) -> None:
    values = _env_file(env_file)
    assert values["KVFABRIC_CONFIG"] == "/etc/kvfabric/kvfabric.toml"
    values["KVFABRIC_CONFIG"] = str(CONFIG)  # the installed path, here
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    args = _parse([command])
    if command == "node":
        assert (args.name, args.advertise, args.capacity) == ("node-a", "10.0.0.2", "64GiB")
    else:
        assert args.log_level == "INFO"


@pytest.mark.parametrize("unit", ["kvfabric-controller.service", "kvfabric-node.service"])
def test_the_units_verify(tmp_path: Path, unit: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here: the units were not verified")
    text = (DEPLOY / unit).read_text()
    assert "ExecStart=/opt/kvfabric/bin/kvfabric " in text
    # Verified as installed, with the paths of this checkout for the files it names.
    kvfabric = Path(sys.executable).with_name("kvfabric")
    text = text.replace("/opt/kvfabric/bin/kvfabric", str(kvfabric))
    text = re.sub(r"/etc/kvfabric/(\w+\.env)", lambda m: str(DEPLOY / m.group(1)), text)
    (tmp_path / unit).write_text(text)
    result = subprocess.run(
        [analyze, "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert unit not in result.stderr, result.stderr  # no warning about the unit itself


def test_the_engines_store_urls_parse() -> None:
    lmcache = (DEPLOY / "lmcache.yaml").read_text()
    (url,) = re.findall(r"remote_storage_plugin\.kvfabric\.url: (\S+)", lmcache)
    assert "remote_storage_plugin.kvfabric.module_path: kvfabric.adapters.lmcache" in lmcache
    vllm = json.loads((DEPLOY / "vllm-kv-transfer.json").read_text())
    assert vllm["kv_connector_module_path"] == "kvfabric.adapters.vllm"
    assert bytes_option(vllm["kv_connector_extra_config"]["max_pending_save_bytes"], "m") == 1 << 30
    for store_url in (url, vllm["kv_connector_extra_config"]["url"]):
        parsed = parse_url(store_url)
        assert parsed.options.secret_file == "/etc/kvfabric/secret"
