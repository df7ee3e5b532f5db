"""Every test file runs in exactly one tox env, which selects it by its directory.

CI runs the envs, never a bare ``pytest``: a file no env selects never runs (four once
went unrun that way), and a file two envs select runs twice. Envs name directories, never
files, so a new test file is picked up by where it is put; a second pass inside an env
narrows its directories by a marker. And an env whose command collects no test (pytest's
exit status 5) must fail, not pass with nothing run: no command's exit status is ignored.
"""

from __future__ import annotations

import configparser
import itertools
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tox() -> configparser.ConfigParser:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    return tox


def _commands(section: configparser.SectionProxy) -> list[str]:
    """The env's commands (commands_pre too), one string each, comments left out."""
    text = "\n".join(section.get(key, "") for key in ("commands_pre", "commands"))
    lines = text.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _words(command: str) -> list[str]:
    """The command's words, and those of the scripts it hands to ``bash -c``."""
    words: list[str] = []
    for word in shlex.split(command):
        words += _words(word) if " " in word else [word]
    return words


def _envs() -> dict[str, list[list[str]]]:
    """Each test env's name and its commands, as words."""
    tox = _tox()
    return {
        section.removeprefix("testenv:"): [_words(c) for c in _commands(tox[section])]
        for section in tox.sections()
        if section.startswith("testenv:")
    }


def _selected(commands: list[list[str]]) -> set[Path]:
    return {ROOT / word for words in commands for word in words if word.startswith("tests/")}


def test_envs_select_directories_never_single_files() -> None:
    named = {env: _selected(commands) for env, commands in _envs().items()}
    assert named["core"]  # the parsing found what it looks for
    not_directories = {
        env: sorted(p.relative_to(ROOT).as_posix() for p in paths if not p.is_dir())
        for env, paths in named.items()
    }
    assert {env: paths for env, paths in not_directories.items() if paths} == {}


def test_every_test_file_is_selected_by_exactly_one_env() -> None:
    named = {env: _selected(commands) for env, commands in _envs().items()}
    envs_of = {
        path.relative_to(ROOT).as_posix(): [
            env for env, paths in named.items() if paths & {path, *path.parents}
        ]
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
    }
    assert {name: envs for name, envs in envs_of.items() if len(envs) != 1} == {}


def test_the_markers_envs_select_by_are_registered(pytestconfig: pytest.Config) -> None:
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    used: set[str] = set()
    for commands in _envs().values():
        for words in commands:
            after = words[words.index("pytest") :] if "pytest" in words else []
            for flag, expression in itertools.pairwise(after):
                if flag == "-m":
                    used |= set(expression.replace("(", " ").replace(")", " ").split())
    assert "per_index" in used  # the parsing found what it looks for
    assert used - {"not", "and", "or"} <= registered


def test_no_env_ignores_a_command_that_fails_or_collects_nothing() -> None:
    tox = _tox()
    for section in tox.sections():
        assert "ignore_outcome" not in tox[section], section
        assert "ignore_errors" not in tox[section], section
        for command in _commands(tox[section]):
            assert not command.startswith("-"), f"[{section}] ignores the status of: {command}"
            if "pytest" in command:
                assert "||" not in command, f"[{section}] may hide the status of: {command}"


def test_the_env_list_names_only_envs_that_exist() -> None:
    tox = _tox()
    listed = [env.strip() for env in tox["tox"]["env_list"].split(",")]
    assert listed
    assert [env for env in listed if not tox.has_section(f"testenv:{env}")] == []
