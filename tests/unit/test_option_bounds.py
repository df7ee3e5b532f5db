"""Options and inputs that make no sense are refused where they are given.

Each refusal names the option, the value and what is accepted: store URLs (``lease=0``,
``timeout=0``, a host ZeroMQ cannot use), plug-in options, the server commands (one
``kvfabric: error:`` line, exit status 2), and descriptors handed to ``Store.remember``
from another process (never an allocation of the size they claim).
"""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric._plugins import plugin_manager
from kvfabric.errors import ConfigError
from kvfabric.keys import chain_keys
from kvfabric.testing import free_port
from kvfabric.urls import parse_url


@pytest.mark.parametrize(
    ("query", "option", "accepted"),
    [
        ("lease=0", "'lease'", "more than 0s"),
        ("timeout=0", "'timeout'", "more than 0s"),
        ("timeout=100000", "'timeout'", "at most 86400s"),
        ("prefetch_ttl=99999999s", "'prefetch_ttl'", "at least 0s and at most 86400s"),
        ("max_value=0", "'max_value'", "at least 1"),
        ("grace=2days", "'grace'", "use e.g. 2s"),
    ],
)
def test_embedded_url_options_out_of_range_name_option_value_and_range(
    query: str, option: str, accepted: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_url(f"embedded://?{query}")
    message = str(refused.value)
    assert f"option {option}" in message
    assert repr(query.split("=")[1]) in message
    assert accepted in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("kvfabric://127.0.0.1:7100?control_timeout=0", "option 'control_timeout': '0'"),
        ("kvfabric://127.0.0.1:7100?timeout=0ms", "option 'timeout': '0ms'"),
        ("kvfabric://hôst:7100", "'hôst' is not a host name or address"),
        ("kvfabric://hôst:7100", "'xn--hst-kna'"),
        ("kvfabric://a b:7100", "'a b' is not a host name or address"),
        ("kvfabric://[::1:7100", "not a store URL"),
        ("kvfabric://127.0.0.1:0", "a port of 1-65535"),
    ],
)
def test_remote_urls_that_cannot_work_are_refused(url: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=r"accepted|store URL|port") as refused:
        parse_url(url)
    assert expected in str(refused.value)


def test_zero_is_accepted_where_it_means_something() -> None:
    options = parse_url("kvfabric://127.0.0.1:7100?retry_interval=0&prefetch_ttl=0").options
    assert (options.retry_interval, options.prefetch_ttl) == (0.0, 0.0)  # type: ignore[attr-defined]
    assert parse_url("embedded://?grace=0").options.grace == 0.0  # type: ignore[attr-defined]
    assert parse_url("kvfabric://[::1]:7100").host == "::1"


@pytest.mark.parametrize(
    ("kind", "name", "raw", "expected"),
    [
        (
            "transport",
            "tcp",
            {"pool": "-1"},
            "tcp.pool='-1': '-1' is out of range; accepted: at least 0",
        ),
        ("transport", "tcp", {"max_connections": "0"}, "accepted: at least 1"),
        ("transport", "tcp", {"frame_timeout": "0"}, "accepted: more than 0s"),
        ("transport", "tcp", {"handshake_timeout": "2days"}, "not a duration"),
        ("index", "memory", {"image": "1TiB"}, "at most 64.0 GiB"),
        ("index", "memory", {"image": "16"}, "0 (keep none), or at least 64 B"),
        ("backend", "file", {"sync": "100000s"}, "0 (off), or more than 0s and at most 86400s"),
    ],
)
def test_plugin_options_out_of_range_are_refused(
    kind: str, name: str, raw: dict[str, str], expected: str
) -> None:
    plugin = getattr(plugin_manager(), kind)(name)
    with pytest.raises(ConfigError) as refused:
        plugin.parse_options(raw)
    assert expected in str(refused.value)
    assert f"{name}.{next(iter(raw))}=" in str(refused.value)


def test_plugin_options_keep_their_meaningful_zeros() -> None:
    tcp = plugin_manager().transport("tcp").parse_options({"idle_timeout": "0", "pool": "0"})
    assert (tcp["idle_timeout"], tcp["pool"]) == (0.0, 0)
    assert plugin_manager().backend("file").parse_options({"sync": "0"})["sync"] == 0.0
    assert plugin_manager().index("memory").parse_options({"image": "0"})["image"] == 0


def _error_line(*args: str) -> str:
    """Run ``kvfabric ARGS``; it must exit 2 with exactly one error line on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "kvfabric", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvfabric: error: ")
    return lines[0]


def _listen() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("serve", "--lease", "0"), "--lease: '0' is out of range; accepted: more than 0s"),
        (("serve", "--grace", "2days"), "--grace: not a duration: '2days'"),
        (("controller", "--node-timeout", "0"), "--node-timeout: '0' is out of range"),
        (("controller", "--headroom", "1"), "--headroom: 1.0 is out of range; accepted: 0 to"),
        (("node", "--heartbeat", "0"), "--heartbeat: '0' is out of range"),
        (("node", "--timeout", "0s"), "--timeout: '0s' is out of range"),
        (("node", "--host", "hôst"), "--host 'hôst' is not a host name or address; accepted"),
        (("node", "--advertise", "a b"), "--advertise 'a b' is not a host name or address"),
        (("controller", "--metrics-port", "0", "--metrics-host", "hôst"), "--metrics-host 'hôst'"),
        (("node", "--transport-opt", "tcp.pool=-1"), "tcp.pool='-1': '-1' is out of range"),
        (("stats", "--timeout", "0"), "--timeout: '0' is out of range"),
        (("node", "--transport", " , "), "--transport ' , ': a data node serves over at least"),
        (("serve", "--transport", "none"), "--transport 'none': a data node serves over"),
    ],
)
def test_server_commands_refuse_nonsense_in_one_line_naming_the_option(
    args: tuple[str, ...], expected: str
) -> None:
    command, *rest = args
    where = {
        "serve": ["--listen", _listen(), "--capacity", "8MiB"],
        "controller": ["--listen", _listen()],
        "node": ["--controller", _listen(), "--capacity", "8MiB"],
        "stats": ["--controller", _listen()],
    }[command]
    assert expected in _error_line(command, *where, *rest)


def test_a_non_ascii_controller_address_is_refused_with_the_forms_accepted() -> None:
    line = _error_line("controller", "--listen", "hôst:7100")
    assert "--listen 'hôst:7100' is not an address; use HOST:PORT" in line
    line = _error_line("controller", "--listen", "127.0.0.1:\u0667\u0661\u0660\u0660")
    assert "is not an address" in line


# -- descriptors from another process ----------------------------------------------------


@pytest.fixture
def stored() -> tuple[kvfabric.Store, list[bytes], list[bytes]]:
    store = kvfabric.connect("embedded://?capacity=16MiB")
    keys = chain_keys(list(range(3)), 1, namespace=os.urandom(8))
    values = [bytes([i]) * 1000 for i in range(3)]
    assert store.batched_put(keys, values) == [PutOutcome.STORED] * 3
    yield store, keys, values
    store.close()


def test_a_remembered_descriptor_longer_than_max_value_is_not_kept_nor_allocated(
    stored: tuple[kvfabric.Store, list[bytes], list[bytes]],
) -> None:
    store, keys, values = stored
    located = store.locate(keys)
    assert None not in located
    huge = [attrs.evolve(d, length=1 << 62) for d in located if d is not None]
    store.remember(huge)
    assert store.prefetched(keys) == [None, None, None]
    got = store.batched_get(keys)  # resolved by the index instead
    assert [bytes(g) if g is not None else None for g in got] == values


@pytest.mark.parametrize(
    "change",
    [{"offset": (1 << 63) + 64}, {"node": 999}, {"region": 77}, {"rkey": 12345}],
    ids=["offset past the region", "unknown node", "unknown region", "wrong rkey"],
)
def test_a_remembered_descriptor_the_store_cannot_read_is_a_miss(
    stored: tuple[kvfabric.Store, list[bytes], list[bytes]], change: dict[str, int]
) -> None:
    store, keys, values = stored
    located = store.locate(keys[:1])
    assert located[0] is not None
    store.remember([attrs.evolve(located[0], **change)])
    assert store.batched_get(keys[:1]) == [None]
    assert [bytes(g) if g else None for g in store.batched_get(keys[1:])] == values[1:]


def test_remember_takes_descriptors_only(
    stored: tuple[kvfabric.Store, list[bytes], list[bytes]],
) -> None:
    store, keys, _ = stored
    with pytest.raises(TypeError, match=r"remember\(\) takes Descriptor objects"):
        store.remember([b"not a descriptor"])  # type: ignore[list-item]
    located = store.locate(keys[:1])[0]
    assert located is not None
    with pytest.raises(ValueError, match="offset must fit in 64 bits unsigned"):
        attrs.evolve(located, offset=-64)
