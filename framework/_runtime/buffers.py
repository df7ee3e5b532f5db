"""Buffer helpers for the data path: flat byte views, addresses, copies without the GIL, and
memory made ready before its first use.

A memoryview slice assignment copies while holding the GIL; ``ctypes.memmove`` is a foreign
call, so ctypes releases the GIL around it. Large copies go through it so other Python
threads (the engine's event loop) keep running while bytes move. (Batches of copies go
through ``kvfabric._runtime.native.copy_many``, which releases it once for all of them.)
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvfabric._runtime import native
from kvfabric._runtime.cpus import usable_cpus

__all__ = [
    "GIL_FREE_COPY_MIN",
    "address_of",
    "byte_view",
    "copy_into",
    "prefault_all",
    "writable_view",
]

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


# Prefaulting works in pieces this size, spread over threads: the kernel zeroes (or reads)
# each page it allocates, which one CPU does at a few GB/s.
_PREFAULT_PIECE = 64 << 20
_PREFAULT_THREADS = 8


def prefault_all(
    views: Sequence[memoryview],
    *,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> float:
    """Fault in every page of ``views`` for writing, several threads at once; returns the
    seconds it took. ``progress`` is told the bytes of each piece done (e.g.
    :meth:`kvfabric._runtime.step_log.StepLog.advance`, so a long start logs how far it got).

    What a data node does to its regions at start (as registering memory for RDMA would):
    the first write into a fresh page otherwise traps per 4 KiB page, which makes the first
    puts into a fresh node much slower than later ones. Each
    piece releases the GIL (:func:`kvfabric._runtime.native.prefault`). ``threads``: at most this
    many (default: the CPUs this process may use, its cgroups' CPU quota included, up to 8:
    :func:`kvfabric._runtime.cpus.usable_cpus`; a container limited to 2 CPUs on a large host
    gains nothing from 8 threads queued on them).
    """
    started = time.monotonic()
    pieces = [
        view[at : at + _PREFAULT_PIECE]
        for view in views
        for at in range(0, view.nbytes, _PREFAULT_PIECE)
    ]
    workers = min(len(pieces), threads or min(usable_cpus(), _PREFAULT_THREADS))
    if workers <= 1:
        for piece in pieces:
            native.prefault(piece)
            if progress is not None:
                progress(piece.nbytes)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="kvfabric-prefault") as pool:
            for piece, _ in zip(pieces, pool.map(native.prefault, pieces), strict=True):
                if progress is not None:
                    progress(piece.nbytes)
    for piece in pieces:
        piece.release()
    return time.monotonic() - started
