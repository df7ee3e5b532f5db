"""The data path's native loops: whole batches of CRC32C, copies and socket I/O per GIL release.

Releasing the GIL while bytes move is not enough: every time a thread takes the GIL back
while another Python thread is busy, it waits out the interpreter's switch interval (5 ms
by default). A read that took it back per segment, per receive and per CRC piece would
wait out that interval at each of them beside one busy thread. Each function here takes
all of its Python
objects while holding the GIL, checks every one of them (a refused batch moves nothing),
releases the GIL once for the whole batch and takes it back once at the end. The only
other returns are to run signal handlers when a signal interrupts a socket wait, so Ctrl-C
still works; :func:`gil_reacquisitions` counts every return, for tests.

Batches of CRC32C and copies smaller than :data:`GIL_RELEASE_MIN` bytes keep the GIL: that
work (tens of microseconds) costs a busy neighbour less than the switch interval the call
would wait out to get it back. Socket calls of that size first move what they can without
waiting while they hold the GIL (a send that fits the socket buffer, bytes that already
arrived), and release it at their first wait; larger ones release it at once. So a call
takes the GIL back at most once, and not at all when it has nothing to wait for and
little to move.

The loops are C (``framework/_runtime/csrc``: plain C API with ``Py_buffer``, which pins and
exposes any buffer — bytes, bytearray, mmap, numpy, memoryview — and needs no run-time
dependency, unlike cffi) built by setuptools at install. There is no pure-Python fallback:
an install from source needs a C compiler and Python's headers, and without the built module
this import fails loudly. CRC32C takes the fastest pass the CPU runs, chosen at run time
(:data:`CRC32C_PASS`): carry-less multiplication folding 128-bit lanes (AVX2 and
VPCLMULQDQ), the CRC32 instruction three streams at a time (SSE4.2), or a portable table,
with the same results as the ``crc32c`` package.

Buffers must be C-contiguous (``BufferError`` otherwise); destinations must be writable
(``BufferError``). Each function names the argument and index of a bad item in its error.
Nothing else may resize or free a buffer for the length of a call, and the caller keeps a
socket open for the length of a call on it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

try:
    from kvfabric._runtime import _native
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "kvfabric's native module (kvfabric._runtime._native) is not built: reinstall kvfabric "
        "from source with a C compiler and Python's headers present (pip install .)"
    ) from exc

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike, ReadableBuffer, WriteableBuffer

    from kvfabric._runtime._native import LaneArgs

__all__ = [
    "CRC32C_PASS",
    "CRC32C_PASSES",
    "GIL_RELEASE_MIN",
    "IOV_MAX",
    "SERVE_COUNTERS",
    "SERVE_MAX_COUNT",
    "Mutex",
    "PeerClosed",
    "ServeEnd",
    "copy_crc32c_with",
    "copy_many",
    "crc32c",
    "crc32c_many",
    "crc32c_with",
    "gil_handoffs",
    "gil_reacquisitions",
    "pack_headers",
    "parallel_copies",
    "prefault",
    "recv_into_all",
    "request_reply",
    "request_reply_lanes",
    "send_all",
    "send_checksummed",
    "serve_reads",
    "ucp_post",
    "ucp_wait",
]

GIL_RELEASE_MIN: int = _native.GIL_RELEASE_MIN
"""CRC32C and copy batches of at least this many bytes release the GIL (256 KiB)."""
IOV_MAX: int = _native.IOV_MAX
"""Buffers per ``sendmsg``/``recvmsg`` call (the system's IOV_MAX)."""
CRC32C_PASS: str = _native.CRC32C_PASS
"""The pass :func:`crc32c`, :func:`copy_many` and the socket loops take, the fastest this CPU
runs: ``"fold"`` (carry-less products folding 128-bit lanes, copies storing 32 bytes at a
time: AVX2 with VPCLMULQDQ, Intel since Ice Lake, AMD since Zen 3), ``"wide"`` (the CRC32
instruction, three streams; copies storing 32 bytes at a time: AVX2), ``"narrow"`` (the same
with 8-byte stores: SSE4.2) or ``"table"`` (portable, slicing by 8; a copy is memcpy and then
the table over the bytes that landed)."""
CRC32C_PASSES: tuple[str, ...] = _native.CRC32C_PASSES
"""Every pass this CPU runs, slowest first, ending with :data:`CRC32C_PASS`."""

PeerClosed = _native.PeerClosed
"""A ``ConnectionError``: the peer closed the stream before every byte arrived.

Its ``received`` attribute is how many bytes this call received before the end.
"""

Mutex = _native.Mutex
"""A mutex that Python code takes as a context manager (releasing the GIL only when it has
to wait) and that :func:`ucp_wait` takes and gives back without the GIL, between its
progress rounds. (A ``threading.Lock`` cannot be taken outside the interpreter.) It does
not know its owner: only the holder may release it."""

# A span is a (start, stop) range of buffer indices whose bytes make one CRC32C.
Spans = Sequence[tuple[int, int]]


def crc32c(data: ReadableBuffer, value: int = 0) -> int:
    """CRC32C of one buffer, continuing from ``value`` (``crc32c(b, crc32c(a))`` is a + b)."""
    return _native.crc32c(data, value)


def crc32c_with(pass_name: str, data: ReadableBuffer, value: int = 0) -> int:
    """:func:`crc32c` through one of :data:`CRC32C_PASSES` (``ValueError`` for another).

    What a CPU with fewer features runs, here so that every pass this machine can run is
    checked on it.
    """
    return _native.crc32c_with(pass_name, data, value)


def copy_crc32c_with(
    pass_name: str, dest: WriteableBuffer, src: ReadableBuffer, value: int = 0
) -> int:
    """One copy and its CRC32C through one of :data:`CRC32C_PASSES` (keeps the GIL).

    What :func:`copy_many` runs on a CPU with fewer features; here so that every pass this
    machine can run is checked on it.
    """
    return _native.copy_crc32c_with(pass_name, dest, src, value)


def pack_headers(
    keys: Sequence[bytes], versions: Sequence[int], lengths: Sequence[int], crcs: Sequence[int]
) -> bytes:
    """Record headers (:func:`kvfabric._runtime.record.pack_header` each), back to back."""
    return _native.pack_headers(keys, versions, lengths, crcs)


def crc32c_many(
    values: Sequence[ReadableBuffer | Sequence[ReadableBuffer]],
    initial: Sequence[int] | None = None,
) -> list[int]:
    """One CRC32C per value: a buffer, or a sequence of pieces taken in order.

    ``initial``: per value, a CRC to continue from (default 0). Equal to
    ``kvfabric._runtime.record.checksum_pieces`` of each value, bit for bit.
    """
    return _native.crc32c_many(values, initial)


def copy_many(
    pairs: Sequence[tuple[WriteableBuffer, ReadableBuffer]],
    crc_spans: Spans | None = None,
    *,
    crc_of_source: bool = False,
    threads: int = 1,
) -> list[int]:
    """Copy each ``(dest, src)``: all of ``src`` into the start of ``dest``.

    Every ``dest`` is checked to be writable and to hold its ``src`` before any byte moves
    (``BufferError`` / ``ValueError`` otherwise). ``crc_spans``: ``(start, stop)`` ranges
    of pair indices, in order and not overlapping; returns the CRC32C of each span, or ``[]``
    without spans. With the CPU's CRC32 instruction each word is checksummed as it is
    stored, in one pass at about the copy's own speed: the CRC is of exactly the bytes that
    landed, which are exactly the bytes this caller stored. So a read whose source changes
    under the copy fails its check instead of passing unseen, and a write into memory others
    may write too vouches only for what this caller meant to store. Where the bytes take
    two passes (the portable table; a pair whose source and destination overlap), the
    default reads the CRC back from the destination (a read) and ``crc_of_source`` takes it
    from the source just before the copy (a write). With the ``"fold"`` pass
    (:data:`CRC32C_PASS`) the CRC adds nothing to the copy's time: a copy with its checksum
    runs as fast as a plain one, where the CRC32 instruction's passes (``"wide"``, 32-byte
    stores; ``"narrow"``) fall short of it. A pair of 1 MiB or more is stored
    non-temporally (no read of each destination line first, no cache filled with it) where
    its destination is placed so that this cannot stall the loads (see ``copy_crc32c_wide``
    and ``streams_well`` in ``csrc/crc32c.c``). The stores of a call are ordered before
    those of any later call (a store fence ends a non-temporal copy), so a writer that
    copies payloads first and their headers in a second call lands them in that order.

    A batch of 8 MiB or more ends on a helper thread: once what is left should take no
    longer than the interpreter's switch interval, a helper copies the rest while this
    thread takes the GIL back, so the wait for the GIL beside a busy Python thread (about
    one switch interval) overlaps the copy instead of following it, and a large read beside
    a busy thread keeps most of the rate it has alone (:func:`gil_handoffs` counts these).

    ``threads`` > 1: a batch of 32 MiB or more is cut at span boundaries into that many parts
    of about equal bytes, copied at once on as many threads (this one among them), for
    hosts where one core's copy is slower than the memory it reads (:func:`parallel_copies`
    counts these; such a batch is not handed over as above).
    """
    return _native.copy_many(pairs, crc_spans, crc_of_source, threads)


def prefault(buffer: ReadableBuffer, *, write: bool = True, force_touch: bool = False) -> bool:
    """Fault in every page of ``buffer`` now, so the first real access does not trap.

    The kernel populates the page tables (``madvise(MADV_POPULATE_WRITE)``, or ``_READ``
    with ``write=False``; Linux 5.14+) as a write or read would, allocating what is not
    allocated yet. Where it cannot (an older kernel, or ``force_touch``), each page is
    touched instead: read, or for a write an atomic add of zero, which never loses a
    concurrent writer's store. Returns True when the kernel did it. ``write`` needs a
    writable buffer. Every byte must be backed (a file mapping past the file's end would
    fault). Releases the GIL for 256 KiB and more; ``OSError`` when the kernel refuses
    (``ENOMEM``: not enough memory).
    """
    return _native.prefault(buffer, write, force_touch)


def send_all(
    fd: FileDescriptorLike, buffers: Sequence[ReadableBuffer], deadline: float | None
) -> int:
    """Send every buffer in order on a connected stream socket; returns the bytes sent.

    Gathers up to :data:`IOV_MAX` buffers per ``sendmsg`` and resumes partial sends. Works on
    blocking and non-blocking sockets alike (each call is non-blocking; ``poll`` waits).
    ``deadline`` (``time.monotonic()``, None for none) bounds the waits: ``TimeoutError``
    when the socket is not ready in time. A reset or closed peer raises the fitting
    ``ConnectionError`` (``BrokenPipeError``, ``ConnectionResetError``); any other failure
    an ``OSError`` with its errno. Messages say how many bytes went before the failure.
    """
    return _native.send_all(fd, buffers, deadline)


def send_checksummed(
    fd: FileDescriptorLike,
    buffers: Sequence[ReadableBuffer],
    deadline: float | None,
    crc_spans: Spans,
) -> list[int]:
    """:func:`send_all`, returning the CRC32C of each ``crc_spans`` range of ``buffers``.

    Spans as in :func:`copy_many`. The send goes in windows of 256 KiB, each checksummed
    right after the kernel copied it out, so the CRC reads the bytes from cache rather than
    making a pass of its own over memory. The bytes are the caller's, read twice (the copy,
    then the CRC): a caller that changes them meanwhile gets a CRC that its reader refuses.
    """
    return _native.send_checksummed(fd, buffers, deadline, crc_spans)


SERVE_MAX_COUNT = 256
"""READ frames of up to this many entries are served by :func:`serve_reads` in C."""
SERVE_COUNTERS = ("frames", "requests", "segments_read", "bytes_read", "refused_segments")
"""What :func:`serve_reads` counts, in the order of its ``counters`` buffer."""


class ServeEnd(enum.IntEnum):
    """Why :func:`serve_reads` returned."""

    CLOSED = 0
    """The peer closed, or the socket was woken (shut down), between frames."""
    IDLE = 1
    """No frame began within ``idle_timeout``."""
    HANDOFF = 2
    """A frame for the caller (not a READ of at most SERVE_MAX_COUNT entries, or
    malformed): its header is in ``header``, nothing after it was read."""
    STALLED = 3
    """A frame did not complete within ``frame_timeout`` of its first byte."""
    ERRNO = 4
    """A socket call failed (the errno comes with it)."""
    TOO_LARGE = 5
    """A READ whose entries add up to more than ``max_batch_bytes``: refuse it."""
    TRUNCATED = 6
    """The peer closed in the middle of a frame."""


def serve_reads(
    fd: FileDescriptorLike,
    regions: Sequence[tuple[int, int, ReadableBuffer, int]],
    counters: WriteableBuffer,
    idle_since: WriteableBuffer,
    header: WriteableBuffer,
    *,
    idle_timeout: float,
    frame_timeout: float,
    max_batch_bytes: int,
    busy_poll: float = 0.0,
) -> tuple[ServeEnd, int]:
    """Serve a tcp node's connection in C, READ frame after READ frame, until Python is
    needed; returns why, and the errno for :attr:`ServeEnd.ERRNO`.

    ``regions``: ``(id, rkey, memory, size)`` each. Each frame's entries are checked as
    :func:`kvfabric.spi.segments.segment_status` does, ``counters`` (``len(SERVE_COUNTERS)``
    8-aligned u64) bumped atomically before the reply, and the reply and the accepted bytes
    go in one gather. ``idle_since`` (one 8-aligned i64) holds ``time.monotonic()`` in ns
    while it waits for a frame, 0 within one. The GIL is released for the whole call: a
    connection's lookups cost the serving process no Python at all. ``busy_poll``: after
    each frame, spin this long for the next before sleeping (as :func:`request_reply`).
    """
    end, err = _native.serve_reads(
        fd,
        regions,
        counters,
        idle_since,
        header,
        idle_timeout,
        frame_timeout,
        max_batch_bytes,
        busy_poll,
    )
    return ServeEnd(end), err


def recv_into_all(
    fd: FileDescriptorLike,
    buffers: Sequence[WriteableBuffer],
    deadline: float | None,
    crc_spans: Spans | None = None,
) -> list[int]:
    """Fill every buffer, in order, from a connected stream socket.

    Scatters into up to :data:`IOV_MAX` buffers per ``recvmsg``. ``crc_spans`` as in
    :func:`copy_many`: the CRC32C of each span is taken as its bytes arrive (the receive
    then goes in windows of 256 KiB, so they are still in cache); returns those CRCs, or
    ``[]``. The end of the stream before the last byte raises :class:`PeerClosed`; the
    deadline and other failures as in :func:`send_all`.
    """
    return _native.recv_into_all(fd, buffers, deadline, crc_spans)


def request_reply(
    fd: FileDescriptorLike,
    request: Sequence[ReadableBuffer],
    reply: WriteableBuffer,
    payloads: Sequence[WriteableBuffer],
    deadline: float | None,
    *,
    status_offset: int = 0,
    crc_spans: Spans | None = None,
    busy_poll: float = 0.0,
    hold_gil: float = 0.0,
) -> list[int]:
    """One request and its reply in one GIL release: send, fill ``reply``, then the payloads.

    Sends the ``request`` buffers (as :func:`send_all`), fills ``reply`` exactly, then fills
    each payload ``i`` whose status byte ``reply[status_offset + i]`` is 0; the others are
    skipped (the peer sends nothing for them). ``crc_spans`` range over ``payloads`` as in
    :func:`recv_into_all`; a skipped payload adds nothing to its span. Returns the CRCs, or
    ``[]``. Errors as in :func:`recv_into_all`; a peer that answers with less than a whole
    ``reply`` and closes raises :class:`PeerClosed` with ``received`` bytes of ``reply``
    filled, so the caller can read an error reply shorter than a full one. Every check of
    the arguments comes before the first byte is sent.

    ``busy_poll`` (seconds, at most 1): while the reply has not begun to arrive, retry the
    receive this long before sleeping in ``poll()``, the GIL released. Waking a sleeping
    thread costs more than a small reply's whole round trip over loopback on an idle host;
    a spin costs at most ``busy_poll`` of one CPU per call.

    ``hold_gil`` (seconds, at most 0.001): a call smaller than :data:`GIL_RELEASE_MIN`
    waits this long in all for its socket with the GIL held, and releases it only past
    that. Beside a busy Python thread, taking the GIL back costs about one switch interval
    (5 ms); a reply that comes within the hold costs no return of the GIL at all, and the
    other threads wait at most ``hold_gil`` for it.
    """
    return _native.request_reply(
        fd, request, reply, payloads, deadline, status_offset, crc_spans, busy_poll, hold_gil
    )


def request_reply_lanes(
    lanes: Sequence[LaneArgs],
    deadline: float | None,
    *,
    busy_poll: float = 0.0,
) -> list[list[int]]:
    """:func:`request_reply` on several sockets at once, in one GIL release.

    Each lane is ``(fd, request, reply, payloads, status_offset, crc_spans)``, on a socket
    of its own (at most 8 lanes). The calling thread runs the first lane and a helper
    thread each other (started with every signal blocked; a lane whose thread cannot start
    runs after the first, on the calling thread). Returns each lane's CRCs. If any lane
    fails, raises the error of the first that failed, in lane order; when the first lane
    fails, the others' sockets are shut down so the call returns at once: the caller must
    close every lane's connection after an error. The GIL is taken back once (and once
    per signal that interrupts the first lane's waits).
    """
    return _native.request_reply_lanes(lanes, deadline, busy_poll)


def gil_reacquisitions() -> int:
    """How many times this module's calls took the GIL back, in the calling thread.

    One per call that released it (a batch of at least :data:`GIL_RELEASE_MIN` bytes, a
    socket call that large or that had to wait), plus one per signal that interrupted a
    socket wait.
    """
    return _native.gil_reacquisitions()


def parallel_copies() -> int:
    """:func:`copy_many` batches this thread ran on several threads at once."""
    return _native.parallel_copies()


def gil_handoffs() -> int:
    """How many batches the calling thread ended on a helper thread while it took the GIL
    back: :func:`copy_many` batches of at least 8 MiB, and the CRC pass of a ucx get
    (``ucp_wait``) as large, once what was left would take no longer than the switch
    interval (see :func:`copy_many`)."""
    return _native.gil_handoffs()


def ucp_post(
    rma: int,
    flush: int,
    ep: int,
    param: int,
    buffers: Sequence[ReadableBuffer],
    remote: Sequence[tuple[int, int]],
    *,
    put: bool,
) -> tuple[int, list[int]]:
    """Post one libucp get or put per buffer (and, after puts, a flush of the endpoint).

    For transports over libucp, loaded by the transport: ``rma`` is the address of
    ``ucp_get_nbx`` (``put=False``: buffers are written) or ``ucp_put_nbx``, ``flush`` of
    ``ucp_ep_flush_nbx``; ``ep`` and ``param`` (a ``ucp_request_param_t``) are addresses;
    ``remote`` is one ``(remote address, ucp_rkey_h address)`` per buffer. Keeps the GIL
    (posting does not wait). Returns the first failing status (0: all posted) and the
    requests in flight, as addresses, which the caller completes (:func:`ucp_wait`) or
    cancels; the buffers must outlive them.
    """
    return _native.ucp_post(rma, flush, ep, param, buffers, remote, put)


def ucp_wait(
    fns: Sequence[int],
    worker: int,
    efd: int,
    requests: Sequence[int],
    mutex: Mutex,
    deadline: float | None,
    *,
    spins: int,
    idle_ms: int,
    crc_buffers: Sequence[ReadableBuffer] | None = None,
    crc_spans: Spans | None = None,
    crc_first: bool = False,
    try_first: bool = False,
) -> tuple[int, list[int], list[int]]:
    """Progress a libucp worker until ``requests`` complete, one fails or ``deadline`` passes.

    ``fns``: the addresses of ``ucp_worker_progress``, ``ucp_request_check_status``,
    ``ucp_request_free`` and ``ucp_worker_arm``. Each round takes ``mutex`` (every call on a
    SERIALIZED worker must be made under it), drains progress, checks and frees the
    completed requests, and gives it back; after ``spins`` idle rounds it arms the worker and
    sleeps on ``efd`` for at most ``idle_ms``. The GIL is released once for the whole wait.
    ``crc_spans`` over ``crc_buffers`` (as :func:`copy_many`): their CRC32Cs, taken after
    the requests complete (a read: of what landed), or before the first round with
    ``crc_first`` (a put: of the sources, while posted puts move). Returns the status (0,
    the first failure, or ``ERR_TIMED_OUT``), the requests still in flight (to cancel) and
    the CRCs (``[]`` unless it succeeded). ``try_first`` (a small batch, under
    :data:`GIL_RELEASE_MIN`): one round first with the GIL held, if ``mutex`` is free at
    once; a batch done by then takes the GIL back not at all. A signal does not end the
    wait early; the deadline does.
    """
    return _native.ucp_wait(
        fns,
        worker,
        efd,
        requests,
        mutex,
        deadline,
        spins,
        idle_ms,
        crc_buffers,
        crc_spans,
        crc_first,
        try_first,
    )
