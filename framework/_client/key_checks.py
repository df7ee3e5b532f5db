"""The check every client call makes of its keys: a bad key is a programming error, raised."""

from __future__ import annotations

from collections.abc import Sequence

from kvfabric._runtime.image import first_bad_key
from kvfabric.errors import InvalidKeyError
from kvfabric.keys import KEY_SIZE

__all__ = ["check_keys"]


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise :class:`InvalidKeyError` naming the first key that is not 32 bytes."""
    bad = first_bad_key(keys)
    if bad >= 0:
        key = keys[bad]
        raise InvalidKeyError(
            f"keys must be {KEY_SIZE}-byte bytes (see kvfabric.chain_key / fold_key), "
            f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
        )
