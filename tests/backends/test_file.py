"""The ``file`` backend: the store suite over shm and tcp, and what only files promise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric.errors import ConfigError
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, StoreConformance


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("file-backend")


def _file_store_url(name: str, path: Path, transport: str) -> Iterator[str]:
    """A store on files of its own; the files go when the test ends (each test would
    otherwise leave its files behind). file.prefault off: the blocks are allocated as the
    test writes them, not 512 MiB ahead for every test (what the suite checks does not
    depend on it; test_prefault.py checks prefaulting)."""
    url = f"embedded://{name}?backend=file&path={path}&capacity=512MiB&transport={transport}"
    yield f"{url}&file.prefault=false"
    shutil.rmtree(path, ignore_errors=True)


class TestEmbeddedStoreOnFilesOverShm(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str, data_root: Path) -> Iterator[str]:
        yield from _file_store_url(unique_name, data_root / unique_name, "shm")


class TestEmbeddedStoreOnFilesOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, unique_name: str, data_root: Path) -> Iterator[str]:
        yield from _file_store_url(unique_name, data_root / unique_name, "tcp")


@pytest.fixture(scope="module")
def file_cluster() -> Iterator[Cluster]:
    with Cluster(nodes=2, transports=("tcp", "shm"), capacity="512MiB", backend="file") as c:
        yield c


class TestClusterStoreOnFilesOverShm(StoreConformance):
    @pytest.fixture
    def store_url(self, file_cluster: Cluster) -> str:
        return file_cluster.url(transport="shm")


class TestClusterStoreOnFilesOverTcp(StoreConformance):
    @pytest.fixture
    def store_url(self, file_cluster: Cluster) -> str:
        return file_cluster.url(transport="tcp")


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=os.urandom(8))


def test_a_store_reopened_by_a_new_process_finds_its_records(tmp_path: Path) -> None:
    url = f"embedded://?backend=file&path={tmp_path}&capacity=16MiB"
    keys = _keys(50)
    values = [os.urandom(3000) for _ in keys]
    with kvfabric.connect(url) as store:
        assert store.batched_put(keys, values) == [PutOutcome.STORED] * 50
    code = (
        "import sys, kvfabric\n"
        f"keys = [bytes.fromhex(k) for k in {[k.hex() for k in keys]!r}]\n"
        f"with kvfabric.connect({url!r}) as store:\n"
        "    print(store.batched_contains(keys))\n"
        "    for value in store.batched_get(keys):\n"
        "        print(bytes(value).hex() if value is not None else '-')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stdout.split()
    assert lines[0] == "50"
    assert lines[1:] == [v.hex() for v in values]


def test_a_second_node_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    url = f"embedded://?backend=file&path={tmp_path}&capacity=4MiB"
    with kvfabric.connect(url), pytest.raises(ConfigError, match="in use by another kvfabric"):
        kvfabric.connect(url)


def test_the_backend_needs_a_directory() -> None:
    with pytest.raises(ConfigError, match="needs a directory"):
        kvfabric.connect("embedded://?backend=file&capacity=4MiB")


def test_the_sync_option_is_declared_and_checked(tmp_path: Path) -> None:
    url = f"embedded://?backend=file&path={tmp_path}&capacity=4MiB"
    with kvfabric.connect(url + "&file.sync=50ms") as store:
        keys = _keys(4)
        assert store.batched_put(keys, [b"synced"] * 4) == [PutOutcome.STORED] * 4
    with pytest.raises(ConfigError, match=r"file\.sync"):
        kvfabric.connect(url + "&file.sync=often")


def test_files_keep_the_capacity_they_were_given(tmp_path: Path) -> None:
    with kvfabric.connect(
        f"embedded://?backend=file&path={tmp_path}&capacity=8MiB&region_size=4MiB"
    ):
        sizes = sorted(p.stat().st_size for p in tmp_path.glob("region-*.kvf"))
    assert sizes == [4 << 20, 4 << 20]
