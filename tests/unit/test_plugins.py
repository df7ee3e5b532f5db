"""Entry-point discovery with a real, throwaway plugin distribution installed by pip."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvfabric._plugins import PluginManager, installed_plugins

_PLUGIN_MODULE = textwrap.dedent(
    '''
    """A third-party transport: the shm transport under another name."""
    from kvfabric.spi import hookimpl
    from kvfabric.transports.shm import ShmTransport


    class MirrorTransport(ShmTransport):
        name = "mirror"


    @hookimpl
    def kvfabric_register_transports(registry):
        registry.add("mirror", MirrorTransport)
    '''
)
_BROKEN_MODULE = "import kvfabric_missing_native_library  # noqa\n"
_INDEX_MODULE = textwrap.dedent(
    '''
    """A third-party index: the memory index with a declared option."""
    from kvfabric.indexes.memory import MemoryIndex
    from kvfabric.spi import OptionSpec, hookimpl

    LABELS = []


    class TallyIndex(MemoryIndex):
        name = "tally"
        options = (OptionSpec(name="label", parse=str, default="none", help="a label"),)

        @classmethod
        def create(cls, config):
            LABELS.append(config.options["label"])
            return super().create(config)


    @hookimpl
    def kvfabric_register_indexes(registry):
        registry.add("tally", TallyIndex)
    '''
)
_MALFORMED_MODULE = textwrap.dedent(
    '''
    """Registers something that is not an index."""
    from kvfabric.spi import hookimpl


    class NotAnIndex:
        name = "malformed"


    @hookimpl
    def kvfabric_register_indexes(registry):
        registry.add("malformed", NotAnIndex)
    '''
)
_BAD_HOOK_MODULE = textwrap.dedent(
    '''
    """Implements a registration hook with an argument kvfabric never passes."""
    from kvfabric.spi import hookimpl


    @hookimpl
    def kvfabric_register_indexes(registry, colour):
        pass
    '''
)


def _build_wheel(directory: Path) -> Path:
    """A minimal wheel by hand: no build backend or network needed to install it."""
    name, version = "kvfabric_mirror", "0.0.1"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        "kvfabric_mirror/__init__.py": _PLUGIN_MODULE,
        "kvfabric_mirror/broken.py": _BROKEN_MODULE,
        "kvfabric_mirror/tally.py": _INDEX_MODULE,
        "kvfabric_mirror/malformed.py": _MALFORMED_MODULE,
        "kvfabric_mirror/bad_hook.py": _BAD_HOOK_MODULE,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist_info}/entry_points.txt": "[kvfabric.transports]\n"
        "mirror = kvfabric_mirror\nbroken = kvfabric_mirror.broken\n"
        "[kvfabric.indexes]\ntally = kvfabric_mirror.tally\nmalformed = kvfabric_mirror.malformed\n"
        "bad_hook = kvfabric_mirror.bad_hook\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{dist_info}/RECORD", record)
    return wheel


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    wheel = _build_wheel(root)
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
        check=True,
    )
    return target


def _run(plugin_dir: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(plugin_dir)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_third_party_transport_is_found_by_name_and_works(plugin_dir: Path) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        store = kvfabric.connect("embedded://?transport=mirror")
        key = kvfabric.chain_key(kvfabric.ROOT_KEY, [1, 2, 3])
        store.batched_put([key], [b"through a plugin"])
        assert store.batched_contains([key]) == 1
        print(bytes(store.batched_get([key])[0]).decode())
        store.close()
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "through a plugin"


def test_unknown_name_lists_installed_plugins_including_third_party(plugin_dir: Path) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        try:
            kvfabric.connect("embedded://?transport=mirorr")
        except kvfabric.PluginNotFoundError as exc:
            print(exc)
        """,
    )
    # Other third-party transports may be installed too (the test envs add an example one).
    installed = result.stdout.partition("installed: ")[2].partition(";")[0].split(", ")
    assert {"broken", "mirror", "shm", "tcp"} <= set(installed)
    assert "did you mean 'mirror'?" in result.stdout


def test_plugin_that_cannot_import_gives_a_clear_error(plugin_dir: Path) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        try:
            kvfabric.connect("embedded://?transport=broken")
        except kvfabric.PluginUnavailableError as exc:
            print("unavailable:", exc)
        """,
    )
    assert "unavailable: transport 'broken' is installed but cannot be imported" in result.stdout
    assert "kvfabric_missing_native_library" in result.stdout


def test_a_third_party_index_is_selected_by_url_and_takes_its_options(plugin_dir: Path) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        from kvfabric_mirror.tally import LABELS
        with kvfabric.connect("embedded://?index=tally&tally.label=blue") as store:
            key = kvfabric.chain_key(kvfabric.ROOT_KEY, [4, 5, 6])
            store.batched_put([key], [b"indexed by a plugin"])
            assert store.batched_contains([key]) == 1
            print(bytes(store.batched_get([key])[0]).decode(), LABELS)
        try:
            kvfabric.connect("embedded://?index=tally&tally.colour=red")
        except kvfabric.ConfigError as exc:
            print("refused:", exc)
        """,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "indexed by a plugin ['blue']"
    assert "refused: tally has no option 'colour'; it accepts: label" in lines[1]


def test_a_malformed_plugin_fails_at_load_naming_plugin_hook_and_problem(
    plugin_dir: Path,
) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        for name in ("malformed", "bad_hook"):
            try:
                kvfabric.connect(f"embedded://?index={name}")
            except kvfabric.PluginError as exc:
                print(exc)
        """,
    )
    out = result.stdout
    assert "plugin kvfabric.indexes:malformed (kvfabric_register_indexes) registered index" in out
    assert "which is not a subclass of kvfabric.spi.IndexPlugin" in out
    assert "plugin kvfabric.indexes:bad_hook does not match kvfabric's hooks" in out
    assert "Argument(s) {'colour'} are declared in the hookimpl" in out


def test_a_plugin_that_failed_to_register_does_not_break_later_ones(plugin_dir: Path) -> None:
    result = _run(
        plugin_dir,
        """
        import kvfabric
        from kvfabric._plugins import PluginManager
        manager = PluginManager()
        try:
            manager.index("malformed")
        except kvfabric.PluginError:
            pass
        print(manager.index("tally").name, manager.transport("mirror").name)
        """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "tally mirror"


def test_cli_lists_third_party_plugins(plugin_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(plugin_dir)}
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric", "plugins"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    table = result.stdout.split("\n\n")[0]  # options and problems follow a blank line
    lines = {line.split()[1]: line for line in table.splitlines()[1:]}
    assert "kvfabric_mirror 0.0.1" in lines["mirror"]
    assert " ok " in lines["mirror"]
    assert "unavailable" in lines["broken"]
    assert " ok " in lines["shm"]
    assert " ok " in lines["tally"]
    assert " ok " in lines["memory"]


def test_built_ins_come_through_the_same_entry_points() -> None:
    names = {(p.kind, p.name): p for p in installed_plugins()}
    assert names[("transport", "shm")].target == "kvfabric.transports.shm"
    assert names[("backend", "dram")].distribution == "kvfabric"


def test_selecting_one_plugin_loads_only_that_entry_point() -> None:
    manager = PluginManager()
    manager.transport("shm")
    loaded = {name for name, _ in manager.pm.list_name_plugin()}
    assert loaded == {"kvfabric.transports:shm"}
