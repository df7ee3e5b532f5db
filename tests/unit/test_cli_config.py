"""Options from flags, ``KVFABRIC_*`` variables and ``--config FILE``: precedence, naming,
and errors that say where a bad value came from."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvfabric._tools.cli import _parse, build_parser
from kvfabric._tools.config_sources import commands_of, env_name, options_of
from kvfabric.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_kvfabric_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVFABRIC_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvfabric.toml"
    path.write_text(text)
    return str(path)


def test_flags_win_over_the_environment_which_wins_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _toml(
        tmp_path,
        'capacity = "1GiB"\nheartbeat = "3s"\nregion_size = "256MiB"\n'
        '[node]\nname = "from-file"\nmetrics-port = 9100\n',
    )
    args = _parse(["node", "--config", config])
    assert (args.capacity, args.heartbeat, args.name, args.metrics_port) == (
        "1GiB",
        "3s",
        "from-file",
        9100,
    )
    monkeypatch.setenv("KVFABRIC_CAPACITY", "2GiB")
    monkeypatch.setenv("KVFABRIC_NAME", "from-env")
    args = _parse(["node", "--config", config, "--name", "from-flag"])
    assert args.capacity == "2GiB"  # env over file
    assert args.name == "from-flag"  # flag over env and file
    assert args.region_size == "256MiB"  # file over default
    assert args.timeout == "2s"  # default


def test_the_config_file_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFABRIC_CONFIG", _toml(tmp_path, '[serve]\ncapacity = "8MiB"\n'))
    assert _parse(["serve"]).capacity == "8MiB"
    assert _parse(["node"]).capacity == "4GiB"  # [serve] is not node's table


def test_a_command_table_wins_over_the_top_level(tmp_path: Path) -> None:
    config = _toml(tmp_path, 'capacity = "1GiB"\n[node]\ncapacity = "2GiB"\n')
    assert _parse(["node", "--config", config]).capacity == "2GiB"
    assert _parse(["serve", "--config", config]).capacity == "1GiB"


def test_repeatable_options_take_lists_and_flags_replace_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _toml(tmp_path, '[node]\ntransport_opt = ["tcp.pool=4", "tcp.tls=false"]\n')
    assert _parse(["node", "--config", config]).transport_opt == ["tcp.pool=4", "tcp.tls=false"]
    flagged = _parse(["node", "--config", config, "--transport-opt", "tcp.pool=2"])
    assert flagged.transport_opt == ["tcp.pool=2"]
    monkeypatch.setenv("KVFABRIC_BACKEND_OPT", "dram.prefault=false")
    assert _parse(["node"]).backend_opt == ["dram.prefault=false"]


def test_types_and_choices_apply_as_for_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFABRIC_LOG_LEVEL", "debug")
    monkeypatch.setenv("KVFABRIC_METRICS_PORT", "9101")
    monkeypatch.setenv("KVFABRIC_REPLICAS", "2")
    args = _parse(["serve"])
    assert (args.log_level, args.metrics_port, args.replicas) == ("DEBUG", 9101, 2)


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFABRIC_CAPACITY", "")
    assert _parse(["node"]).capacity == "4GiB"


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("KVFABRIC_CAPACITY", "lots", "KVFABRIC_CAPACITY: not a size"),
        ("KVFABRIC_HEARTBEAT", "soon", "KVFABRIC_HEARTBEAT"),
        ("KVFABRIC_METRICS_PORT", "70000", "KVFABRIC_METRICS_PORT: a port is 0-65535"),
        ("KVFABRIC_LOG_LEVEL", "loud", "KVFABRIC_LOG_LEVEL: 'loud' is not one of"),
    ],
)
def test_a_bad_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=said):
        _parse(["node"])


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('capcity = "1GiB"\n', r"unknown key 'capcity' \(did you mean capacity"),
        ('[node]\nlisten = "127.0.0.1:7100"\n', r"\[node\] listen: unknown key 'listen'"),
        ('[nodes]\ncapacity = "1GiB"\n', r"unknown table \[nodes\]"),
        ('[controller]\ncapacity = "1GiB"\n', r"\[controller\] capacity: unknown key"),
        ('[node]\ncapacity = "lots"\n', r"\[node\] capacity: not a size"),
        ("capacity = [1, 2]\n", "capacity: a string, number or boolean"),
        ("capacity = \n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_key(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        _parse(["node", "--config", _toml(tmp_path, text)])


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        _parse(["node", "--config", str(tmp_path / "absent.toml")])


def test_every_option_of_every_command_has_its_variable() -> None:
    """The names are fixed: --foo-bar is KVFABRIC_FOO_BAR, and no two options of one
    command share a variable."""
    for name, command in commands_of(build_parser()).items():
        names: dict[str, str] = {}
        for action in command._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for option in action.option_strings:
                if option.startswith("--") and option not in ("--help", "--config"):
                    variable = env_name(option)
                    assert variable == "KVFABRIC_" + option[2:].replace("-", "_").upper()
                    assert names.setdefault(variable, action.dest) == action.dest, name
        assert set(options_of(command)) == {v.removeprefix("KVFABRIC_").lower() for v in names}


def test_deprecated_spellings_still_work_and_warn(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["controller", "--timeout", "5s"])
    assert args.metrics_timeout == "5s"
    warning = capsys.readouterr().err
    assert warning.count("deprecated") == 1
    assert "--metrics-timeout" in warning


def test_timeout_means_one_thing_wherever_it_is_taken() -> None:
    helps = set()
    for name in ("node", "serve", "stats"):
        command = commands_of(build_parser())[name]
        (action,) = [a for a in command._actions if "--timeout" in a.option_strings]
        helps.add(action.help)
    assert len(helps) == 1
    controller = commands_of(build_parser())["controller"]
    (alias,) = [a for a in controller._actions if "--timeout" in a.option_strings]
    assert alias.help == argparse.SUPPRESS
