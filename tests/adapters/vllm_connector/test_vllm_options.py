"""The connector's ``kv_connector_extra_config`` values take sizes and durations as every
kvfabric option does (no vLLM needed: the parsing is its own module)."""

from __future__ import annotations

import pytest

from kvfabric.adapters.vllm_options import bytes_option, seconds_option
from kvfabric.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "expected"), [("1GiB", 1 << 30), ("512MiB", 512 << 20), (4096, 4096), ("0", 0)]
)
def test_max_pending_save_bytes_takes_sizes(value: object, expected: int) -> None:
    assert bytes_option(value, "max_pending_save_bytes") == expected


@pytest.mark.parametrize("value", ["1G", "lots", -1, None])
def test_a_size_that_is_not_one_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="max_pending_save_bytes"):
        bytes_option(value, "max_pending_save_bytes")


def test_durations_are_durations() -> None:
    assert seconds_option("500ms", "load_timeout") == 0.5
    assert seconds_option(0, "lookup_wait", zero=True) == 0.0
    with pytest.raises(ConfigError, match="load_timeout"):
        seconds_option(0, "load_timeout")
