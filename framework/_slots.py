"""Setting a frozen attrs class's fields without its constructor.

Decoders build many small frozen objects from bytes whose fields are checked already; the
keyword constructor and its validators cost several microseconds each. A slot's own
setter does what ``object.__setattr__`` does on a frozen class, less its lookup by name
(~1.2 us a descriptor against ~1.8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["slot_setters"]


def slot_setters(cls: type, *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """The setters of ``cls``'s slots ``names``, in that order (``setter(obj, value)``)."""
    return tuple(cls.__dict__[name].__set__ for name in names)
