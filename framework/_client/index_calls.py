"""Index calls under the read contract: each one counted, a failure counted and made a miss.

Every round trip the store makes to its index (a controller, or a shared index such as
Redis) goes through :class:`IndexCalls`, so ``control_rpcs`` counts them all and the read
contract holds in one place: an index that does not answer in time is
``controller_unavailable``, an error or malformed reply is ``controller_errors``; both are
logged (a line a minute per kind, then with a count of those not logged) and give
``None``, which the callers turn into misses (0, False, None, ``FAILED``).

A publish is asked with :meth:`IndexCalls.publish`: where the index could tell of some of its
items and not of others (a controller that answered part of a large publish, then neither
the rest nor the question what became of it), the known outcomes stand and the others are
None, so the writer reports ``FAILED`` only for those and wipes their records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from kvfabric._control.remote_writes import OutcomeUnknownError
from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ControllerUnavailableError, ProtocolError, RemoteError
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import Copies, Index

__all__ = ["IndexCalls", "Outcomes"]

log = logging.getLogger("kvfabric")
T = TypeVar("T")


@attrs.frozen
class Outcomes:
    """A publish's outcomes as far as the index told: None where it could not say."""

    values: list[Any]
    held: bool
    """Whether the writer still holds what the unknown ones were written into (nothing of
    it was given back): only then may it wipe their records."""


class IndexCalls:
    """One store's round trips to its index, counted; thread-safe."""

    def __init__(self, index: Index, counters: Counters) -> None:
        self.index = index
        self._counters = counters
        # One line a minute per kind of failure, however many calls fail meanwhile.
        self._limited = LimitedLog(log)

    def ask(self, method: Callable[..., T], *args: Any) -> T | None:
        """One index call, counted; a failure of the index is counted, logged and gives
        None."""
        self._counters.add("control_rpcs")
        try:
            return method(*args)
        except ControllerUnavailableError as exc:
            self._counters.add("controller_unavailable")
            self._limited.warning(
                "unavailable", "kvfabric: index unavailable (%s): treating as a miss", exc
            )
        except (RemoteError, ProtocolError) as exc:
            self._counters.add("controller_errors")
            self._limited.warning("error", "kvfabric: index error (%s): treating as a miss", exc)
        return None

    def publish(self, method: Callable[..., Sequence[Any]], *args: Any) -> Outcomes | None:
        """A publish (``method``: ``publish`` or ``publish_carved``), counted as :meth:`ask`;
        None where it failed as a whole (nothing was published)."""
        self._counters.add("control_rpcs")
        try:
            return Outcomes(list(method(*args)), held=False)
        except OutcomeUnknownError as exc:
            unknown = sum(value is None for value in exc.outcomes)
            self._counters.update(controller_unavailable=1, outcomes_unknown=unknown)
            self._limited.warning(
                "unknown",
                "kvfabric: index unavailable (%s): %d of %d records reported not stored",
                exc,
                unknown,
                len(exc.outcomes),
            )
            return Outcomes(exc.outcomes, held=exc.held)
        except ControllerUnavailableError as exc:
            self._counters.add("controller_unavailable")
            self._limited.warning(
                "unavailable", "kvfabric: index unavailable (%s): treating as a miss", exc
            )
        except (RemoteError, ProtocolError) as exc:
            self._counters.add("controller_errors")
            self._limited.warning("error", "kvfabric: index error (%s): treating as a miss", exc)
        return None

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Each key's descriptor; all None when the index could not answer."""
        found = self.ask(self.index.resolve, keys)
        return [None] * len(keys) if found is None else found

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        """Each key's descriptor and its other copies; no copies when the index could not
        answer."""
        found = self.ask(self.index.resolve_copies, keys)
        return Copies(descriptors=[None] * len(keys)) if found is None else found
