"""A client's usage reports: latency histograms kept per thread, deltas sent once, a failed
report dropped (never resent), and the controller's sums as Prometheus families."""

from __future__ import annotations

import threading

from kvfabric._client.counter_names import client_counters
from kvfabric._client.usage import GET, LOOKUP, CallTimes, UsageReporter
from kvfabric._control.client_usage import ClientUsage
from kvfabric._runtime.codec import Reader
from kvfabric._tools.metric_families import families
from kvfabric._wire.protocol import MsgType
from kvfabric._wire.usage import BUCKETS_SECONDS, USAGE_NAMES, write_usage
from kvfabric.errors import ControllerUnavailableError

_INF = len(BUCKETS_SECONDS)


def test_each_call_lands_in_its_bucket_whatever_thread_made_it() -> None:
    times = CallTimes()
    times.observe(LOOKUP, 0)
    times.observe(LOOKUP, 50_000)  # on the first bound: in its bucket
    times.observe(LOOKUP, 50_001)
    worker = threading.Thread(target=times.observe, args=(GET, 20 * 10**9))
    worker.start()
    worker.join()
    counts = times.snapshot()
    assert (counts["lookup_bucket_0"], counts["lookup_bucket_1"]) == (2, 1)
    assert counts["lookup_duration_ns"] == 100_001
    assert counts[f"get_bucket_{_INF}"] == 1  # past the last bound: +Inf
    assert counts["put_duration_ns"] == 0


def test_a_failed_report_is_dropped_and_the_next_sends_only_what_came_after() -> None:
    counters, times = client_counters(), CallTimes()
    sent: list[dict[str, int]] = []
    fail = [True]

    def send(usage: dict[str, int]) -> bool:
        if fail[0]:
            raise ControllerUnavailableError("down")
        sent.append(usage)
        return True

    reporter = UsageReporter(send, counters, times, interval=0)
    counters.update(lookup_keys=10, prefix_hits=4)
    reporter.report()
    assert sent == []
    assert counters.snapshot()["usage_reports_dropped"] == 1
    fail[0] = False
    counters.update(lookup_keys=3, prefix_hits=3)
    times.observe(LOOKUP, 1)
    reporter.report()
    reporter.report()  # nothing new: nothing sent
    assert len(sent) == 1
    assert (sent[0]["lookup_keys"], sent[0]["lookup_hits"], sent[0]["lookup_bucket_0"]) == (3, 3, 1)
    assert counters.snapshot()["usage_reports"] == 1


def test_a_controller_that_takes_no_reports_is_not_asked_again() -> None:
    calls: list[dict[str, int]] = []
    counters = client_counters()

    def send(usage: dict[str, int]) -> bool:
        calls.append(usage)
        return False

    reporter = UsageReporter(send, counters, CallTimes(), interval=0)
    for _ in range(3):
        counters.add("lookup_keys")
        reporter.report()
    assert len(calls) == 1


def test_the_controller_sums_reports_and_ignores_names_it_does_not_know() -> None:
    usage = ClientUsage()
    handler = usage.handlers[MsgType.USAGE]
    for _ in range(2):
        body = write_usage({"lookup_keys": 5, "lookup_hits": 2, "get_bucket_3": 1, "bogus": 9})
        handler(Reader(body))()
    stats = usage.stats()
    assert set(stats) == set(USAGE_NAMES)
    assert (stats["lookup_keys"], stats["lookup_hits"], stats["get_bucket_3"]) == (10, 4, 2)


def test_the_clients_scope_becomes_key_counts_by_outcome_and_cumulative_histograms() -> None:
    usage = ClientUsage()
    usage.handlers[MsgType.USAGE](
        Reader(
            write_usage(
                {
                    "lookup_keys": 10,
                    "lookup_hits": 7,
                    "lookup_bucket_0": 1,
                    "lookup_bucket_2": 2,
                    "lookup_duration_ns": 500_000,
                }
            )
        )
    )()
    found = {m.name: m for m in families({"clients": usage.stats()})}
    lookups = {s.labels["outcome"]: s.value for s in found["kvfabric_client_lookup_keys"].samples}
    assert lookups == {"hit": 7, "miss": 3}
    histogram = found["kvfabric_client_operation_duration_seconds"]
    lookup = {
        s.labels.get("le"): s.value
        for s in histogram.samples
        if s.labels["operation"] == "lookup" and s.name.endswith("_bucket")
    }
    assert (lookup["5e-05"], lookup["0.0001"], lookup["0.00025"], lookup["+Inf"]) == (1, 1, 3, 3)
    total = [s.value for s in histogram.samples if s.name.endswith("_sum")]
    assert total[0] == 0.0005
