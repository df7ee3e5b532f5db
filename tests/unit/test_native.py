"""kvfabric._runtime.native: the batch CRC32C, copies and socket loops, and their GIL contract.

Real sockets on 127.0.0.1 and socketpairs; the busy thread is a real Python thread. The
GIL contract is asserted as outcomes: a busy thread's counter advanced during a call, and
the exact number of times a call took the GIL back (the module counts them).
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import random
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import crc32c as crc32c_package
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric._runtime import buffers, native
from kvfabric._runtime.record import checksum_pieces
from kvfabric.testing import BusyThread, wait_for

# Around the edges of each pass's loops: 8-byte words, 32-byte registers, 128-byte folds,
# the three streams' 256-byte and 8 KiB blocks.
SIZES = [
    *(0, 1, 7, 8, 9, 31, 32, 63, 64, 127, 128, 129, 160, 191, 255, 256, 319, 320),
    *(511, 512, 513, 575, 767, 768, 769),
    *(8191, 24575, 24576, 24577, 100_003),
]
DATA = np.random.default_rng(12).bytes(1 << 21)


def _crc(data: Any, value: int = 0) -> int:
    return int(crc32c_package.crc32c(data, value))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


# Every pass, each checked where this CPU runs it (a CPU that runs one runs those before it).
PASSES = [
    pytest.param(
        name,
        id=name,
        marks=pytest.mark.skipif(
            name not in native.CRC32C_PASSES, reason=f"this CPU cannot run the {name!r} pass"
        ),
    )
    for name in ("table", "narrow", "wide", "fold")
]


# -- CRC32C -------------------------------------------------------------------------------


def test_the_pass_taken_is_the_fastest_this_cpu_runs() -> None:
    flags = _cpu_flags()
    if {"avx2", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= flags:
        expected = "fold"
    elif {"avx2", "sse4_2"} <= flags:
        expected = "wide"
    elif "sse4_2" in flags:
        expected = "narrow"
    else:
        expected = "table"
    assert expected == native.CRC32C_PASS
    assert native.CRC32C_PASSES[-1] == expected
    with pytest.raises(ValueError, match="no pass 'avx9'"):
        native.crc32c_with("avx9", b"abc")


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("size", SIZES)
def test_crc32c_equals_the_crc32c_package_at_every_alignment_and_continuation(
    pass_name: str, size: int
) -> None:
    for offset in range(9):
        piece = memoryview(DATA)[offset : offset + size]
        for value in (0, 1, 0xFFFFFFFF, 0x12345678):
            expected = _crc(piece, value)
            assert native.crc32c_with(pass_name, piece, value) == expected
            if pass_name == native.CRC32C_PASS:
                assert native.crc32c(piece, value) == expected


@pytest.mark.parametrize("pass_name", PASSES)
def test_crc32c_of_a_large_buffer_equals_the_package(pass_name: str) -> None:
    big = memoryview(DATA)[3:]
    assert native.crc32c_with(pass_name, big) == native.crc32c(big) == _crc(big)


def test_crc32c_continues_across_a_split() -> None:
    a, b = memoryview(DATA)[:100_001], memoryview(DATA)[100_001:300_000]
    assert native.crc32c(b, native.crc32c(a)) == _crc(DATA[:300_000])


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(0, 70_000),
    offset=st.integers(0, 15),
    cuts=st.lists(st.integers(0, 70_000), max_size=6),
    initial=st.integers(0, 0xFFFFFFFF),
)
def test_crc32c_many_equals_checksum_pieces_for_any_split(
    size: int, offset: int, cuts: list[int], initial: int
) -> None:
    data = memoryview(DATA)[offset : offset + size]
    bounds = sorted({0, size, *(c for c in cuts if c <= size)})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    [crc] = native.crc32c_many([pieces])
    assert crc == checksum_pieces(pieces) == _crc(data)
    [continued] = native.crc32c_many([pieces], initial=[initial])
    assert continued == _crc(data, initial)


def test_crc32c_many_takes_a_value_as_one_buffer_or_pieces_of_any_exporter() -> None:
    array = np.frombuffer(DATA[:4096], dtype=np.uint32)
    with mmap.mmap(-1, 4096) as mapped:
        mapped.write(DATA[:4096])
        values: list[Any] = [
            DATA[:4096],
            bytearray(DATA[:4096]),
            array,
            mapped,
            [memoryview(DATA)[:1000], array[250:]],
            [],
        ]
        crcs = native.crc32c_many(values)
        del values
    assert crcs == [_crc(DATA[:4096])] * 5 + [0]


def test_crc32c_many_names_the_bad_item_and_refuses_bad_initial_values() -> None:
    strided = memoryview(bytearray(64))[::2]
    with pytest.raises(BufferError, match="piece 1 of value 1"):
        native.crc32c_many([b"ok", [b"fine", strided]])
    with pytest.raises(TypeError, match="value 0"):
        native.crc32c_many([12])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2 initial values for 1 values"):
        native.crc32c_many([b"x"], initial=[1, 2])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        native.crc32c_many([b"x"], initial=[1 << 32])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        native.crc32c(b"x", -1)


# -- copies -------------------------------------------------------------------------------


def _random_pairs(count: int, seed: int) -> tuple[list[tuple[Any, Any]], list[bytes]]:
    rng = random.Random(seed)
    pairs: list[tuple[Any, Any]] = []
    sources: list[bytes] = []
    for _ in range(count):
        size = rng.choice([0, 1, 63, 64, 4095, 65_536, 65_537, 300_001])
        start = rng.randrange(0, len(DATA) - size)
        src = DATA[start : start + size]
        slack = rng.choice([0, 1, 100])
        pairs.append((bytearray(size + slack), memoryview(DATA)[start : start + size]))
        sources.append(src)
    return pairs, sources


def test_copy_many_lands_every_pair_exactly_and_leaves_the_rest_of_each_destination() -> None:
    pairs, sources = _random_pairs(40, seed=1)
    for dest, _ in pairs:
        dest[:] = b"\xee" * len(dest)
    assert native.copy_many(pairs) == []
    for (dest, _), src in zip(pairs, sources, strict=True):
        assert bytes(dest[: len(src)]) == src
        assert set(dest[len(src) :]) <= {0xEE}


def test_copy_many_with_spans_returns_the_crc_of_what_landed_per_span() -> None:
    pairs, sources = _random_pairs(30, seed=2)
    spans = [(0, 3), (3, 3), (5, 17), (17, 18), (20, 30)]
    crcs = native.copy_many(pairs, crc_spans=spans)
    assert crcs == [_crc(b"".join(sources[a:b])) for a, b in spans]
    for (dest, _), src in zip(pairs, sources, strict=True):
        assert bytes(dest[: len(src)]) == src


def test_copy_many_into_numpy_and_mmap_destinations() -> None:
    out = np.zeros(1 << 20, dtype=np.uint8)
    with mmap.mmap(-1, 1 << 20) as mapped:
        crcs = native.copy_many(
            [(out, DATA[: 1 << 20]), (mapped, DATA[1 << 20 :])], crc_spans=[(0, 2)]
        )
        assert mapped[:] == DATA[1 << 20 :]
    assert out.tobytes() == DATA[: 1 << 20]
    assert crcs == [_crc(DATA)]


@pytest.mark.parametrize("shift", [1000, -1000])
def test_copy_many_within_one_buffer_copies_as_if_through_a_temporary(shift: int) -> None:
    size = 300_000
    buffer = bytearray(DATA[: size + 2000])
    expected = bytearray(buffer)
    src_at, dest_at = 1000, 1000 + shift
    expected[dest_at : dest_at + size] = expected[src_at : src_at + size]
    view = memoryview(buffer)
    [crc] = native.copy_many(
        [(view[dest_at : dest_at + size], view[src_at : src_at + size])], [(0, 1)]
    )
    assert buffer == expected
    assert crc == _crc(expected[dest_at : dest_at + size])


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (b"read-only bytes!", BufferError, "destination of pair 2"),
        (memoryview(bytearray(16)).toreadonly(), BufferError, "destination of pair 2"),
        (bytearray(3), ValueError, "pair 2: destination holds 3 bytes, source has 16"),
    ],
)
def test_copy_many_refuses_a_bad_destination_before_writing_anything(
    bad: Any, error: type[Exception], match: str
) -> None:
    first, second = bytearray(16), bytearray(1 << 20)
    pairs = [(first, DATA[:16]), (second, DATA[: 1 << 20]), (bad, DATA[:16])]
    with pytest.raises(error, match=match):
        native.copy_many(pairs)
    assert first == bytearray(16)
    assert second == bytearray(1 << 20)


@pytest.mark.parametrize(
    "spans", [[(1, 0)], [(0, 2), (1, 3)], [(0, 4)], [(2, 3), (0, 1)], [(-1, 1)]]
)
def test_copy_many_refuses_spans_out_of_order_overlapping_or_out_of_range(
    spans: list[tuple[int, int]],
) -> None:
    dest = bytearray(1)
    with pytest.raises(ValueError, match="crc span"):
        native.copy_many([(dest, b"a"), (bytearray(1), b"b"), (bytearray(1), b"c")], spans)
    assert dest == bytearray(1)


def _copy_many(dest: Any, source: Any, crc_of_source: bool) -> int:
    [crc] = native.copy_many([(dest, source)], [(0, 1)], crc_of_source=crc_of_source)
    return crc


def _copy_through(pass_name: str) -> Callable[[Any, Any, bool], int]:
    def copy(dest: Any, source: Any, crc_of_source: bool) -> int:
        # One pass either way: the CRC is of the words stored, which are the source's.
        return native.copy_crc32c_with(pass_name, dest, source)

    return copy


# copy_many's own pass (CRC32C_PASS), and every pass a CPU with fewer features takes, each
# where this machine can run it.
COPY_PASSES = [
    pytest.param(_copy_many, id="copy_many"),
    *(
        pytest.param(_copy_through(param.values[0]), id=param.id, marks=param.marks)
        for param in PASSES
    ),
]


@pytest.mark.parametrize("copy", COPY_PASSES)
@pytest.mark.parametrize("size", [*SIZES, 3 * 8192 * 3 + 5])
@pytest.mark.parametrize("crc_of_source", [False, True])
def test_copy_many_checksums_every_byte_at_every_alignment(
    copy: Callable[[Any, Any, bool], int], size: int, crc_of_source: bool
) -> None:
    """Each word is checksummed as it is stored: the leading bytes before the destination
    (32-byte stores) or source (8-byte ones) is aligned, the folds or three streams of
    blocks, then registers, words and bytes left over, all land and count."""
    for src_at in range(9):
        for dest_at in (0, 3, 17, 31):
            source = memoryview(DATA)[src_at : src_at + size]
            backing = bytearray(size + 48)
            dest = memoryview(backing)[dest_at : dest_at + size]
            assert copy(dest, source, crc_of_source) == _crc(source)
            assert dest == source
            assert not any(backing[:dest_at])
            assert not any(backing[dest_at + size :])


_REWRITER = """
import mmap, sys
import numpy as np
with open(sys.argv[1], "r+b") as f:
    view = np.frombuffer(mmap.mmap(f.fileno(), 0), dtype=np.uint8)
    print("writing", flush=True)
    value = 0
    while True:  # until killed: each pass stores a new byte value over the whole source
        value = (value + 1) & 0xFF
        view[:] = value
"""


@pytest.mark.parametrize("pass_name", PASSES)
def test_a_copy_from_a_source_rewritten_under_it_checksums_exactly_the_bytes_it_stored(
    pass_name: str, tmp_path: Any
) -> None:
    """A get copies out of memory another process may be rewriting (a slot reused under a
    stale descriptor): the copy may land a mix of old and new bytes, and its CRC must be of
    that mix, never of bytes it loaded separately, or a torn read could pass its check. A
    real second process rewrites the source with a new byte value per pass; copies of odd
    lengths and placements (head, folds, tail) go on until some have landed torn."""
    size = (1 << 20) + 8192 * 3 + 13
    path = tmp_path / "source"
    path.write_bytes(bytes(size + 64))
    writer = subprocess.Popen(
        [sys.executable, "-c", _REWRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "writing\n"
        with open(path, "r+b") as f:
            shared = mmap.mmap(f.fileno(), 0)
            source = np.frombuffer(shared, dtype=np.uint8)
            backing = np.zeros(size + 64, dtype=np.uint8)
            torn = copies = 0
            deadline = time.monotonic() + 120
            while torn < 20 and time.monotonic() < deadline:
                src_at, dest_at = copies % 29, copies % 37
                length = size - (copies % 7) * 4099
                dest = backing[dest_at : dest_at + length]
                crc = native.copy_crc32c_with(pass_name, dest, source[src_at : src_at + length])
                assert crc == _crc(dest), f"copy {copies} checksummed bytes it did not store"
                torn += int(dest.min() != dest.max())
                copies += 1
            del source  # the mapping closes once no view holds it
            shared.close()
            assert torn == 20, f"no torn copy seen in {copies} copies: the writer never ran"
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("copy", COPY_PASSES)
@pytest.mark.parametrize("crc_of_source", [False, True])
def test_copy_many_of_a_megabyte_or_more_lands_every_byte_whatever_the_stores(
    copy: Callable[[Any, Any, bool], int], crc_of_source: bool
) -> None:
    """Copies of 1 MiB and more store non-temporally where the destination sits level with
    the source or far enough from it modulo 4 KiB, and plainly elsewhere: every placement
    lands exactly the bytes it checksums, and nothing around them."""
    size = (1 << 20) + 8192 * 3 + 13
    source_backing = np.random.default_rng(7).integers(0, 256, size + 8192, dtype=np.uint8)
    for src_at in (0, 8, 64, 4032):
        for dest_at in (0, 8, 48, 64, 200, 320, 2048, 3900, 4088):
            source = source_backing[src_at : src_at + size]
            backing = np.zeros(size + 8192, dtype=np.uint8)
            dest = backing[dest_at : dest_at + size]
            assert copy(dest, source, crc_of_source) == _crc(source)
            assert np.array_equal(dest, source)
            assert not backing[:dest_at].any()
            assert not backing[dest_at + size :].any()


def test_copy_crc32c_with_refuses_a_bad_destination_or_an_unknown_pass() -> None:
    with pytest.raises(ValueError, match="shorter"):
        native.copy_crc32c_with("narrow", bytearray(3), b"abcd")
    shared = bytearray(16)
    with pytest.raises(ValueError, match="overlap"):
        native.copy_crc32c_with("narrow", memoryview(shared)[4:], memoryview(shared)[:8])
    with pytest.raises(ValueError, match="no pass 'avx9'"):
        native.copy_crc32c_with("avx9", bytearray(4), b"abcd")
    assert shared == bytearray(16)


def test_copy_many_can_checksum_the_sources_and_copies_the_same_bytes() -> None:
    pairs, sources = _random_pairs(30, seed=3)
    spans = [(0, 4), (4, 4), (6, 20), (25, 30)]
    crcs = native.copy_many(pairs, crc_spans=spans, crc_of_source=True)
    assert crcs == [_crc(b"".join(sources[a:b])) for a, b in spans]
    for (dest, _), src in zip(pairs, sources, strict=True):
        assert bytes(dest[: len(src)]) == src


@pytest.mark.usefixtures("long_switch_interval")
@pytest.mark.parametrize("crc_of_source", [False, True])
def test_a_large_copy_ends_on_a_helper_and_lands_every_byte_with_each_spans_crc(
    crc_of_source: bool,
) -> None:
    """8 MiB and more: once the rest fits in the wait for the GIL, a helper copies it (here
    after the first MiB, in the middle of a pair) and each span's CRC goes on across the
    hand-over; the GIL is still taken back once."""
    rng = np.random.default_rng(5)
    sizes = [3 << 20, 1, 0, 5 << 20, 700_001, 2 << 20]
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    dests = [np.zeros(size + 64, dtype=np.uint8) for size in sizes]
    spans = [(0, 3), (3, 4), (5, 6)]  # pair 4 is copied with no CRC
    handoffs, taken = native.gil_handoffs(), native.gil_reacquisitions()
    crcs = native.copy_many(
        list(zip(dests, sources, strict=True)), spans, crc_of_source=crc_of_source
    )
    assert native.gil_handoffs() - handoffs == 1
    assert native.gil_reacquisitions() - taken == 1
    assert crcs == [_crc(b"".join(s.tobytes() for s in sources[a:b])) for a, b in spans]
    for dest, source in zip(dests, sources, strict=True):
        assert np.array_equal(dest[: source.size], source)
        assert not dest[source.size :].any()


@pytest.mark.usefixtures("long_switch_interval")
def test_a_copy_below_8_mib_or_of_one_overlapping_pair_is_not_handed_over() -> None:
    """Below 8 MiB a thread's start costs more than it saves; a pair whose source and
    destination overlap moves whole (memmove chooses its direction for all of it)."""
    handoffs = native.gil_handoffs()
    small = [(bytearray(4 << 20), DATA[: 1 << 20]) for _ in range(7)]
    assert native.copy_many(small, [(0, 7)]) == [_crc(DATA[: 1 << 20] * 7)]
    size = 9 << 20
    buffer = np.random.default_rng(9).integers(0, 256, size + 4096, dtype=np.uint8)
    source_before = buffer[4096:].copy()
    [crc] = native.copy_many([(buffer[:size], buffer[4096:])], [(0, 1)])
    assert native.gil_handoffs() == handoffs
    assert crc == _crc(source_before)
    assert np.array_equal(buffer[:size], source_before)


@pytest.mark.parametrize("shift", [1000, -1000])
def test_copy_many_of_overlapping_memory_checksums_the_source_as_it_was(shift: int) -> None:
    size = 300_000
    buffer = bytearray(DATA[: size + 2000])
    source_before = bytes(buffer[1000 : 1000 + size])
    view = memoryview(buffer)
    dest_at = 1000 + shift
    [crc] = native.copy_many(
        [(view[dest_at : dest_at + size], view[1000 : 1000 + size])], [(0, 1)], crc_of_source=True
    )
    assert crc == _crc(source_before)
    assert bytes(buffer[dest_at : dest_at + size]) == source_before


def test_a_write_into_memory_another_writer_scribbles_on_checksums_only_its_own_bytes() -> None:
    """Shared memory a writer that outlived its lease may still write: the CRC a writer
    stores with its record must be of what it meant to store, never of what it reads back
    (which would vouch for the other writer's bytes)."""
    size = 8 << 20
    region = np.zeros(size, dtype=np.uint8)
    source = np.frombuffer(DATA * 4, dtype=np.uint8)
    stop = threading.Event()

    def scribble() -> None:
        value = 0
        while not stop.is_set():
            value = (value + 1) % 256
            region[::4096] = value  # a byte per page, over and over (numpy drops the GIL)

    thread = threading.Thread(target=scribble)
    thread.start()
    try:
        results = [
            native.copy_many([(region, source)], [(0, 1)], crc_of_source=True)[0] for _ in range(20)
        ]
    finally:
        stop.set()
        thread.join()
    assert results == [_crc(source)] * 20


# -- prefaulting --------------------------------------------------------------------------


def _memfd(size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("kvfabric-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


@pytest.mark.parametrize("force_touch", [False, True])
def test_prefault_allocates_every_page_of_shared_memory_and_changes_no_byte(
    force_touch: bool,
) -> None:
    size = 8 << 20
    fd, mapping = _memfd(size)
    try:
        mapping[4096 * 3 + 5] = 7
        assert os.fstat(fd).st_blocks * 512 < size  # sparse until prefaulted
        populated = native.prefault(memoryview(mapping)[1:], force_touch=force_touch)
        # Without force_touch, the kernel does it where it can (Linux 5.14+).
        assert populated is (not force_touch and _kernel_at_least(5, 14))
        assert os.fstat(fd).st_blocks * 512 >= size
        expected = bytearray(size)
        expected[4096 * 3 + 5] = 7
        assert mapping[:] == expected
    finally:
        mapping.close()
        os.close(fd)


@pytest.mark.parametrize("cpus", [1, 3])
def test_prefault_all_uses_no_more_threads_than_the_cpus_the_process_may_use(
    monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    # A container's CPU quota, not the host's CPU count: usable_cpus() says how many.
    monkeypatch.setattr(buffers, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(buffers, "_PREFAULT_PIECE", 1 << 16)
    ran_on: list[str] = []
    prefault = native.prefault

    def recorded(buffer: memoryview) -> bool:
        ran_on.append(threading.current_thread().name)
        return prefault(buffer)

    monkeypatch.setattr(native, "prefault", recorded)
    mapping = mmap.mmap(-1, 16 * buffers._PREFAULT_PIECE)
    try:
        buffers.prefault_all([memoryview(mapping)])
    finally:
        mapping.close()
    assert len(ran_on) == 16
    if cpus == 1:
        assert set(ran_on) == {threading.current_thread().name}
    else:
        assert len(set(ran_on)) <= cpus
        assert all(name.startswith("kvfabric-prefault") for name in ran_on)


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    return (int(release[0]), int("".join(c for c in release[1] if c.isdigit()))) >= (major, minor)


def test_prefault_for_writing_needs_a_writable_buffer_and_reading_does_not() -> None:
    with pytest.raises(BufferError, match="prefault"):
        native.prefault(b"read-only bytes")
    assert native.prefault(b"read-only bytes", write=False) in (True, False)
    assert native.prefault(bytearray(0)) is False  # nothing to fault


def test_prefault_of_a_large_buffer_takes_the_gil_back_once() -> None:
    fd, mapping = _memfd(4 << 20)
    try:
        before = native.gil_reacquisitions()
        native.prefault(mapping)
        assert native.gil_reacquisitions() - before == 1
        before = native.gil_reacquisitions()
        native.prefault(memoryview(mapping)[:4096])
        assert native.gil_reacquisitions() - before == 0
    finally:
        mapping.close()
        os.close(fd)


# -- the mutex native loops share -----------------------------------------------------------


def test_a_mutex_is_a_context_manager_and_refuses_a_release_when_not_held() -> None:
    mutex = native.Mutex()
    assert not mutex.locked()
    with mutex:
        assert mutex.locked()
    assert not mutex.locked()
    with pytest.raises(RuntimeError, match="not held"):
        mutex.release()
    before = native.gil_reacquisitions()
    assert mutex.acquire() is True  # free: taken without giving up the GIL
    mutex.release()
    assert native.gil_reacquisitions() - before == 0


@pytest.mark.usefixtures("long_switch_interval")
def test_a_contended_mutex_waits_with_the_gil_released_and_takes_it_back_once() -> None:
    """The holder needs the GIL to finish and let go: a waiter that kept it would deadlock.

    The holder goes on only once this thread waits: told to go just before the acquire, it
    needs the GIL, which this thread (with a 1 s switch interval) gives up only by blocking
    in the acquire."""
    mutex = native.Mutex()
    held, go = threading.Event(), threading.Event()
    done: list[int] = []

    def holder() -> None:
        with mutex:
            held.set()
            go.wait()
            done.append(sum(range(100_000)))  # Python work: needs the GIL

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    before = native.gil_reacquisitions()
    go.set()
    with mutex:
        assert done == [sum(range(100_000))]
    thread.join()
    assert native.gil_reacquisitions() - before == 1


# -- sockets ------------------------------------------------------------------------------


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on 127.0.0.1 (client, server side)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def _readable(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue."""
    count = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", count)[0])


def _in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` on a thread now; the returned function joins it and returns or raises."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(30)
        assert outcome, "helper thread did not finish"
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    return join


def test_buffers_beyond_iov_max_of_mixed_sizes_cross_tcp_exactly(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    rng = random.Random(3)
    count = 3 * native.IOV_MAX + 7
    sizes = [rng.choice([0, 1, 64, 1000, 70_000]) for _ in range(count)]
    sources = [os.urandom(size) for size in sizes]
    targets = [bytearray(size) for size in sizes]
    join = _in_thread(lambda: native.send_all(client, sources, time.monotonic() + 30))
    spans = [(0, count // 2), (count // 2, count)]
    crcs = native.recv_into_all(server, targets, time.monotonic() + 30, crc_spans=spans)
    assert join() == sum(sizes)
    assert targets == [bytearray(s) for s in sources]
    assert crcs == [_crc(b"".join(sources[a:b])) for a, b in spans]


def test_a_checksummed_send_returns_each_spans_crc_of_what_it_sent(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    """Windows of 1 MiB are checksummed as they go: spans that start and end inside a
    window, cross several, are empty, or cover buffers beyond IOV_MAX all come out exact."""
    client, server = tcp_pair
    rng = random.Random(5)
    count = native.IOV_MAX + 300
    sizes = [rng.choice([0, 1, 64, 70_000]) for _ in range(count)]
    sizes[0] = sizes[20] = sizes[900] = 3 << 20  # each spans several windows
    sources = [os.urandom(size) for size in sizes]
    targets = [bytearray(size) for size in sizes]
    spans = [(0, 1), (1, 1), (1, 40), (40, count - 1)]
    join = _in_thread(lambda: native.recv_into_all(server, targets, time.monotonic() + 60))
    crcs = native.send_checksummed(client, sources, time.monotonic() + 60, spans)
    join()
    assert targets == [bytearray(s) for s in sources]
    assert crcs == [_crc(b"".join(sources[a:b])) for a, b in spans]


@pytest.mark.parametrize("spans", [[(2, 1)], [(0, 2), (1, 3)], [(0, 9)], [(0,)], "no"])
def test_a_checksummed_send_with_bad_spans_sends_nothing(
    tcp_pair: tuple[socket.socket, socket.socket], spans: object
) -> None:
    client, server = tcp_pair
    with pytest.raises((ValueError, TypeError)):
        native.send_checksummed(client, [b"abc", b"def", b"ghi"], None, spans)  # type: ignore[arg-type]
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.recv(1)


def test_a_large_payload_over_nonblocking_sockets_with_a_timeout_set() -> None:
    left, right = socket.socketpair()
    with left, right:
        # settimeout makes the sockets non-blocking underneath: EAGAIN paths, then poll().
        left.settimeout(30)
        right.settimeout(30)
        payload = np.random.default_rng(4).bytes(48 << 20)
        target = np.empty(48 << 20, dtype=np.uint8)
        views = [memoryview(payload)[i : i + (4 << 20)] for i in range(0, 48 << 20, 4 << 20)]
        outs = [target[i : i + (4 << 20)] for i in range(0, 48 << 20, 4 << 20)]
        join = _in_thread(lambda: native.send_all(left.fileno(), views, None))
        crcs = native.recv_into_all(right.fileno(), outs, None, crc_spans=[(0, 12)])
        assert join() == 48 << 20
        assert target.tobytes() == payload
        assert crcs == [_crc(payload)]


def test_receives_resume_across_a_peer_that_sends_in_dribbles(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    payload = os.urandom(10_007)

    def dribble() -> None:
        for i in range(0, len(payload), 997):
            client.sendall(payload[i : i + 997])
            time.sleep(0.005)  # the dribble under test: a pause between pieces

    join = _in_thread(dribble)
    targets = [bytearray(3), bytearray(5000), bytearray(0), bytearray(5004)]
    [crc] = native.recv_into_all(server, targets, time.monotonic() + 30, crc_spans=[(1, 4)])
    join()
    assert b"".join(targets) == payload
    assert crc == _crc(payload[3:])


def test_recv_past_the_deadline_raises_timeout_error_saying_what_arrived(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    client.sendall(b"x" * 10)
    with pytest.raises(TimeoutError, match="10 received"):
        native.recv_into_all(server, [bytearray(100)], time.monotonic() + 0.2)


def test_send_to_a_peer_that_stops_reading_raises_timeout_error(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _server = tcp_pair
    big = bytes(256 << 20)  # far more than both socket buffers hold
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="while sending") as caught:
        native.send_all(client, [big], time.monotonic() + 0.3)
    print(f"timed out after {time.monotonic() - started:.3f} s: {caught.value}")


def test_a_deadline_already_past_still_raises_only_when_it_would_wait(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    assert native.send_all(client, [b"abc"], time.monotonic() - 1) == 3
    out = bytearray(3)
    native.recv_into_all(server, [out], 0.0)
    assert out == b"abc"
    with pytest.raises(TimeoutError):
        native.recv_into_all(server, [out], 0.0)


def test_eof_raises_peer_closed_with_the_bytes_received(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    client.sendall(b"y" * 1234)
    client.shutdown(socket.SHUT_WR)
    targets = [bytearray(1000), bytearray(1000)]
    with pytest.raises(native.PeerClosed) as caught:
        native.recv_into_all(server, targets, time.monotonic() + 30)
    assert isinstance(caught.value, ConnectionError)
    assert caught.value.received == 1234
    assert targets[0] == b"y" * 1000
    assert targets[1][:234] == b"y" * 234


def test_a_reset_peer_raises_connection_reset_error(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    # Linger 0: close() sends RST instead of FIN.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    with pytest.raises(ConnectionResetError, match="recv_into_all"):
        native.recv_into_all(server, [bytearray(10)], time.monotonic() + 30)
    with pytest.raises(ConnectionError):
        native.send_all(server, [b"z" * 1_000_000], time.monotonic() + 30)


def test_other_failures_are_os_errors_with_their_errno() -> None:
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(OSError, match="send_all") as caught:
            native.send_all(write_end, [b"not a socket"], None)
        assert caught.value.errno == 88  # ENOTSOCK
    finally:
        os.close(read_end)
        os.close(write_end)
    closed = socket.socket()
    closed.close()
    with pytest.raises(ValueError, match="negative"):
        native.recv_into_all(closed, [bytearray(1)], None)


def test_recv_into_a_read_only_buffer_is_refused_before_receiving(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    client.sendall(b"abc")
    with pytest.raises(BufferError, match="buffer 1"):
        native.recv_into_all(server, [bytearray(1), b"xx"], None)
    rest = bytearray(3)
    native.recv_into_all(server, [rest], time.monotonic() + 30)
    assert rest == b"abc"


# -- request_reply: a request, its reply with a status byte per payload, the accepted payloads --

_HEAD = struct.Struct("<4sI")  # magic, count


def _serve_once(sock: socket.socket, statuses: bytes, payloads: list[bytes]) -> None:
    """A peer in the tcp transport's shape: read the request, reply head+statuses, payloads."""
    request = bytearray(_HEAD.size + len(statuses))
    native.recv_into_all(sock, [request], time.monotonic() + 30)
    accepted = [p for p, s in zip(payloads, statuses, strict=True) if s == 0]
    native.send_all(sock, [_HEAD.pack(b"KVFT", len(statuses)), statuses, *accepted], None)


def _ask_for_all(client: socket.socket, targets: list[bytearray], busy_poll: float = 0.0) -> None:
    """A request for ``len(targets)`` payloads from a peer running :func:`_serve_once` with
    every status 0: each lands in its target."""
    count = len(targets)
    native.request_reply(
        client,
        [_HEAD.pack(b"KVFT", count), bytes(count)],
        bytearray(_HEAD.size + count),
        targets,
        time.monotonic() + 30,
        status_offset=_HEAD.size,
        busy_poll=busy_poll,
    )


def test_request_reply_fills_only_the_payloads_the_reply_accepts(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    count = native.IOV_MAX + 50
    rng = random.Random(5)
    payloads = [os.urandom(rng.choice([1, 64, 5000])) for _ in range(count)]
    statuses = bytes(rng.choice([0, 0, 0, 2]) for _ in range(count))
    join = _in_thread(lambda: _serve_once(server, statuses, payloads))
    reply = bytearray(_HEAD.size + count)
    targets = [bytearray(b"\xee" * len(p)) for p in payloads]
    request = [_HEAD.pack(b"KVFT", count), bytes(count)]
    spans = [(0, 10), (10, count)]
    crcs = native.request_reply(
        client, request, reply, targets, time.monotonic() + 30, status_offset=8, crc_spans=spans
    )
    join()
    assert reply == _HEAD.pack(b"KVFT", count) + statuses
    for target, payload, status in zip(targets, payloads, statuses, strict=True):
        assert target == (payload if status == 0 else b"\xee" * len(payload))
    expected = [
        _crc(b"".join(p for p, s in zip(payloads[a:b], statuses[a:b], strict=True) if s == 0))
        for a, b in spans
    ]
    assert crcs == expected


def test_request_reply_reports_a_short_error_reply_then_close_as_peer_closed(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair

    def refuse() -> None:
        native.recv_into_all(server, [bytearray(4)], time.monotonic() + 30)
        server.sendall(b"ERR!\x03\x00\x00\x00")
        server.shutdown(socket.SHUT_WR)

    join = _in_thread(refuse)
    reply = bytearray(8 + 4)
    with pytest.raises(native.PeerClosed) as caught:
        native.request_reply(client, [b"ask!"], reply, [bytearray(4)] * 4, None, status_offset=8)
    join()
    assert caught.value.received == 8
    assert reply[:8] == b"ERR!\x03\x00\x00\x00"


def test_request_reply_refuses_a_reply_without_a_status_byte_per_payload() -> None:
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(ValueError, match="no status byte"):
            native.request_reply(
                left, [b"x"], bytearray(10), [bytearray(1)] * 3, None, status_offset=8
            )
        # Nothing was sent: the check comes first.
        right.setblocking(False)
        with pytest.raises(BlockingIOError):
            right.recv(1)


@pytest.mark.parametrize("reply_after", [0.0, 0.2], ids=["within-the-spin", "after-it"])
def test_request_reply_with_busy_poll_takes_the_reply_whether_it_comes_within_the_spin_or_after(
    tcp_pair: tuple[socket.socket, socket.socket], reply_after: float
) -> None:
    client, server = tcp_pair
    payloads = [os.urandom(4096) for _ in range(8)]

    def late() -> None:
        time.sleep(reply_after)  # the case under test: a reply after the 1 ms spin
        _serve_once(server, bytes(8), payloads)

    join = _in_thread(late)
    targets = [bytearray(4096) for _ in range(8)]
    before = native.gil_reacquisitions()
    _ask_for_all(client, targets, busy_poll=0.001)
    join()
    assert targets == [bytearray(p) for p in payloads]
    # The spin runs without the GIL: one return for the wait, however it ended.
    assert native.gil_reacquisitions() - before == 1


def test_request_reply_with_busy_poll_still_times_out_at_the_deadline(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _ = tcp_pair
    with pytest.raises(TimeoutError, match="receiving"):
        native.request_reply(
            client, [b"ask!"], bytearray(8), [], time.monotonic() + 0.05, busy_poll=1.0
        )


@pytest.mark.parametrize("busy_poll", [-0.001, 1.5, float("nan")])
def test_request_reply_refuses_a_busy_poll_outside_0_to_1_second(busy_poll: float) -> None:
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(ValueError, match="busy_poll must be 0 to 1 seconds"):
            native.request_reply(left, [b"x"], bytearray(1), [], None, busy_poll=busy_poll)
        right.setblocking(False)
        with pytest.raises(BlockingIOError):
            right.recv(1)  # nothing was sent


# -- the GIL ------------------------------------------------------------------------------


def test_a_busy_thread_keeps_counting_while_a_large_crc_batch_runs() -> None:
    piece = memoryview(DATA)
    values = [[piece] * 4 for _ in range(128)]  # 1 GiB of CRC work, 512 pieces
    with BusyThread() as busy:
        before_count, before_gil = busy.count, native.gil_reacquisitions()
        started = time.perf_counter()
        crcs = native.crc32c_many(values)
        elapsed = time.perf_counter() - started
        after_count, after_gil = busy.count, native.gil_reacquisitions()
    print(f"1 GiB in {elapsed * 1e3:.1f} ms; the busy thread counted {after_count - before_count}")
    assert after_count > before_count
    assert after_gil - before_gil == 1  # one return for 512 pieces
    assert crcs == [_crc(DATA * 4)] * 128


def test_a_busy_thread_keeps_counting_while_a_large_receive_runs(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    chunk = 1 << 20
    payload = memoryview(np.random.default_rng(6).bytes(chunk * 64))
    sources = [payload[i : i + chunk] for i in range(0, payload.nbytes, chunk)]
    targets = [bytearray(chunk) for _ in range(64)]
    with BusyThread() as busy:
        join = _in_thread(lambda: native.send_all(client, sources, time.monotonic() + 60))
        before_count, before_gil = busy.count, native.gil_reacquisitions()
        crcs = native.recv_into_all(
            server, targets, time.monotonic() + 60, crc_spans=[(i, i + 1) for i in range(64)]
        )
        after_count, after_gil = busy.count, native.gil_reacquisitions()
        join()
    assert after_count > before_count
    assert after_gil - before_gil == 1  # one return for 64 buffers and many receives
    assert b"".join(targets) == payload
    assert crcs == [_crc(s) for s in sources]


@pytest.mark.parametrize(
    ("call", "returns"),
    [
        (lambda: native.crc32c_many([[DATA[:4096]] * 4] * 64), 1),
        (lambda: native.crc32c_many([DATA[:1000]] * 8), 0),
        (lambda: native.crc32c(DATA), 1),
        (lambda: native.crc32c(DATA[:1000]), 0),
        (lambda: native.copy_many([(bytearray(1 << 20), DATA[: 1 << 20])] * 64), 1),
        (lambda: native.copy_many([(bytearray(100), DATA[:100])] * 8, [(0, 8)]), 0),
    ],
    ids=["crc-64x4-pieces", "crc-small", "crc-one-large", "crc-one-small", "copy-64", "copy-small"],
)
def test_a_batch_takes_the_gil_back_once_and_a_small_one_keeps_it(
    call: Callable[[], object], returns: int
) -> None:
    before = native.gil_reacquisitions()
    call()
    assert native.gil_reacquisitions() - before == returns


def test_a_request_reply_takes_the_gil_back_once(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    payloads = [os.urandom(100_000) for _ in range(300)]
    join = _in_thread(lambda: _serve_once(server, bytes(300), payloads))
    targets = [bytearray(100_000) for _ in range(300)]
    before = native.gil_reacquisitions()
    _ask_for_all(client, targets)
    assert native.gil_reacquisitions() - before == 1
    join()
    assert targets == [bytearray(p) for p in payloads]


# -- request_reply_lanes: request_reply on several sockets at once --------------------------


@pytest.fixture
def tcp_pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Three connected (client, server) pairs over 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        pairs = []
        for _ in range(3):
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            pairs.append((client, server))
    try:
        yield pairs
    finally:
        for client, server in pairs:
            client.close()
            server.close()


def _lane(
    client: socket.socket, targets: list[bytearray], spans: list[tuple[int, int]] | None = None
) -> tuple[Any, ...]:
    count = len(targets)
    request = [_HEAD.pack(b"KVFT", count), bytes(count)]
    return (client, request, bytearray(_HEAD.size + count), targets, _HEAD.size, spans)


def test_request_reply_lanes_fills_each_lanes_payloads_with_its_crcs_in_one_return(
    tcp_pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    rng = random.Random(11)
    lanes, expected, joins = [], [], []
    for k, (client, server) in enumerate(tcp_pairs):
        count = 40 + k
        payloads = [os.urandom(rng.choice([1, 4096, 300_000])) for _ in range(count)]
        statuses = bytes(rng.choice([0, 0, 0, 2]) for _ in range(count))
        joins.append(_in_thread(lambda s=server, st=statuses, p=payloads: _serve_once(s, st, p)))
        targets = [bytearray(b"\xee" * len(p)) for p in payloads]
        spans = [(0, 7), (7, 7), (7, count)]
        lanes.append(_lane(client, targets, spans))
        expected.append((payloads, statuses, targets, spans))
    before = native.gil_reacquisitions()
    crcs = native.request_reply_lanes(lanes, time.monotonic() + 30)
    assert native.gil_reacquisitions() - before == 1
    for join in joins:
        join()
    assert len(crcs) == 3
    for lane, lane_crcs, (payloads, statuses, targets, spans) in zip(
        lanes, crcs, expected, strict=True
    ):
        assert lane[2][_HEAD.size :] == statuses
        for target, payload, status in zip(targets, payloads, statuses, strict=True):
            assert target == (payload if status == 0 else b"\xee" * len(payload))
        assert lane_crcs == [
            _crc(b"".join(p for p, s in zip(payloads[a:b], statuses[a:b], strict=True) if s == 0))
            for a, b in spans
        ]


def test_request_reply_lanes_raises_a_later_lanes_failure_after_the_first_lane_is_done(
    tcp_pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    """The second lane's peer answers with less than a whole reply and closes: that lane's
    PeerClosed, with what it received; the first lane's bytes landed meanwhile."""
    (first, first_server), (second, second_server), _ = tcp_pairs
    payload = os.urandom(100_000)
    join_first = _in_thread(lambda: _serve_once(first_server, bytes(1), [payload]))

    def refuse() -> None:
        native.recv_into_all(second_server, [bytearray(_HEAD.size + 2)], time.monotonic() + 30)
        second_server.sendall(b"ERR!\x03\x00\x00\x00")
        second_server.shutdown(socket.SHUT_WR)

    join_second = _in_thread(refuse)
    target = bytearray(len(payload))
    second_lane = _lane(second, [bytearray(4), bytearray(4)])
    with pytest.raises(native.PeerClosed) as caught:
        native.request_reply_lanes([_lane(first, [target]), second_lane], time.monotonic() + 30)
    join_first()
    join_second()
    assert caught.value.received == 8
    assert second_lane[2][:8] == b"ERR!\x03\x00\x00\x00"
    assert target == payload


def test_request_reply_lanes_whose_first_lane_fails_ends_the_others_at_once(
    tcp_pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    """The first lane's peer closes; the second's never answers. The call raises the first
    lane's error without waiting out the 30 s deadline: the other lanes' sockets are shut
    down (the caller closes them all after an error)."""
    (first, first_server), (second, second_server), _ = tcp_pairs
    first_server.shutdown(socket.SHUT_RDWR)
    started = time.monotonic()
    with pytest.raises((native.PeerClosed, ConnectionError)):
        native.request_reply_lanes(
            [_lane(first, [bytearray(10)]), _lane(second, [bytearray(10)])],
            time.monotonic() + 30,
        )
    assert time.monotonic() - started < 20  # a bound only a wait for the deadline reaches
    # The silent lane's socket was shut down: its peer sees the end of the stream (after
    # the request, if it went out first).
    second_server.settimeout(10)
    while second_server.recv(100):
        pass


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda pairs: [], "1 to 8 lanes"),
        (lambda pairs: [_lane(pairs[0][0], [])] * 9, "1 to 8 lanes"),
        (lambda pairs: [_lane(pairs[0][0], []), _lane(pairs[0][0], [])], "share a socket"),
        (lambda pairs: [_lane(pairs[0][0], []), ("no",)], "lane 1"),
        (
            lambda pairs: [
                _lane(pairs[0][0], []),
                (pairs[1][0], [], bytearray(2), [bytearray(1)], 8, None),
            ],
            "no status byte",
        ),
    ],
    ids=["none", "nine", "one-socket-twice", "not-a-lane", "reply-too-short"],
)
def test_request_reply_lanes_refuses_bad_lanes_before_sending_anything(
    tcp_pairs: list[tuple[socket.socket, socket.socket]],
    make: Callable[[list[tuple[socket.socket, socket.socket]]], list[Any]],
    match: str,
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        native.request_reply_lanes(make(tcp_pairs), time.monotonic() + 30)
    for _, server in tcp_pairs:
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.recv(1)


_ECHO_PROCESS = """
import socket, struct, sys
head = struct.Struct("<4sI")
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    request = conn.recv(head.size + 4)  # a small request arrives whole over loopback
    if not request:
        break
    conn.sendall(request[: head.size] + bytes(4))
"""


@pytest.fixture
def echo_process() -> Iterator[socket.socket]:
    """A socket to a real process that answers each small request at once: a reply no
    thread of this process has to produce (which would need the GIL)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        child = subprocess.Popen(
            [sys.executable, "-c", _ECHO_PROCESS, str(listener.getsockname()[1])]
        )
        try:
            listener.settimeout(30)
            sock, _ = listener.accept()
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield sock
        finally:
            child.kill()
            child.wait()


def _small_request(sock: socket.socket, hold_gil: float) -> int:
    """One 12-byte request and its 12-byte reply; returns the GIL returns it took."""
    reply = bytearray(_HEAD.size + 4)
    before = native.gil_reacquisitions()
    native.request_reply(
        sock,
        [_HEAD.pack(b"KVFT", 4), bytes(4)],
        reply,
        [],
        time.monotonic() + 30,
        hold_gil=hold_gil,
    )
    assert reply == _HEAD.pack(b"KVFT", 4) + bytes(4)
    return native.gil_reacquisitions() - before


def test_a_small_request_reply_whose_reply_comes_within_the_hold_keeps_the_gil(
    echo_process: socket.socket,
) -> None:
    """Without a hold a call waits for its reply with the GIL released and takes it back
    at most once: once, unless the reply is there at its first look (how often depends on
    the scheduler: the echo process, woken on this call's CPU, can run before the call
    looks, and did in 19 of 20 calls with the other CPU busy). With a hold, a reply that
    comes within it costs no return: at least one of 20 (a reply over loopback takes tens
    of microseconds; the hold is a millisecond)."""
    released = [_small_request(echo_process, 0.0) for _ in range(20)]
    assert set(released) <= {0, 1}
    held = [_small_request(echo_process, 0.001) for _ in range(20)]
    assert set(held) <= {0, 1}
    assert 0 in held


def test_a_reply_that_needs_the_gil_comes_after_the_hold_and_costs_one_return(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    """The hold is bounded: a peer thread of this process, which needs the GIL to answer,
    answers once the call has let it go."""
    client, server = tcp_pair

    def answer() -> None:
        request = bytearray(_HEAD.size + 4)
        native.recv_into_all(server, [request], time.monotonic() + 30)
        native.send_all(server, [bytes(request[: _HEAD.size]), bytes(4)], None)

    join = _in_thread(answer)
    assert _small_request(client, 0.001) == 1
    join()


@pytest.mark.parametrize("hold_gil", [-0.001, 0.0011, float("nan")])
def test_request_reply_refuses_a_hold_outside_0_to_1_millisecond(hold_gil: float) -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(ValueError, match="hold_gil"):
        native.request_reply(a, [b"x"], bytearray(1), [], None, hold_gil=hold_gil)


def test_a_small_socket_call_with_nothing_to_wait_for_keeps_the_gil(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    before = native.gil_reacquisitions()
    native.send_all(client, [b"x" * 1000] * 10, time.monotonic() + 30)  # fits the buffer
    assert native.gil_reacquisitions() - before == 0
    wait_for("10,000 bytes readable", lambda: _readable(server), until=lambda n: n >= 10_000)
    out = bytearray(10_000)
    native.recv_into_all(server, [out], time.monotonic() + 30)
    assert native.gil_reacquisitions() - before == 0
    assert out == b"x" * 10_000


def test_a_small_socket_call_that_waits_takes_the_gil_back_once(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = tcp_pair
    join = _in_thread(lambda: _serve_once(server, bytes(3), [b"a", b"b", b"c"]))
    targets = [bytearray(1) for _ in range(3)]
    before = native.gil_reacquisitions()
    native.request_reply(
        client,
        [_HEAD.pack(b"KVFT", 3), bytes(3)],
        bytearray(_HEAD.size + 3),
        targets,
        time.monotonic() + 30,
        status_offset=_HEAD.size,
    )
    assert native.gil_reacquisitions() - before == 1  # the wait for the reply
    join()
    assert targets == [b"a", b"b", b"c"]


def test_gil_reacquisitions_are_counted_per_thread() -> None:
    before = native.gil_reacquisitions()
    _in_thread(lambda: native.crc32c(DATA))()
    assert native.gil_reacquisitions() == before


def test_a_signal_during_a_wait_runs_its_handler_and_the_receive_resumes() -> None:
    import signal

    left, right = socket.socketpair()
    fired: list[int] = []

    def send_once_handled() -> None:
        wait_for("the handler ran", lambda: fired)
        left.sendall(b"late")

    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        with left, right:
            join = _in_thread(send_once_handled)
            # 50 ms: the alarm lands while the receive below waits for the bytes.
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            before = native.gil_reacquisitions()
            out = bytearray(4)
            native.recv_into_all(right, [out], time.monotonic() + 30)
            join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert out == b"late"
    assert fired == [signal.SIGALRM]
    # The final return, plus one to run the handler.
    assert native.gil_reacquisitions() - before == 2


def test_a_signal_handler_that_raises_ends_the_wait_with_its_exception() -> None:
    import signal

    class Stop(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stop

    left, right = socket.socketpair()
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        with left, right:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(Stop):
                native.recv_into_all(right, [bytearray(1)], time.monotonic() + 30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
