"""Index calls under the read contract: each one counted, a failure counted and made a miss.

Every round trip the store makes to its index (a controller, or a shared index such as
Redis) goes through :class:`IndexCalls`, so ``control_rpcs`` counts them all and the read
contract holds in one place: an index that does not answer in time is
``controller_unavailable``, an error or malformed reply is ``controller_errors``; both are
logged (a line a minute per kind, then with a count of those not logged) and give
``None``, which the callers turn into misses (0, False, None, ``FAILED``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvfabric._runtime.log_limit import LimitedLog
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ControllerUnavailableError, ProtocolError, RemoteError
from kvfabric.spi.counters import Counters
from kvfabric.spi.index import Copies, Index

__all__ = ["IndexCalls"]

log = logging.getLogger("kvfabric")
T = TypeVar("T")


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

    def resolve(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """Each key's descriptor; all None when the index could not answer."""
        found = self.ask(self.index.resolve, keys)
        return [None] * len(keys) if found is None else found

    def resolve_copies(self, keys: Sequence[bytes]) -> Copies:
        """Each key's descriptor and its other copies; no copies when the index could not
        answer."""
        found = self.ask(self.index.resolve_copies, keys)
        return Copies(descriptors=[None] * len(keys)) if found is None else found
