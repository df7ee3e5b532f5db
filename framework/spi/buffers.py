"""Buffer helpers for the data path: flat byte views, addresses, and copies without the GIL.

A memoryview slice assignment copies while holding the GIL; ``ctypes.memmove`` is a foreign
call, so ctypes releases the GIL around it. Large copies go through it so other Python
threads (the engine's event loop) keep running while bytes move.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["GIL_FREE_COPY_MIN", "address_of", "byte_view", "copy_into", "writable_view"]

# Below this, the cost of taking an address exceeds the cost of holding the GIL.
GIL_FREE_COPY_MIN = 64 * 1024


def byte_view(obj: Any) -> memoryview:
    """A flat, C-contiguous ``'B'`` view of any buffer (bytes, bytearray, mmap, numpy, ...)."""
    view = obj if isinstance(obj, memoryview) else memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def writable_view(obj: Any) -> memoryview:
    """Like :func:`byte_view`, and refuses read-only buffers."""
    view = byte_view(obj)
    if view.readonly:
        raise ValueError("buffer is read-only; pass a writable buffer (bytearray, numpy, ...)")
    return view


def address_of(view: memoryview) -> int:
    """The address of the first byte of a flat view (read-only views included)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def copy_into(dest: memoryview, src: memoryview) -> None:
    """Copy ``src`` into the start of ``dest`` (flat views, ``len(dest) >= len(src)``).

    A read-only ``dest`` is refused: ``ctypes.memmove`` would write through it regardless
    (into a ``bytes`` object, say).
    """
    if dest.readonly:
        raise ValueError("destination is read-only")
    n = src.nbytes
    if n > dest.nbytes:
        raise ValueError(f"destination holds {dest.nbytes} bytes, source has {n}")
    if n >= GIL_FREE_COPY_MIN:
        ctypes.memmove(address_of(dest), address_of(src), n)
    else:
        dest[:n] = src
