"""Every test file runs in some tox env: CI runs the envs, never a bare ``pytest``.

Four files (tcp's hostile-traffic, TLS and data-path tests, shm's data path) were once named
by no env's command, so CI never ran them; this keeps a new file from being left out the
same way.
"""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _paths_named_by_envs() -> set[Path]:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    named: set[Path] = set()
    for section in tox.sections():
        commands = tox[section].get("commands", "").replace("\\\n", " ")
        for word in commands.split():
            word = word.strip("'\"")
            if word.startswith("tests/"):
                named.add(ROOT / word)
    return named


def test_every_test_file_is_run_by_some_tox_env() -> None:
    named = _paths_named_by_envs()
    left_out = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if not any(path == n or n in path.parents for n in named)
    ]
    assert left_out == []


def test_the_env_list_names_only_envs_that_exist() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    listed = [env.strip() for env in tox["tox"]["env_list"].split(",")]
    assert listed
    assert [env for env in listed if not tox.has_section(f"testenv:{env}")] == []
