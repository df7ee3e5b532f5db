"""copy_many on several threads: the same bytes and CRCs as on one, cut only between spans."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvfabric._runtime import native
from kvfabric._runtime.record import checksum_pieces
from kvfabric.errors import ConfigError
from kvfabric.transports.shm import parse_copy_threads


def _batch(sizes: list[list[int]]) -> tuple[list[tuple[np.ndarray, bytes]], list[tuple[int, int]]]:
    """Pairs for values made of pieces of ``sizes``, and one CRC span per value."""
    pairs: list[tuple[np.ndarray, bytes]] = []
    spans: list[tuple[int, int]] = []
    for pieces in sizes:
        start = len(pairs)
        pairs += [(np.zeros(n, np.uint8), os.urandom(n)) for n in pieces]
        spans.append((start, len(pairs)))
    return pairs, spans


@pytest.mark.parametrize("threads", [2, 3, 4, 16])
def test_a_large_batch_on_several_threads_lands_every_byte_and_every_span_crc(
    threads: int,
) -> None:
    # 40 MiB: past the 32 MiB a batch needs to be cut; values of 1 to 3 pieces of odd sizes.
    sizes = [[(1 << 20) + 7 * i, 3 * 4096 + i][: 1 + i % 2] for i in range(24)]
    sizes += [[4 << 20] for _ in range(4)]
    pairs, spans = _batch(sizes)
    before = native.parallel_copies()
    crcs = native.copy_many(pairs, spans, threads=threads)
    assert native.parallel_copies() - before == 1
    assert all(bytes(dest) == src for dest, src in pairs)
    assert crcs == [checksum_pieces([pairs[i][1] for i in range(a, b)]) for a, b in spans]


def test_a_small_batch_or_one_thread_copies_on_the_calling_thread_alone() -> None:
    pairs, spans = _batch([[1 << 20] for _ in range(8)])  # 8 MiB: under the 32 MiB cut
    before = native.parallel_copies()
    crcs = native.copy_many(pairs, spans, threads=8)
    big, big_spans = _batch([[4 << 20] for _ in range(10)])
    native.copy_many(big, big_spans, threads=1)
    assert native.parallel_copies() == before
    assert crcs == [checksum_pieces([src]) for _, src in pairs]


def test_one_span_is_never_cut_across_threads() -> None:
    # One value of 40 pieces: a single span, so the whole batch is one part; still exact.
    pairs, spans = _batch([[1 << 20] * 40])
    crcs = native.copy_many(pairs, spans, threads=4)
    assert crcs == [checksum_pieces([src for _, src in pairs])]


def test_copy_threads_option() -> None:
    assert parse_copy_threads("3") == 3
    assert 1 <= parse_copy_threads("auto") <= 8
    for bad in ("0", "17", "many"):
        with pytest.raises(ConfigError, match="copy_threads"):
            parse_copy_threads(bad)
    with pytest.raises(ValueError, match="threads"):
        native.copy_many([], None, threads=0)
