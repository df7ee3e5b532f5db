"""``ucp_wait``, the native loop the ``ucx`` client waits in, driven by stand-in libucp
functions (ctypes callbacks: no UCX needed): what it owes a put whatever way the wait goes.

A put's CRCs are taken by the wait (of the sources, while the posted puts move) and become
the records' headers and published checksums. A small batch tries one round first, holding
the GIL, if the worker's mutex is free at once; when another thread holds it (a batch for
another node progressing), the try does not run and the wait proper must take them. It did
not: the CRCs came back as zeros, and every record of that batch failed validation when
read (a miss, and the record dropped).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator

import crc32c
import pytest

from kvfabric._runtime import native

_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p)
_CHECK = ctypes.CFUNCTYPE(ctypes.c_int8, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_ARM = ctypes.CFUNCTYPE(ctypes.c_int8, ctypes.c_void_p)

# Stand-ins: nothing to progress, every request complete (UCS_OK), nothing to free; never
# armed (the wait would sleep on the fd).
_FNS = (
    _PROGRESS(lambda worker: 0),
    _CHECK(lambda request: 0),
    _FREE(lambda request: None),
    _ARM(lambda worker: -15),  # UCS_ERR_BUSY
)


def _addresses() -> list[int]:
    return [ctypes.cast(fn, ctypes.c_void_p).value or 0 for fn in _FNS]


@pytest.fixture
def efd() -> Iterator[int]:
    read_end, write_end = os.pipe()
    yield read_end
    os.close(read_end)
    os.close(write_end)


def _put_wait(mutex: native.Mutex, efd: int, sources: list[bytes]) -> list[int]:
    status, pending, crcs = native.ucp_wait(
        _addresses(),
        1,
        efd,
        [1],  # one request in flight: complete at the first check
        mutex,
        None,
        spins=1,
        idle_ms=1,
        crc_buffers=sources,
        crc_spans=[(i, i + 1) for i in range(len(sources))],
        crc_first=True,
        try_first=True,
    )
    assert (status, pending) == (0, [])
    return crcs


def test_a_put_whose_try_runs_returns_the_sources_crcs(efd: int) -> None:
    sources = [os.urandom(5000) for _ in range(4)]
    assert _put_wait(native.Mutex(), efd, sources) == [crc32c.crc32c(s) for s in sources]


def test_a_put_whose_try_finds_the_mutex_taken_still_returns_the_sources_crcs(
    efd: int,
) -> None:
    sources = [os.urandom(5000) for _ in range(4)]
    mutex = native.Mutex()
    calling = threading.Event()
    result: list[list[int]] = []

    def put() -> None:
        calling.set()
        result.append(_put_wait(mutex, efd, sources))

    # The holder gives the mutex back only once the put's thread released the GIL, which
    # it does inside the wait, after its try found the mutex taken: with a long switch
    # interval nothing else hands the GIL over between ``calling.set()`` and the wait.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        with mutex:
            putter = threading.Thread(target=put)
            putter.start()
            calling.wait()
        putter.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not putter.is_alive()
    assert result == [[crc32c.crc32c(s) for s in sources]]
