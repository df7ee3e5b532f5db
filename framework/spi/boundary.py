"""The one place native exceptions become kvfabric's: :func:`map_exceptions` (httpcore style).

A transport wraps each I/O boundary in ``with map_exceptions({native: ours}, where=...)``
instead of writing its own ``except`` ladder; :class:`~kvfabric.spi.PeerClient` does this
around every primitive it calls, with the mapping the client declares.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from kvfabric.errors import KvfabricError, TransportError, TransportTimeoutError

__all__ = ["SOCKET_ERRORS", "ExceptionMapping", "map_exceptions"]

ExceptionMapping = Mapping[type[BaseException], type[KvfabricError]]
"""Native exception class → the kvfabric class it becomes; the first match wins."""

SOCKET_ERRORS: ExceptionMapping = {
    # TimeoutError (socket.timeout) is an OSError: it must come first.
    TimeoutError: TransportTimeoutError,
    OSError: TransportError,
}
"""What a socket-based transport's calls raise, mapped."""


class map_exceptions:  # lower case: used like contextlib's managers
    """Re-raise an exception of a mapped native class as its kvfabric class (``from`` it).

    ``with map_exceptions({native: ours}, where=...):`` around an I/O boundary. ``mapping``
    is searched in order, so a subclass must come before its base. An exception that
    already is what its first match would make passes unchanged (``TransportError`` is
    itself an ``OSError``); an unmapped one passes unchanged too. ``where`` prefixes the
    message (e.g. ``"tcp: node 3 at 10.0.0.7:4100"``).

    A class rather than a ``@contextmanager`` generator: it wraps every batch a transport
    moves, and entering it should cost next to nothing.
    """

    __slots__ = ("mapping", "where")

    def __init__(self, mapping: ExceptionMapping, *, where: str = "") -> None:
        self.mapping = mapping
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        for native, ours in self.mapping.items():
            if isinstance(exc, native):
                if isinstance(exc, ours):
                    return
                text = str(exc) or type(exc).__name__
                raise ours(f"{self.where}: {text}" if self.where else text) from exc
