"""Memory ready before the first put: the ``dram`` and ``file`` backends prefault their regions
at start (on by default, ``NAME.prefault=false`` to turn it off), and the node reports how
long it took (``prefault_ms``, and in its ready line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfabric._plugins import PluginOptions, plugin_manager
from kvfabric._runtime.huge_pages import policy_grants_advised
from kvfabric.errors import ConfigError
from kvfabric.spi import Backend, BackendConfig
from kvfabric.testing import Cluster, wait_for

_MIB = 1 << 20


def _prefault_seconds(backend: Backend) -> float:
    # Not part of the Backend interface: what the built-in backends tell the node.
    return float(getattr(backend, "prefault_seconds"))  # noqa: B009


def _allocated(path: str | None) -> int:
    """Bytes of the region's memory (memfd pages, file blocks) actually allocated."""
    assert path is not None
    return os.stat(path).st_blocks * 512


def _backend(name: str, tmp_path: Path, **options: str) -> Backend:
    cls = plugin_manager().backend(name)
    parsed = PluginOptions({name: options}).claim(cls) if options else cls.parse_options({})
    return cls(
        BackendConfig(
            capacity=24 * _MIB,
            region_size=8 * _MIB,
            path=str(tmp_path / "data") if name == "file" else None,
            options=parsed,
        )
    )


@pytest.mark.parametrize("name", ["dram", "file"])
def test_every_region_is_allocated_in_full_at_start(name: str, tmp_path: Path) -> None:
    backend = _backend(name, tmp_path)
    try:
        regions = backend.regions()
        assert len(regions) == 3
        for region in regions:
            assert _allocated(region.path) >= region.size
        assert _prefault_seconds(backend) > 0
    finally:
        backend.close()


# A file node allocates its files' blocks with prefault off too (a full disk must never
# reach a mapping): tests/backends/test_file_full_disk.py.
@pytest.mark.parametrize("name", ["dram"])
def test_prefault_off_leaves_the_memory_to_be_allocated_as_it_fills(
    name: str, tmp_path: Path
) -> None:
    backend = _backend(name, tmp_path, prefault="false")
    try:
        for region in backend.regions():
            assert _allocated(region.path) < region.size
        assert _prefault_seconds(backend) == 0
    finally:
        backend.close()


def test_prefaulting_a_file_keeps_what_it_holds(tmp_path: Path) -> None:
    backend = _backend("file", tmp_path, prefault="false")
    region = backend.regions()[1]
    region.view[4096:4100] = b"kept"
    backend.close()
    backend = _backend("file", tmp_path)
    try:
        region = backend.regions()[1]
        assert bytes(region.view[4096:4100]) == b"kept"
        assert _allocated(region.path) >= region.size
    finally:
        backend.close()


def test_a_bad_prefault_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefault"):
        PluginOptions({"dram": {"prefault": "maybe"}}).claim(plugin_manager().backend("dram"))


def _ready_line(cluster: Cluster) -> str:
    node = cluster.nodes[0]
    assert node is not None
    return node.ready_line


def test_a_node_reports_its_prefault_time_in_its_ready_line_and_its_stats() -> None:
    with Cluster(nodes=1, transports=("tcp",), capacity="64MiB") as cluster:
        stats = next(v for k, v in _node_stats(cluster).items() if k.startswith("node"))
        line = _ready_line(cluster)
    assert "memory prepared in" in line
    assert stats["prefault_ms"] >= 0
    assert stats["capacity_bytes"] == 64 * _MIB


def test_a_node_with_prefault_off_reports_zero() -> None:
    node_args = ["--backend-opt", "dram.prefault=false"]
    with Cluster(nodes=1, transports=("tcp",), capacity="64MiB", node_args=node_args) as cluster:
        stats = next(v for k, v in _node_stats(cluster).items() if k.startswith("node"))
        line = _ready_line(cluster)
    assert stats["prefault_ms"] == 0
    assert "memory prepared" not in line


def test_a_node_reports_how_much_of_its_memory_huge_pages_map() -> None:
    # What the kernel grants is the host's policy (see test_huge_pages): under every policy
    # the count is within the capacity, and the ready line names it exactly when it is not 0.
    with Cluster(nodes=1, transports=("tcp",), capacity="64MiB") as cluster:
        stats = next(v for k, v in _node_stats(cluster).items() if k.startswith("node"))
        line = _ready_line(cluster)
    huge = stats["huge_page_bytes"]
    assert 0 <= huge <= 64 * _MIB
    assert ("on huge pages" in line) == (huge > 0)
    if not policy_grants_advised():
        assert huge == 0


def _node_stats(cluster: Cluster) -> dict[str, dict[str, int]]:
    """The controller's stats, once the node's first heartbeat carried its counters."""
    return wait_for(
        "the node's first heartbeat",
        cluster.stats,
        until=lambda stats: any(
            k.startswith("node") and "prefault_ms" in v for k, v in stats.items()
        ),
    )
