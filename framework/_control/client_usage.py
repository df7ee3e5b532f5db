"""The fleet's usage: what every client reported it counted, added up by the controller.

Clients send the difference of their counts since their last report (``USAGE``, see
:mod:`kvfabric._wire.usage`): keys looked up, read and written by outcome, payload bytes,
and each operation's latency histogram. The controller adds them into one set of totals,
labelled by nothing per client (a fleet of any size and churn costs a fixed few hundred
counters), and reports them as the ``clients`` scope of its stats: the fleet's hit rate even
though lookups from the lookup image never reach it. Totals start at 0 when the controller
starts, as every counter does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvfabric._control.refusal import Handler
from kvfabric._runtime.codec import Reader
from kvfabric._wire.protocol import MsgType
from kvfabric._wire.usage import USAGE_NAMES, read_usage

__all__ = ["ClientUsage"]


class ClientUsage:
    """The clients' reported counts, summed; ``handlers`` serve their ``USAGE`` reports."""

    def __init__(self) -> None:
        self._totals = dict.fromkeys(USAGE_NAMES, 0)
        self.handlers: dict[int, Handler] = {MsgType.USAGE: self._usage}

    def stats(self) -> dict[str, int]:
        """Every counter clients report, 0 where none reported it yet."""
        return dict(self._totals)

    def _usage(self, r: Reader) -> Callable[[], bytes]:
        usage = read_usage(r)

        def apply() -> bytes:
            totals = self._totals
            for name, value in usage.items():
                totals[name] += value
            return b""

        return apply
