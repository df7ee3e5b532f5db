"""Start-up steps that take more than a moment say so, with how far they got; quick ones
stay quiet."""

from __future__ import annotations

import logging

import pytest

from kvfabric._runtime.step_log import StepLog
from kvfabric.testing import wait_for

log = logging.getLogger("kvfabric.test_step_log")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_a_slow_step_logs_its_progress_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    with StepLog(log, "preparing 4.0 GiB of memory", total=4 << 30, after=0.0, every=0.01) as step:
        step.advance(1 << 30)
        wait_for("the progress line", lambda: any("25%" in line for line in _lines(caplog)))
    lines = _lines(caplog)
    assert any("preparing 4.0 GiB of memory: 25% (1.0 GiB of 4.0 GiB)" in line for line in lines)
    assert "preparing 4.0 GiB of memory: done in " in lines[-1]


def test_a_failed_step_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)

    def reserve() -> None:
        with StepLog(log, "reserving files", after=0.0):
            wait_for("the first line", lambda: _lines(caplog))
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        reserve()
    assert "reserving files: failed in " in _lines(caplog)[-1]


def test_a_quick_step_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=log.name)
    with StepLog(log, "scanning", total=10, after=3600.0) as step:
        step.advance(10)
    assert _lines(caplog) == []
