"""Where the redis index keeps things: key names, arenas, the ring that places keys, entries.

An *arena* is a contiguous part of one data node's region together with the index state of
every record placed in it: its entries, free extents, retired slots and grants, all in ONE
Redis hash slot (keys sharing a ``{hash tag}``), so one server-side function changes them
atomically, in Redis Cluster too. Arena tags are picked so that arena ``n`` lands on slot
``⌊frac(n·φ)·16384⌋``: consecutive arenas spread evenly over the slot space, hence over the
masters, whatever their number.

A key belongs to one arena, chosen by consistent hashing on a ring of points that every
client computes from the registry alone (points per arena ∝ its size). With replicas, its
other copies go to the next arenas clockwise that sit on nodes no earlier copy uses: when the
home's node goes, the arena that held the second copy is the key's new home. A point is derived
from the arena's *identity* (node name, region, index in the region), not from its id: a node
that comes back with the same regions gets the same keys back, and a new node takes over
only the keys that now fall on its points.

An *entry* (one Redis string per key, in its arena) starts with the key's descriptor in its
wire form, so a lookup returns it as it is; :func:`alternates` reads the other copies it lists.
"""

from __future__ import annotations

import binascii
import bisect
import hashlib
import math
import re
import threading
from collections.abc import Container, Sequence

import attrs
import numpy as np

from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import ConfigError

__all__ = [
    "ENTRY_HEAD",
    "FOREIGN",
    "PENDING",
    "PUBLISHED",
    "SLOTS",
    "Arena",
    "Ring",
    "alternates",
    "arena_prefix",
    "key_slot",
    "registry_key",
    "version_bytes",
]

SLOTS = 16384
_PHI = (math.sqrt(5) - 1) / 2
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Ring points per arena: ∝ size (128 per GiB), bounded so tiny arenas (tests) still spread
# and huge ones do not make the ring slow to build.
_POINTS_PER_GIB = 128
_MIN_POINTS, _MAX_POINTS = 32, 2048
# From this many keys a batch is placed with numpy (one search for all) rather than per key.
_VECTOR_FROM = 32

# An entry is its descriptor, then its state: 1 while its grant is being written, 3 when
# its record lives in another arena (then the holder's id, 8 bytes); then its alternates.
PENDING = 1
PUBLISHED = 2
FOREIGN = 3
ENTRY_HEAD = DESCRIPTOR_SIZE + 5

_tags: dict[int, str] = {}
_tags_lock = threading.Lock()


def key_slot(name: bytes) -> int:
    """Redis Cluster's slot of a key name (CRC16 of its hash tag, or of the whole name)."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1 : end]
    return binascii.crc_hqx(name, 0) % SLOTS


def _tag_for_slot(slot: int) -> str:
    """A short hash tag whose slot is ``slot`` (found once per process, then remembered)."""
    with _tags_lock:
        if not _tags:
            i = 0
            while len(_tags) < SLOTS:
                tag = format(i, "x")
                _tags.setdefault(binascii.crc_hqx(tag.encode(), 0) % SLOTS, tag)
                i += 1
        return _tags[slot]


def check_namespace(namespace: str) -> str:
    if not _NAMESPACE.match(namespace):
        raise ConfigError(
            f"redis namespace {namespace!r}: use 1-64 letters, digits, '_', '-' or '.'"
        )
    return namespace


def registry_key(namespace: str) -> bytes:
    """The registry's counters hash; the registry's other keys share its ``{namespace}`` tag."""
    return f"{{{namespace}}}:next".encode()


def arena_prefix(namespace: str, arena: int) -> bytes:
    """Prefix of an arena's keys; its meta hash is the prefix followed by ``m``."""
    slot = int(math.modf(arena * _PHI)[0] * SLOTS) % SLOTS
    return f"{{{_tag_for_slot(slot)}}}{namespace}:a{arena}:".encode()


def version_bytes(version: int) -> bytes:
    """A version as the functions keep it: 8 opaque little-endian bytes."""
    return version.to_bytes(8, "little")


def alternates(entry: bytes, nodes: Container[int]) -> tuple[Descriptor, ...]:
    """The other copies an entry lists, those on ``nodes`` (the nodes still registered)."""
    tail = entry[ENTRY_HEAD:]
    if entry[DESCRIPTOR_SIZE] == FOREIGN:
        tail = tail[8:]
    usable = len(tail) - len(tail) % DESCRIPTOR_SIZE
    return tuple(d for d in Descriptor.many_from_bytes(tail[:usable]) if d.node in nodes)


@attrs.frozen(kw_only=True)
class Arena:
    """One arena as the registry records it."""

    id: int
    node: int
    name: str
    """The node's name: with region and index, the arena's identity on the ring."""
    region: int
    index: int
    base: int
    size: int
    rkey: int
    restoring: bool
    prefix: bytes

    @property
    def meta(self) -> bytes:
        return self.prefix + b"m"

    @property
    def slot(self) -> int:
        return key_slot(self.prefix)

    def holds(self, region: int, offset: int, size: int) -> bool:
        return region == self.region and self.base <= offset and offset + size <= self.end

    @property
    def end(self) -> int:
        return self.base + self.size

    @classmethod
    def parse(cls, namespace: str, arena: int, record: bytes, names: dict[int, str]) -> Arena:
        """From the registry's record ``node|region|index|base|size|rkey|restoring``."""
        node, region, index, base, size, rkey, restoring = record.decode().split("|")
        return cls(
            id=arena,
            node=int(node),
            name=names.get(int(node), ""),
            region=int(region),
            index=int(index),
            base=int(base),
            size=int(size),
            rkey=int(rkey),
            restoring=restoring == "1",
            prefix=arena_prefix(namespace, arena),
        )


class Ring:
    """Consistent hashing of keys onto arenas (deterministic from the arenas alone)."""

    def __init__(self, arenas: Sequence[Arena]) -> None:
        points: list[tuple[int, int]] = []
        for index, arena in enumerate(arenas):
            identity = f"{arena.name}\0{arena.region}\0{arena.index}\0".encode()
            for i in range(_points(arena.size)):
                digest = hashlib.blake2b(identity + str(i).encode(), digest_size=8).digest()
                points.append((int.from_bytes(digest, "little"), index))
        points.sort()
        self._positions = [position for position, _ in points]
        self._owners = [owner for _, owner in points]
        self._positions_array = np.array(self._positions, dtype=np.uint64)
        self._owners_array = np.array(self._owners, dtype=np.int64)
        self.arenas = tuple(arenas)
        self._nodes = len({arena.node for arena in arenas})

    def __bool__(self) -> bool:
        return bool(self._positions)

    def arena_of(self, key: bytes) -> Arena:
        """The arena a key belongs to (the ring must not be empty)."""
        position = int.from_bytes(key[:8], "little")
        i = bisect.bisect_right(self._positions, position) % len(self._positions)
        return self.arenas[self._owners[i]]

    def copies_of(self, key: bytes, count: int) -> list[Arena]:
        """The arenas of a key's ``count`` copies: its home, then the next arenas clockwise
        on nodes not used yet (fewer when fewer nodes have arenas)."""
        positions, owners, total = self._positions, self._owners, len(self._positions)
        start = bisect.bisect_right(positions, int.from_bytes(key[:8], "little"))
        chosen: list[Arena] = []
        nodes: set[int] = set()
        wanted = min(count, self._nodes)
        for step in range(total):
            arena = self.arenas[owners[(start + step) % total]]
            if arena.node not in nodes:
                chosen.append(arena)
                nodes.add(arena.node)
                if len(chosen) == wanted:
                    break
        return chosen

    def group(self, keys: Sequence[bytes]) -> list[tuple[Arena, list[int]]]:
        """Positions of ``keys`` by the arena each belongs to (the ring must not be empty)."""
        joined = b"".join(keys) if len(keys) >= _VECTOR_FROM else b""
        if len(joined) != 32 * len(keys):
            by_arena: dict[int, list[int]] = {}
            positions, owners, count = self._positions, self._owners, len(self._positions)
            for i, key in enumerate(keys):
                point = bisect.bisect_right(positions, int.from_bytes(key[:8], "little"))
                by_arena.setdefault(owners[point % count], []).append(i)
            return [(self.arenas[owner], where) for owner, where in by_arena.items()]
        # Many keys: one vectorised search instead of a bisect per key.
        raw = np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), 32)
        points = raw[:, :8].copy().view("<u8").ravel()
        found = np.searchsorted(self._positions_array, points, side="right")
        arena_indexes = self._owners_array[found % len(self._positions_array)]
        order = np.argsort(arena_indexes, kind="stable")
        cuts = np.flatnonzero(np.diff(arena_indexes[order])) + 1
        return [
            (self.arenas[int(arena_indexes[chunk[0]])], chunk.tolist())
            for chunk in np.split(order, cuts)
        ]


def _points(size: int) -> int:
    return max(_MIN_POINTS, min(_MAX_POINTS, size * _POINTS_PER_GIB >> 30))
