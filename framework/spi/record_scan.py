"""Finding the records a region holds, from their self-describing headers.

A node that restarts with its memory (a ``file`` backend), or that meets a controller which
restarted and lost its index, rebuilds what it holds by scanning: every record starts at a
64-byte-aligned offset with the magic, a header checksum, the key, version, payload length
and the payload's CRC32C. The scan

1. finds every aligned offset that starts with the magic (vectorised: numpy compares one
   32-bit word per 64 bytes, so a GiB is scanned at memory speed);
2. keeps the headers whose own checksum holds;
3. resolves overlaps by version, newest first: a slot reused by a later write carries a
   larger version, so where two headers' spans overlap the older one was freed, and its
   bytes may be partly overwritten;
4. checks each survivor's payload CRC32C: a record torn by a crash mid-write, or
   overwritten, is dropped (counted), and its space is free again.

What survives is every intact record the region holds — including ones that were evicted
or deleted but not yet overwritten. Each is still exactly the value stored under its key, so
bringing it back can cost memory, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kvfabric.errors import ValidationError
from kvfabric.spi.record import HEADER_SIZE, MAGIC, SLOT_ALIGN, checksum, parse_header, record_size

__all__ = ["FoundRecord", "ScanResult", "scan_records"]

_MAGIC_WORD = int.from_bytes(MAGIC, "little")
_WORDS_PER_SLOT = SLOT_ALIGN // 4


@attrs.frozen(kw_only=True)
class FoundRecord:
    """An intact record: where it starts in its region and what its header says."""

    offset: int
    key: bytes
    version: int
    length: int
    crc: int

    @property
    def size(self) -> int:
        """Bytes the record occupies (its slot)."""
        return record_size(self.length)


@attrs.frozen(kw_only=True)
class ScanResult:
    records: tuple[FoundRecord, ...]
    """Intact records, in offset order."""
    bad_headers: int
    """Aligned offsets starting with the magic whose header checksum failed."""
    overlapped: int
    """Valid headers inside a newer record's span (their slot was reused)."""
    torn: int
    """Records whose payload failed its CRC32C (torn by a crash, or overwritten)."""


def scan_records(view: memoryview, *, verify_payload: bool = True) -> ScanResult:
    """Every intact record in ``view`` (a region's memory; releases the GIL while hashing)."""
    usable = view.nbytes - view.nbytes % SLOT_ALIGN
    words = np.frombuffer(view[:usable], dtype=np.uint32)
    candidates = np.flatnonzero(words[::_WORDS_PER_SLOT] == _MAGIC_WORD) * SLOT_ALIGN
    headers: list[FoundRecord] = []
    bad = 0
    for offset in candidates.tolist():
        if offset + HEADER_SIZE > usable:
            bad += 1
            continue
        try:
            head = parse_header(view[offset : offset + HEADER_SIZE])
        except ValidationError:
            bad += 1
            continue
        if offset + record_size(head.length) > usable:
            bad += 1
            continue
        headers.append(
            FoundRecord(
                offset=offset, key=head.key, version=head.version, length=head.length, crc=head.crc
            )
        )
    kept, overlapped = _newest_without_overlap(headers)
    records: list[FoundRecord] = []
    torn = 0
    for record in kept:
        start = record.offset + HEADER_SIZE
        if verify_payload and checksum(view[start : start + record.length]) != record.crc:
            torn += 1
            continue
        records.append(record)
    return ScanResult(records=tuple(records), bad_headers=bad, overlapped=overlapped, torn=torn)


def _newest_without_overlap(found: Sequence[FoundRecord]) -> tuple[list[FoundRecord], int]:
    """Keep records newest first, dropping any that overlaps one already kept.

    Sorted by offset, the records fall into clusters of (transitively) overlapping spans;
    almost every cluster is one record, and only the rare larger ones need resolving.
    """
    kept: list[FoundRecord] = []
    dropped = 0
    cluster: list[FoundRecord] = []
    cluster_end = -1
    for record in sorted(found, key=lambda r: r.offset):
        if cluster and record.offset >= cluster_end:
            dropped += _resolve_cluster(cluster, kept)
            cluster = []
        cluster.append(record)
        cluster_end = max(cluster_end, record.offset + record.size)
    if cluster:
        dropped += _resolve_cluster(cluster, kept)
    kept.sort(key=lambda r: r.offset)
    return kept, dropped


def _resolve_cluster(cluster: list[FoundRecord], kept: list[FoundRecord]) -> int:
    if len(cluster) == 1:
        kept.append(cluster[0])
        return 0
    chosen: list[FoundRecord] = []
    for record in sorted(cluster, key=lambda r: r.version, reverse=True):
        end = record.offset + record.size
        if all(record.offset >= c.offset + c.size or end <= c.offset for c in chosen):
            chosen.append(record)
    kept.extend(chosen)
    return len(cluster) - len(chosen)
