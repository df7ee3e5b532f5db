"""The one place native exceptions become kvfabric's: :func:`map_exceptions` (httpcore style).

A transport wraps each I/O boundary in ``with map_exceptions({native: ours}, where=...)``
instead of writing its own ``except`` ladder; :class:`~kvfabric.spi.PeerClient` does this
around every primitive it calls, with the mapping the client declares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

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


@contextlib.contextmanager
def map_exceptions(mapping: ExceptionMapping, *, where: str = "") -> Iterator[None]:
    """Re-raise an exception of a mapped native class as its kvfabric class (``from`` it).

    ``mapping`` is searched in order, so a subclass must come before its base. An exception
    that already is what its first match would make passes unchanged (``TransportError`` is
    itself an ``OSError``); an unmapped one passes unchanged too. ``where`` prefixes the
    message (e.g. ``"tcp: node 3 at 10.0.0.7:4100"``).
    """
    try:
        yield
    except Exception as exc:
        for native, ours in mapping.items():
            if isinstance(exc, native):
                if isinstance(exc, ours):
                    raise
                text = str(exc) or type(exc).__name__
                raise ours(f"{where}: {text}" if where else text) from exc
        raise
