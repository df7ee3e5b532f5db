"""Repeated warnings: one record per key per interval, and the next one counts exactly what
was held back."""

from __future__ import annotations

import logging
import os
import threading

import pytest

import kvfabric
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.keys import chain_keys
from kvfabric.testing import free_port


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger() -> logging.Logger:
    named = logging.getLogger(f"kvfabric.test_limited_log.{os.urandom(4).hex()}")
    named.setLevel(logging.DEBUG)
    return named


def _messages(caplog: pytest.LogCaptureFixture, logger: logging.Logger) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger.name]


def test_one_record_per_key_per_interval_then_the_exact_count_held_back(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    limited = LimitedLog(logger, interval=60.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger.name):
        assert limited.warning("read", "read from node %d failed", 3)
        for _ in range(41):
            clock.now += 1.0
            assert not limited.warning("read", "read from node %d failed", 3)
        assert limited.suppressed("read") == 41
        clock.now += 19.0  # 60 s after the first record went out
        assert limited.warning("read", "read from node %d failed", 3)
        assert limited.suppressed("read") == 0
        clock.now += 61.0
        assert limited.warning("read", "read from node %d failed", 3)  # nothing held back
    assert _messages(caplog, logger) == [
        "read from node 3 failed",
        "read from node 3 failed (41 more like this in the last 60 s)",
        "read from node 3 failed",
    ]


def test_keys_are_limited_apart_and_levels_are_kept(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    limited = LimitedLog(logger, interval=10.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger.name):
        for _ in range(5):
            limited.warning(("write", 1), "write to %d", 1)
            limited.warning(("write", 2), "write to %d", 2)
            limited.error("agent", "agent failed")
        clock.now += 10.0
        limited.warning(("write", 2), "write to %d", 2)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger.name]
    assert records == [
        (logging.WARNING, "write to 1"),
        (logging.WARNING, "write to 2"),
        (logging.ERROR, "agent failed"),
        (logging.WARNING, "write to 2 (4 more like this in the last 10 s)"),
    ]
    assert limited.suppressed(("write", 1)) == 4
    assert limited.suppressed("agent") == 4


def test_a_level_not_enabled_is_neither_logged_nor_counted(logger: logging.Logger) -> None:
    logger.setLevel(logging.WARNING)
    limited = LimitedLog(logger, clock=_Clock())
    assert not limited.info("invalid", "record invalid")
    assert not limited.info("invalid", "record invalid")
    assert limited.suppressed("invalid") == 0


def test_threads_racing_on_one_key_are_counted_exactly(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    limited = LimitedLog(logger, interval=60.0, clock=clock)
    threads, calls = 8, 500

    def hammer() -> None:
        for _ in range(calls):
            limited.warning("down", "index unavailable")

    with caplog.at_level(logging.DEBUG, logger.name):
        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        clock.now += 60.0
        limited.warning("down", "index unavailable")
    assert _messages(caplog, logger) == [
        "index unavailable",
        f"index unavailable ({threads * calls - 1} more like this in the last 60 s)",
    ]


def test_the_interval_must_be_positive(logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="interval"):
        LimitedLog(logger, interval=0)


def test_a_client_whose_controller_is_down_warns_once_for_many_failed_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"kvfabric://127.0.0.1:{free_port()}?control_timeout=50ms&retry_interval=0"
    keys = chain_keys(list(range(4)), 1, namespace=os.urandom(8))
    with caplog.at_level(logging.WARNING, "kvfabric"), kvfabric.connect(url) as store:
        for _ in range(20):
            assert store.batched_contains(keys) == 0
            assert store.batched_exists(keys) == [False] * 4
        unavailable = store.stats()["controller_unavailable"]
    lines = [r for r in caplog.records if "index unavailable" in r.getMessage()]
    assert unavailable >= 40
    assert len(lines) == 1
