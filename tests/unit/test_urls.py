from __future__ import annotations

import re

import pytest

import kvfabric
from kvfabric.errors import ConfigError
from kvfabric.spi.units import format_size, parse_duration, parse_size
from kvfabric.urls import EmbeddedOptions, parse_url


def test_embedded_url_options_are_parsed_and_typed() -> None:
    url = parse_url("embedded://?capacity=256MiB&timeout=500ms&prefetch_entries=10&grace=0")
    assert isinstance(url.options, EmbeddedOptions)
    assert url.options.capacity == 256 << 20
    assert url.options.timeout == 0.5
    assert url.options.prefetch_entries == 10
    assert url.options.grace == 0.0


def test_embedded_name_is_the_host() -> None:
    assert parse_url("embedded://shared-one").host == "shared-one"


def test_unknown_option_lists_what_is_accepted() -> None:
    with pytest.raises(ConfigError) as info:
        parse_url("embedded://?capcity=1GiB")
    message = str(info.value)
    assert "capcity" in message
    assert "capacity" in message
    assert "did you mean 'capacity'" in message


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://localhost", "accepted: embedded://"),
        ("embedded://?capacity=lots", "not a size"),
        ("embedded://?timeout=soon", "not a duration"),
        ("embedded://?capacity=1GiB&capacity=2GiB", "given twice"),
        ("embedded://?headroom=2", "must be in [0, 1)"),
        ("embedded://x:99", "at most a name"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse_url(url)


def test_unknown_transport_names_the_installed_ones() -> None:
    with pytest.raises(kvfabric.PluginNotFoundError, match=r"installed: .*shm"):
        kvfabric.connect("embedded://?transport=carrier-pigeon")


def test_a_misspelt_plugin_name_gets_a_suggestion() -> None:
    with pytest.raises(kvfabric.PluginNotFoundError, match=r"did you mean 'tcp'"):
        kvfabric.connect("embedded://?transport=tpc")


def test_plugin_options_from_the_url_reach_the_plugin_and_typos_are_refused() -> None:
    with kvfabric.connect("embedded://?transport=tcp&tcp.pool=3") as store:
        assert store.ping()
    with pytest.raises(ConfigError, match=r"tcp has no option 'pol'.*pool"):
        kvfabric.connect("embedded://?transport=tcp&tcp.pol=3")
    with pytest.raises(ConfigError, match=r"option tcp.pool='many'"):
        kvfabric.connect("embedded://?transport=tcp&tcp.pool=many")
    with pytest.raises(ConfigError, match=r"options given for ucx, which this .* not use"):
        kvfabric.connect("embedded://?transport=tcp&ucx.whatever=1")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("256MiB", 256 << 20),
        ("4GiB", 4 << 30),
        ("16gib", 16 << 30),
        ("1.5GB", 1_500_000_000),
        ("0.1KB", 100),
        ("100TiB", 100 << 40),
    ],
)
def test_sizes_are_bytes_binary_with_iec_units_and_decimal_with_si_units(
    text: str, value: int
) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["16G", "16g", "512M", "4k", "1T"])
def test_a_single_letter_size_unit_is_refused_with_both_readings(text: str) -> None:
    with pytest.raises(ConfigError, match="ambiguous") as info:
        parse_size(text)
    number, letter = text[:-1], text[-1].upper()
    assert f"{number}{letter}iB" in str(info.value)
    assert f"{number}{letter}B" in str(info.value)


@pytest.mark.parametrize("text", ["lots", "1.5", "16 bananas", "-1GiB", ""])
def test_a_size_that_is_not_a_whole_number_of_bytes_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("e.g. 4096")):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "value"), [("2", 2.0), ("2s", 2.0), ("250ms", 0.25), ("1.5min", 90.0), ("1m", 60.0)]
)
def test_durations(text: str, value: float) -> None:
    assert parse_duration(text) == value


def test_format_size() -> None:
    assert format_size(512 * 1024) == "512.0 KiB"
    assert format_size(12) == "12 B"
