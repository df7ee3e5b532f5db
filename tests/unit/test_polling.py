"""``kvfabric.testing.wait_for``: the one way tests wait for something to happen."""

from __future__ import annotations

import itertools

import pytest

from kvfabric.testing import wait_for


def test_it_returns_the_first_value_that_holds_without_calling_again() -> None:
    counter = itertools.count()
    assert wait_for("the count at 3", lambda: next(counter), until=lambda n: n >= 3) == 3
    assert next(counter) == 4


def test_by_default_it_waits_for_a_true_value() -> None:
    values = iter([0, None, "", ["found"]])
    assert wait_for("a non-empty list", lambda: next(values)) == ["found"]


def test_past_the_bound_it_names_what_never_happened_and_the_last_value_seen() -> None:
    counter = itertools.count()
    with pytest.raises(
        AssertionError, match=r"^the count at -1: not within 0.05s \(last seen: \d+\)"
    ):
        wait_for("the count at -1", lambda: next(counter), 0.05, until=lambda n: n == -1)


def test_the_failure_carries_the_context_it_is_given() -> None:
    with pytest.raises(AssertionError, match="node log tail"):
        wait_for("never", lambda: False, 0.01, context=lambda: "node log tail")


def test_an_exception_from_the_check_is_a_failure_not_a_retry() -> None:
    calls = []

    def check() -> bool:
        calls.append(1)
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        wait_for("a key", check)
    assert calls == [1]


def test_a_check_that_acts_can_be_paced_instead_of_backed_off() -> None:
    calls: list[int] = []
    with pytest.raises(AssertionError):
        wait_for("never", lambda: calls.append(1), 0.25, every=0.1)
    assert 2 <= len(calls) <= 4  # at 0, 0.1, 0.2 and 0.3 s at most: never a burst
