"""Finding the records a region holds, from their self-describing headers.

A node that restarts with its memory (a ``file`` backend), or that meets a controller which
restarted and lost its index, rebuilds what it holds by scanning: every record starts at a
64-byte-aligned offset with the magic, a header checksum, the key, version, payload length
and the payload's CRC32C. The scan

1. finds every aligned offset that starts with the magic (vectorised: numpy compares one
   32-bit word per 64 bytes, so a GiB is scanned at memory speed);
2. keeps the headers whose format and own checksum hold, and whose payload fits the region;
3. resolves overlaps by version, newest first: a slot reused by a later write carries a
   larger version, so where two headers' spans overlap the older one was freed, and its
   bytes may be partly overwritten (sorted by offset, the overlapping ones are found in one
   vectorised pass; only those few clusters are resolved one by one);
4. checks each survivor's payload CRC32C: a record torn by a crash mid-write, or
   overwritten, is dropped (counted), and its space is free again.

What survives is every intact record the region holds — including ones that were evicted
or deleted but not yet overwritten. Each is still exactly the value stored under its key, so
bringing it back can cost memory, never correctness.

The result is a numpy structured array (:data:`FOUND_DTYPE`), not a Python object per
record: a node holding a million records scans, and reports them, in seconds.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvfabric._runtime.record import FORMAT_VERSION, HEADER_SIZE, MAGIC, SLOT_ALIGN, checksum

__all__ = ["FOUND_DTYPE", "FoundRecord", "ScanResult", "scan_records"]

_MAGIC_WORD = int.from_bytes(MAGIC, "little")
_WORDS_PER_SLOT = SLOT_ALIGN // 4
# The header's layout (see kvfabric._runtime.record): magic, format, flags, key, version,
# payload length, payload CRC32C, header CRC32C (over the first 60 bytes).
_HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("format", "<u2"),
        ("flags", "<u2"),
        ("key", "S32"),
        ("version", "<u8"),
        ("length", "<u8"),
        ("crc", "<u4"),
        ("header_crc", "<u4"),
    ]
)
assert _HEADER_DTYPE.itemsize == HEADER_SIZE

FOUND_DTYPE = np.dtype(
    [("offset", "<u8"), ("key", "S32"), ("version", "<u8"), ("length", "<u8"), ("crc", "<u4")]
)
"""One intact record: where it starts in its region and what its header says."""


@attrs.frozen(kw_only=True)
class FoundRecord:
    """One row of a scan, as a Python value (for callers that want objects)."""

    offset: int
    key: bytes
    version: int
    length: int
    crc: int

    @property
    def size(self) -> int:
        """Bytes the record occupies (its slot)."""
        return int(_record_sizes(np.array([self.length], dtype=np.uint64))[0])


@attrs.frozen(kw_only=True)
class ScanResult:
    found: np.ndarray = attrs.field(eq=False, repr=lambda a: f"<{len(a)} records>")
    """Intact records (:data:`FOUND_DTYPE`), in offset order."""
    bad_headers: int
    """Aligned offsets starting with the magic whose header did not hold (format, checksum,
    or a payload running past the region)."""
    overlapped: int
    """Valid headers inside a newer record's span (their slot was reused)."""
    torn: int
    """Records whose payload failed its CRC32C (torn by a crash, or overwritten)."""

    @property
    def records(self) -> tuple[FoundRecord, ...]:
        return tuple(
            FoundRecord(
                offset=int(r["offset"]),
                key=bytes(r["key"]),
                version=int(r["version"]),
                length=int(r["length"]),
                crc=int(r["crc"]),
            )
            for r in self.found
        )


def scan_records(view: memoryview, *, verify_payload: bool = True) -> ScanResult:
    """Every intact record in ``view`` (a region's memory)."""
    usable = view.nbytes - view.nbytes % SLOT_ALIGN
    if usable == 0:
        return ScanResult(found=np.empty(0, FOUND_DTYPE), bad_headers=0, overlapped=0, torn=0)
    words = np.frombuffer(view[:usable], dtype=np.uint32)
    slots = np.flatnonzero(words[::_WORDS_PER_SLOT] == _MAGIC_WORD)
    rows = np.frombuffer(view[:usable], dtype=np.uint8).reshape(-1, SLOT_ALIGN)[slots]
    headers = rows.view(_HEADER_DTYPE).reshape(-1)
    offsets = slots.astype(np.uint64) * SLOT_ALIGN
    lengths = headers["length"]
    sizes = _record_sizes(np.minimum(lengths, usable))  # a wild length must not wrap around
    good = (headers["format"] == FORMAT_VERSION) & (lengths <= usable) & (offsets + sizes <= usable)
    good &= _header_checksums_hold(rows, good, headers["header_crc"])
    bad = int(len(headers) - np.count_nonzero(good))
    found = np.empty(int(np.count_nonzero(good)), FOUND_DTYPE)
    found["offset"] = offsets[good]
    for name in ("key", "version", "length", "crc"):
        found[name] = headers[name][good]
    found, overlapped = _newest_without_overlap(found)
    torn = 0
    if verify_payload and len(found):
        intact = np.ones(len(found), dtype=bool)
        columns = (found["offset"].tolist(), found["length"].tolist(), found["crc"].tolist())
        for i, (offset, length, crc) in enumerate(zip(*columns, strict=True)):
            start = offset + HEADER_SIZE
            if checksum(view[start : start + length]) != crc:
                intact[i] = False
        torn = int(len(found) - np.count_nonzero(intact))
        found = found[intact]
    return ScanResult(found=found, bad_headers=bad, overlapped=overlapped, torn=torn)


def _record_sizes(lengths: np.ndarray) -> np.ndarray:
    """Slot sizes of payloads of ``lengths`` bytes (header + payload, rounded to the slot)."""
    raw = lengths.astype(np.uint64) + HEADER_SIZE
    return (raw + (SLOT_ALIGN - 1)) // SLOT_ALIGN * SLOT_ALIGN


def _header_checksums_hold(
    rows: np.ndarray, candidates: np.ndarray, expected: np.ndarray
) -> np.ndarray:
    ok = np.zeros(len(rows), dtype=bool)
    span = HEADER_SIZE - 4  # the header's own checksum covers everything before it
    wanted = expected.tolist()
    for i in np.flatnonzero(candidates).tolist():
        ok[i] = checksum(rows[i, :span].data) == wanted[i]
    return ok


def _newest_without_overlap(found: np.ndarray) -> tuple[np.ndarray, int]:
    """Keep records newest first, dropping any that overlaps one already kept.

    Sorted by offset, a record overlaps an earlier one exactly when it starts before the
    furthest end seen so far; such records and their neighbours form small clusters,
    resolved one by one, while everything else is kept as is.
    """
    if len(found) < 2:
        return found, 0
    found = found[np.argsort(found["offset"], kind="stable")]
    starts = found["offset"]
    ends = starts + _record_sizes(found["length"])
    reach = np.maximum.accumulate(ends)
    overlaps_previous = np.zeros(len(found), dtype=bool)
    overlaps_previous[1:] = starts[1:] < reach[:-1]
    if not overlaps_previous.any():
        return found, 0
    # A cluster starts at every record that does not overlap what came before it.
    cluster_id = np.cumsum(~overlaps_previous) - 1
    in_cluster = overlaps_previous.copy()
    in_cluster[:-1] |= overlaps_previous[1:]
    keep = ~in_cluster
    for cluster in np.unique(cluster_id[in_cluster]).tolist():
        members = np.flatnonzero(cluster_id == cluster)
        chosen: list[int] = []
        for i in sorted(members.tolist(), key=lambda m: -int(found["version"][m])):
            if all(starts[i] >= ends[c] or ends[i] <= starts[c] for c in chosen):
                chosen.append(i)
        keep[chosen] = True
    return found[keep], int(len(found) - np.count_nonzero(keep))
