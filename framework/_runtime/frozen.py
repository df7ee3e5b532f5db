"""Setting the fields of a frozen attrs class without its constructor.

Decoders build many small frozen objects from bytes whose fields are checked already, and
the keyword constructor with its validators costs several microseconds each. A slot's own
setter does what ``object.__setattr__`` does on a frozen class, without looking the field
up by name on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["field_setters"]


def field_setters(cls: type, *names: str) -> tuple[Callable[[Any, Any], None], ...]:
    """The setters of ``cls``'s slotted fields ``names``, in that order (``setter(obj,
    value)``); they bypass the frozen check and the validators, so callers pass only values
    checked already."""
    return tuple(cls.__dict__[name].__set__ for name in names)
