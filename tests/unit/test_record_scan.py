"""Rebuilding from self-describing records: the region scanner."""

from __future__ import annotations

import os

from kvfabric._runtime.record import HEADER_SIZE, MAGIC, checksum, pack_header, record_size
from kvfabric._runtime.record_scan import scan_records
from kvfabric.keys import fold_key


def _write(region: bytearray, offset: int, key: bytes, version: int, payload: bytes) -> None:
    head = pack_header(key, version, len(payload), checksum(payload))
    region[offset : offset + HEADER_SIZE] = head
    region[offset + HEADER_SIZE : offset + HEADER_SIZE + len(payload)] = payload


def _key(n: int) -> bytes:
    return fold_key(n, b"scan")


def test_every_intact_record_is_found_with_its_header() -> None:
    region = bytearray(os.urandom(1 << 20))
    placed = {}
    offset = 0
    for n, length in enumerate([0, 1, 100, 4096, 70_000]):
        payload = os.urandom(length)
        _write(region, offset, _key(n), 10 + n, payload)
        placed[offset] = (_key(n), 10 + n, length, checksum(payload))
        offset += record_size(length) + 64 * n  # gaps of random bytes between some
    result = scan_records(memoryview(region))
    found = {r.offset: (r.key, r.version, r.length, r.crc) for r in result.records}
    assert found == placed
    assert result.torn == 0
    assert result.overlapped == 0


def test_a_torn_payload_is_dropped_and_counted() -> None:
    region = bytearray(1 << 16)
    _write(region, 0, _key(1), 5, os.urandom(5000))
    _write(region, 8192, _key(2), 6, os.urandom(5000))
    region[8192 + HEADER_SIZE + 100] ^= 0xFF
    result = scan_records(memoryview(region))
    assert [r.key for r in result.records] == [_key(1)]
    assert result.torn == 1


def test_a_record_overwritten_by_a_newer_one_is_not_brought_back() -> None:
    region = bytearray(1 << 16)
    # An old 10 KB record at 0, then its slot reused at 4096 by a newer one: the old header
    # is intact, but its span overlaps the newer record, so only the newer one counts.
    _write(region, 0, _key(1), 5, os.urandom(10_000))
    _write(region, 4096, _key(2), 9, os.urandom(1000))
    result = scan_records(memoryview(region))
    assert [(r.offset, r.key) for r in result.records] == [(4096, _key(2))]
    assert result.overlapped == 1


def test_magic_without_a_valid_header_is_not_a_record() -> None:
    region = bytearray(1 << 12)
    region[0:4] = MAGIC  # the magic, then zeros: the header checksum fails
    region[128:132] = MAGIC
    region[128 + 60 : 128 + 64] = b"\x01\x02\x03\x04"
    result = scan_records(memoryview(region))
    assert result.records == ()
    assert result.bad_headers == 2


def test_a_header_whose_payload_would_run_past_the_region_is_refused() -> None:
    region = bytearray(4096)
    region[0:HEADER_SIZE] = pack_header(_key(1), 1, 1 << 20, 0)
    assert scan_records(memoryview(region)).records == ()
