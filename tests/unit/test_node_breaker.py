"""The per-node circuit breaker on a clock moved by hand: who is held off, who probes, and how
the period grows and ends."""

from __future__ import annotations

import threading

from kvfabric._client.node_breaker import MAX_BACKOFF, NodeBreaker


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(backoff: float = 1.0) -> tuple[NodeBreaker, _Clock]:
    clock = _Clock()
    return NodeBreaker(backoff, clock=clock), clock


def test_a_failed_node_is_skipped_for_the_period_and_others_are_not() -> None:
    breaker, clock = _breaker()
    assert not breaker.engaged
    assert breaker.skipped([1, 2]) == set()
    assert breaker.failed(1, clock.now)
    assert breaker.engaged
    assert breaker.skipped([1, 2]) == {1}
    assert breaker.unavailable() == {1}
    clock.now += 0.99
    assert breaker.skipped([1, 2]) == {1}


def test_after_the_period_one_call_probes_and_the_others_still_skip() -> None:
    breaker, clock = _breaker()
    breaker.failed(1, clock.now)
    clock.now += 1.0
    assert breaker.skipped([1]) == set()  # this call probes
    assert breaker.skipped([1]) == {1}
    assert breaker.unavailable() == {1}
    breaker.succeeded(1)
    assert not breaker.engaged
    assert breaker.skipped([1]) == set()


def test_each_failed_probe_doubles_the_period_up_to_the_cap() -> None:
    breaker, clock = _breaker()
    breaker.failed(1, clock.now)
    period = 1.0
    for _ in range(8):
        clock.now += period
        started = clock.now
        assert breaker.skipped([1]) == set()
        assert breaker.failed(1, started)
        period = min(2 * period, MAX_BACKOFF)
        clock.now += period - 0.01
        assert breaker.skipped([1]) == {1}
        clock.now += 0.01
    assert period == MAX_BACKOFF


def test_failures_of_calls_already_waiting_when_the_node_failed_do_not_lengthen_it() -> None:
    breaker, clock = _breaker()
    started = clock.now
    clock.now += 1.0  # several calls waited on the node; the first to fail holds it off
    assert breaker.failed(1, started)
    assert not breaker.failed(1, started)
    clock.now += 1.0
    assert breaker.skipped([1]) == set()  # the period stayed 1 s


def test_a_node_learned_anew_starts_clean_and_zero_never_holds_off() -> None:
    breaker, clock = _breaker()
    breaker.failed(1, clock.now)
    breaker.forget([1])
    assert breaker.skipped([1]) == set()
    never, clock = _breaker(0.0)
    assert not never.failed(1, clock.now)
    assert not never.engaged


def test_threads_probing_together_hand_the_probe_to_one() -> None:
    breaker, clock = _breaker()
    breaker.failed(1, clock.now)
    clock.now += 1.0
    probes: list[bool] = []
    barrier = threading.Barrier(8)

    def call() -> None:
        barrier.wait()
        probes.append(1 not in breaker.skipped([1]))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(probes) == [False] * 7 + [True]
