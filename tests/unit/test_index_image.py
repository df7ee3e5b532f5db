"""The lookup image: what the memory index writes, what a probe may conclude, and the store
answering lookups from it (embedded: the index's own image, probed in place).

A probe answers *hit*, *miss* or *unknown*; these tests pin that a torn, spilled, foreign or
abandoned image is never a hit and never a miss, and that the store asks the index exactly
when the image cannot answer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import uuid

import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome, Store
from kvfabric._runtime.image import (
    IMAGE_BUCKET_SIZE,
    IMAGE_HEADER_SIZE,
    RING_ENTRY_SIZE,
    ImageGeometry,
    ImageStop,
    RingState,
    image_apply,
    image_beat,
    image_exists,
    image_prefix,
    ring_pieces,
)
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor, PackedDescriptors
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.indexes.memory_image import MemoryImage
from kvfabric.keys import chain_keys
from kvfabric.spi import AllocationRequest, GrantRef, NodeInfo, Region, RegionInfo
from kvfabric.testing import wait_for

HIT, MISS, UNKNOWN, UNUSABLE = (
    ImageStop.HIT,
    ImageStop.MISS,
    ImageStop.UNKNOWN,
    ImageStop.UNUSABLE,
)


def _index(image_size: int = 1 << 20, grace: float = 0.0) -> MemoryIndex:
    index = MemoryIndex(grace=grace, image_size=image_size)
    index.register_node(
        NodeInfo(name="n", regions=(RegionInfo(id=0, size=1 << 30, rkey=5),), endpoints=())
    )
    return index


def _publish(index: MemoryIndex, keys: list[bytes], length: int = 100) -> list[Descriptor]:
    result = index.allocate([AllocationRequest(key=k, length=length) for k in keys])
    grants = [a.descriptor for a in result.allocations]
    assert all(g is not None for g in grants)
    assert all(index.publish([GrantRef.of(g, crc=7) for g in grants if g is not None]))
    return index.resolve(keys)  # type: ignore[return-value]


def _image(index: MemoryIndex) -> tuple[Region, ImageGeometry]:
    region = index.lookup_image()
    assert region is not None
    return region, ImageGeometry.from_header(region.view)


def _keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _bucket_of(region: Region, geometry: ImageGeometry, key: bytes) -> int:
    """The image offset of the bucket holding ``key`` (its tag, in its window)."""
    home = geometry.home(key)
    for bucket in range(home, home + geometry.window):
        at = IMAGE_HEADER_SIZE + bucket * IMAGE_BUCKET_SIZE
        if bytes(region.view[at + 8 : at + 16]) == key[8:16]:
            return at
    raise AssertionError("key not in the image")


def _same_home_keys(geometry: ImageGeometry, home: int, n: int) -> list[bytes]:
    """Keys whose home bucket is ``home`` (its low bits in key[0:8])."""
    return [
        (home | (os.getrandom(4)[0] << geometry.log2_buckets)).to_bytes(8, "little")
        + os.urandom(24)
        for _ in range(n)
    ]


# -- what the index writes ------------------------------------------------------------------


def test_published_entries_are_hits_with_their_descriptors_and_others_are_misses() -> None:
    index = _index()
    keys = _keys(300)
    published = _publish(index, keys[:200])
    region, geometry = _image(index)
    hits, stop, wires = image_prefix(region.view, keys, geometry.image_id)
    assert (hits, stop) == (200, MISS)
    assert Descriptor.many_from_bytes(wires) == published
    assert image_exists(region.view, keys[195:205], geometry.image_id) == (
        True,
        bytes([HIT] * 5 + [MISS] * 5),
    )
    assert index.stats()["image_entries"] == 200


def test_the_image_is_built_from_what_is_published_when_first_asked_for() -> None:
    index = _index()
    keys = _keys(10)
    published = _publish(index, keys)
    pending = _keys(1)
    index.allocate([AllocationRequest(key=pending[0], length=10)])  # granted, not published
    region, geometry = _image(index)
    assert index.lookup_image() is region  # one image per index
    hits, stop, wires = image_prefix(region.view, keys + pending, geometry.image_id)
    assert (hits, stop) == (10, MISS)
    assert Descriptor.many_from_bytes(wires) == published


def test_unpublish_eviction_abort_and_a_departed_node_take_keys_out() -> None:
    index = _index()
    region, geometry = _image(index)
    keys = _keys(40)
    _publish(index, keys)
    assert index.unpublish(keys[:10]) == 10
    assert index.drop_invalid(
        [GrantRef(key=keys[10], version=index.resolve([keys[10]])[0].version)]
    )  # type: ignore[union-attr]
    states = image_exists(region.view, keys, geometry.image_id)[1]
    assert states == bytes([MISS] * 11 + [HIT] * 29)
    registered = index.nodes()[0]
    index.remove_node(registered.id)
    assert image_exists(region.view, keys, geometry.image_id)[1] == bytes([MISS] * 40)
    assert index.stats()["image_entries"] == 0


def test_an_image_size_of_zero_keeps_no_image() -> None:
    assert MemoryIndex(image_size=0).lookup_image() is None


def _resident_bytes(buffer: mmap.mmap) -> int:
    """How much of the mapping holding ``buffer`` is resident (``Rss`` in smaps)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's first line
                start, end = (int(bound, 16) for bound in first.split("-"))
                inside = start <= address < end
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the buffer")


def test_the_image_and_its_use_stamps_are_resident_from_the_start() -> None:
    # A publish writes one bucket per key at random places: left to fault on first write,
    # a fresh index's puts paid a trap per key (a publish of 64 keys took 1.5-3 ms, not <1).
    image = MemoryImage(1 << 20)
    try:
        assert _resident_bytes(image._mapping) >= image.geometry.size
        assert _resident_bytes(image._stamp_pages) >= len(image._stamp_pages)
    finally:
        image.close()


# -- what a probe may conclude ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped field", "odd sequence", "stale check"])
def test_a_torn_bucket_is_never_a_hit_nor_a_miss(damage: str) -> None:
    """As a mirror is probed (each bucket's CRC checked)."""
    index = _index()
    keys = _keys(8)
    _publish(index, keys)
    region, geometry = _image(index)
    at = _bucket_of(region, geometry, keys[3])
    view = region.view
    if damage == "flipped field":
        view[at + 24] ^= 0x01  # the record's offset
    elif damage == "odd sequence":
        struct.pack_into("<I", view, at, struct.unpack_from("<I", view, at)[0] + 1)
    else:
        view[at + 60] ^= 0xFF
    hits, stop, _ = image_prefix(view, keys, geometry.image_id)
    assert (hits, stop) == (3, UNKNOWN)
    assert image_exists(view, keys[3:4], geometry.image_id)[1] == bytes([UNKNOWN])
    # A torn bucket in another key's window hides nothing: that key is still a hit.
    assert image_exists(view, keys[4:5], geometry.image_id)[1] == bytes([HIT])


def test_the_owners_memory_probed_in_place_trusts_the_seqlock_not_the_crc() -> None:
    """Probed in place (``checksums=False``, as a mapped image is), a bucket mid-rewrite
    (odd sequence number, or one that changed under the read) is never a hit nor a miss;
    a whole one is a hit without its CRC being computed."""
    index = _index()
    keys = _keys(8)
    _publish(index, keys)
    region, geometry = _image(index)
    view = region.view
    whole = image_prefix(view, keys, geometry.image_id, checksums=False)
    assert whole == image_prefix(view, keys, geometry.image_id)
    assert whole[:2] == (8, HIT)
    at = _bucket_of(region, geometry, keys[3])
    view[at + 60] ^= 0xFF  # the CRC: not read in place
    assert image_prefix(view, keys, geometry.image_id, checksums=False)[:2] == (8, HIT)
    seq = struct.unpack_from("<I", view, at)[0]
    struct.pack_into("<I", view, at, seq + 1)  # the owner is rewriting it
    assert image_prefix(view, keys, geometry.image_id, checksums=False)[:2] == (3, UNKNOWN)
    states = image_exists(view, keys[3:5], geometry.image_id, checksums=False)[1]
    assert states == bytes([UNKNOWN, HIT])


def _ring(region: Region, geometry: ImageGeometry, first: int, count: int) -> bytearray:
    """Ring entries ``first ..`` as a client lands them."""
    pieces = ring_pieces(geometry, first, count)
    return bytearray(b"".join(bytes(region.view[o : o + n]) for o, n in pieces))


def test_a_mirror_brought_up_to_date_from_the_ring_answers_like_the_image() -> None:
    index = _index()
    keys = _keys(80)
    _publish(index, keys[:30])
    region, geometry = _image(index)
    mirror = bytearray(region.view[: geometry.buckets_end])  # the client's copy
    cursor = ImageGeometry.head_of(region.view)
    _publish(index, keys[30:60])
    index.unpublish(keys[5:6])
    header = bytes(region.view[:IMAGE_HEADER_SIZE])
    head = ImageGeometry.head_of(header)
    assert head - cursor == 31  # one rewrite per publish and per removal
    entries = _ring(region, geometry, cursor, 40)
    assert image_apply(mirror, header, entries, cursor, cursor) == (head, head, RingState.CAUGHT_UP)
    assert image_exists(mirror, keys, geometry.image_id) == image_exists(
        region.view, keys, geometry.image_id
    )
    assert image_prefix(mirror, keys, geometry.image_id)[:2] == (5, MISS)
    # Entries landed for fewer rewrites than logged: applied as far as they go.
    _publish(index, keys[60:80])
    header = bytes(region.view[:IMAGE_HEADER_SIZE])
    entries = _ring(region, geometry, head, 5)
    assert image_apply(mirror, header, entries, head, head) == (
        head + 5,
        head + 20,
        RingState.BEHIND,
    )
    # Nothing new: a mirror already past this header's head stays as it is.
    assert image_apply(mirror, header, b"", head + 20, head + 20)[2] == RingState.CAUGHT_UP


def test_a_torn_or_overwritten_ring_entry_is_never_applied() -> None:
    index = _index(image_size=64 << 10)  # 1,024 buckets, a ring of 256 entries
    region, geometry = _image(index)
    mirror = bytearray(region.view[: geometry.buckets_end])
    keys = _keys(8)
    _publish(index, keys)
    header = bytes(region.view[:IMAGE_HEADER_SIZE])
    entries = _ring(region, geometry, 0, 8)
    entries[3 * RING_ENTRY_SIZE + 40] ^= 1  # inside the bucket bytes of rewrite 3
    cursor, head, state = image_apply(mirror, header, entries, 0, 0)
    assert (cursor, head, state) == (3, 8, RingState.LAPPED)
    assert image_exists(mirror, keys[:3], geometry.image_id)[1] == bytes([HIT] * 3)
    # More rewrites than the ring holds since the cursor: the buckets must be copied again.
    _publish(index, _keys(geometry.ring_length))
    header = bytes(region.view[:IMAGE_HEADER_SIZE])
    assert image_apply(mirror, header, b"", 3, 3)[2] == RingState.LAPPED
    # Another image's header: not applied.
    other = _index()
    other_region, _ = _image(other)
    foreign = bytes(other_region.view[:IMAGE_HEADER_SIZE])
    assert image_apply(mirror, foreign, b"", 3, 3)[2] == RingState.FOREIGN


def test_a_key_with_no_room_in_its_window_is_unknown_until_it_leaves() -> None:
    index = _index(image_size=64 << 10)
    region, geometry = _image(index)
    crowd = _same_home_keys(geometry, home=100, n=geometry.window + 1)
    _publish(index, crowd)
    assert index.stats()["image_spilled"] == 1
    stranger = _same_home_keys(geometry, home=100, n=1)
    states = image_exists(region.view, crowd + stranger, geometry.image_id)[1]
    # Every key of this home that is in the image is a hit; the spilled one and a key that
    # was never stored cannot be told apart from the image: both unknown, never a miss.
    assert states[: geometry.window] == bytes([HIT] * geometry.window)
    assert states[geometry.window :] == bytes([UNKNOWN, UNKNOWN])
    index.unpublish([crowd[-1]])  # the spilled key leaves: the home has no stranger outside
    assert image_exists(region.view, stranger, geometry.image_id)[1] == bytes([MISS])
    index.unpublish(crowd[:1])  # a free bucket, and keys do not move into it
    assert index.stats()["image_spilled"] == 0
    assert image_exists(region.view, crowd[1:-1], geometry.image_id)[1] == bytes(
        [HIT] * (geometry.window - 1)
    )


def test_lookups_that_reach_the_index_are_answered_from_its_image_in_wire_form() -> None:
    index = _index(image_size=64 << 10)
    _, geometry = _image(index)
    crowd = _same_home_keys(geometry, home=7, n=geometry.window + 1)  # the last one spills
    others = [_same_home_keys(geometry, home=200 + n, n=1)[0] for n in range(40)]  # no spill
    stored = _publish(index, others + crowd)
    keys = [d.key for d in stored]
    assert index.stats()["image_spilled"] == 1
    # Every key found: the image's run, then the entries' answer for the spilled key, all in
    # wire form and equal to what the entries hold.
    copies = index.lookup_copies(keys)
    assert isinstance(copies.descriptors, PackedDescriptors)
    assert list(copies.descriptors) == stored
    assert copies.descriptors.wires == b"".join(d.to_bytes() for d in stored)
    # A key never stored ends the run, whether the image or the entries answer for it.
    assert list(index.lookup_copies([*keys[:5], _keys(1)[0], *keys[5:]]).descriptors) == stored[:5]
    after_spill = [*keys, _same_home_keys(geometry, home=7, n=1)[0], keys[0]]
    assert list(index.lookup_copies(after_spill).descriptors) == stored
    assert index.lookup_copies(_keys(1)).descriptors == []
    # exists: the image's states, the entries where it cannot tell (the spilled key, a key
    # of the crowded home never stored).
    stranger = _same_home_keys(geometry, home=7, n=1)[0]
    assert index.exists([keys[0], crowd[-1], stranger, _keys(1)[0]]) == [True, True, False, False]
    # A key that is not 32 bytes names no entry: a miss, as the entries would answer.
    assert list(index.lookup_copies([keys[0], b"short", keys[1]]).descriptors) == stored[:1]
    assert index.exists([keys[0], b"short"]) == [True, False]
    stats = index.stats()
    assert stats["prefix_hits"] == 2 * len(keys) + 5 + 1
    assert stats["lookup_keys"] == len(keys) + (len(keys) + 1) + len(after_spill) + 1 + 3


def test_the_owners_probes_stamp_the_buckets_they_hit_and_only_those() -> None:
    index = _index()
    region, geometry = _image(index)
    keys = _keys(3)
    _publish(index, keys)
    slots = [
        (_bucket_of(region, geometry, k) - IMAGE_HEADER_SIZE) // IMAGE_BUCKET_SIZE for k in keys
    ]
    stamps = memoryview(bytearray(8 * (geometry.buckets + geometry.window - 1))).cast("d")
    absent = _keys(1)
    assert image_prefix(
        region.view,
        [keys[0], *absent, keys[1]],
        geometry.image_id,
        checksums=False,
        stamps=stamps,
        now=5.0,
    )[:2] == (1, MISS)
    _, states = image_exists(
        region.view, [keys[2], *absent], geometry.image_id, stamps=stamps, now=7.0
    )
    assert states == bytes([HIT, MISS])
    assert [stamps[s] for s in slots] == [5.0, 0.0, 7.0]  # key 1 lay past the miss
    assert sum(stamps) == 12.0
    with pytest.raises(ValueError, match="stamps"):
        image_prefix(region.view, keys, geometry.image_id, stamps=bytearray(8), now=1.0)


def test_a_key_taking_a_freed_bucket_does_not_inherit_its_last_use() -> None:
    image = MemoryImage(64 << 10)
    first, second = _publish(_index(), _same_home_keys(image.geometry, home=3, n=2))
    image.put(first)
    assert image.prefix([first.key], 9.0)[:2] == (1, HIT)
    assert image.last_use(first.key) == 9.0
    image.remove(first.key)
    image.put(second)  # the first free bucket of its window: the one the first key left
    assert image.last_use(second.key) == 0.0
    assert image.last_use(first.key) == 0.0  # not in the image
    image.close()


def test_another_image_a_bad_header_or_a_stopped_owner_is_unusable() -> None:
    index = _index()
    keys = _keys(4)
    _publish(index, keys)
    region, geometry = _image(index)
    assert image_prefix(region.view, keys, geometry.image_id + 1)[:2] == (0, UNUSABLE)
    assert image_exists(region.view, keys, geometry.image_id + 1) == (False, bytes([UNKNOWN] * 4))
    # Fresh heartbeat: trusted; a stopped owner (closed, or silent past max_age): not.
    index.tick()
    assert image_prefix(region.view, keys, geometry.image_id, 2.0)[:2] == (4, HIT)
    image_beat(region.view, False)
    assert image_prefix(region.view, keys, geometry.image_id, 2.0)[:2] == (0, UNUSABLE)
    index.tick()
    assert image_prefix(region.view, keys, geometry.image_id, 2.0)[:2] == (4, HIT)
    header = bytearray(region.view[:IMAGE_HEADER_SIZE])
    header[12] ^= 1  # the bucket count: the header check fails
    copy = bytes(header) + bytes(region.view[IMAGE_HEADER_SIZE:])
    assert image_prefix(copy, keys, geometry.image_id)[:2] == (0, UNUSABLE)


def test_keys_that_are_not_32_bytes_are_refused_by_the_probe() -> None:
    index = _index()
    region, geometry = _image(index)
    with pytest.raises(TypeError, match="key 1"):
        image_prefix(region.view, [os.urandom(32), b"short"], geometry.image_id)
    # Checked as the walk reaches them, and after a walk that stopped early: a bad key
    # behind a miss, or in an image that cannot answer, raises all the same.
    keys = _keys(3)
    _publish(index, keys[:1])
    region, geometry = _image(index)
    for checksums in (True, False):
        with pytest.raises(TypeError, match="key 2"):
            image_prefix(region.view, [*keys[:2], b"short"], geometry.image_id, checksums=checksums)
        with pytest.raises(TypeError, match="key 2"):
            image_exists(region.view, [*keys[:2], 7], geometry.image_id, checksums=checksums)  # type: ignore[list-item]
        with pytest.raises(TypeError, match="key 1"):
            image_prefix(region.view, [keys[0], b"short"], geometry.image_id + 1)


# -- the store, embedded ------------------------------------------------------------------------


def _chain(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def _value(key: bytes, size: int = 512) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_an_embedded_lookup_reads_the_image_and_costs_no_index_call(n: int) -> None:
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys = _chain(n + 1)
        store.batched_put(keys[:n], [_value(k) for k in keys[:n]])
        before = store.stats()
        assert store.batched_contains(keys) == n
        assert [bytes(v) for v in store.batched_get(keys[:n]) if v is not None] == [
            _value(k) for k in keys[:n]
        ]
        after = store.stats()
    assert after["control_rpcs"] == before["control_rpcs"]
    assert after["onesided_lookups"] - before["onesided_lookups"] == 1
    assert after["prefetch_hits"] - before["prefetch_hits"] == n
    assert after["image_fallbacks"] == after["image_round_trips"] == 0


def _tear(view: memoryview, at: int) -> int:
    """Make the bucket at ``at`` read as mid-rewrite (odd sequence number), as a store
    probing its index's image in place sees it; returns its sequence number before."""
    seq: int = struct.unpack_from("<I", view, at)[0]
    struct.pack_into("<I", view, at, seq + 1)
    return seq


def test_a_torn_bucket_makes_the_store_ask_the_index_once_for_the_rest() -> None:
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys = _chain(16)
        store.batched_put(keys, [_value(k) for k in keys])
        region, geometry = _image(store.local_index)
        at = _bucket_of(region, geometry, keys[5])
        seq = _tear(region.view, at)
        index_before = store.local_index.stats()
        before = store.stats()
        assert store.batched_contains(keys) == 16
        after = store.stats()
        assert after["control_rpcs"] - before["control_rpcs"] == 1
        assert after["image_fallbacks"] - before["image_fallbacks"] == 1
        assert after["onesided_lookups"] == before["onesided_lookups"]
        index_after = store.local_index.stats()
        # The index was asked for the keys from the torn one on, not for the first five.
        assert index_after["lookup_keys"] - index_before["lookup_keys"] == 11
        assert [bytes(v) for v in store.batched_get(keys) if v is not None] == [
            _value(k) for k in keys
        ]
        struct.pack_into("<I", region.view, at, seq)  # the rewrite done
        assert store.batched_contains(keys) == 16
        assert store.stats()["control_rpcs"] == after["control_rpcs"]


def test_exists_asks_the_index_only_for_keys_the_image_cannot_answer() -> None:
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys = _chain(8)
        store.batched_put(keys[::2], [_value(k) for k in keys[::2]])
        before = store.stats()
        assert store.batched_exists(keys) == [True, False] * 4
        assert store.stats()["control_rpcs"] == before["control_rpcs"]
        region, geometry = _image(store.local_index)
        at = _bucket_of(region, geometry, keys[2])
        _tear(region.view, at)
        index_before = store.local_index.stats()["exists_calls"]
        assert store.batched_exists(keys) == [True, False] * 4
        assert store.stats()["control_rpcs"] - before["control_rpcs"] == 1
        assert store.local_index.stats()["exists_calls"] - index_before == 1


@pytest.mark.parametrize("change", ["other keys", "reversed", "not keys", "shortened"])
def test_a_lookups_list_changed_by_the_caller_afterwards_never_reads_another_value(
    change: str,
) -> None:
    """A lookup from the image keeps the caller's list, not a copy: changing it before the
    read may cost the read its cached descriptors, never the right value."""
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys, others = _chain(8), _chain(8)
        store.batched_put(keys + others, [_value(k) for k in keys + others])
        asked = list(keys)
        assert store.batched_contains(asked) == 8
        if change == "other keys":
            asked[:] = others
        elif change == "reversed":
            asked.reverse()
        elif change == "not keys":
            asked[:] = [[0], None, 3, {}, b"short", "text", 1.5, ()]
        else:
            del asked[2:]
        for wanted in (keys, others, keys[::-1]):
            got = store.batched_get(wanted)
            assert [bytes(v) for v in got if v is not None] == [_value(k) for k in wanted]
        # The use report (sent from a thread each second, or here at once if it has not
        # gone yet) sends what is a key and nothing else.
        store._touches.flush()
        after = store.stats()
        assert after["touch_rpcs"] == 1
        assert after["touch_failures"] == 0
        assert after["validation_failures"] == 0


def test_an_index_without_an_image_is_asked_as_before() -> None:
    with kvfabric.connect("embedded://?capacity=64MiB&memory.image=0") as store:
        keys = _chain(4)
        store.batched_put(keys, [_value(k) for k in keys])
        before = store.stats()
        assert store.batched_contains(keys) == 4
        assert store.stats()["control_rpcs"] - before["control_rpcs"] == 1
        assert store.stats()["onesided_lookups"] == 0


def test_keys_hit_in_the_image_reach_the_index_in_one_background_report() -> None:
    with kvfabric.connect("embedded://?capacity=64MiB") as store:
        keys = _chain(32)
        store.batched_put(keys, [_value(k) for k in keys])
        index = store.local_index
        before = index.stats()
        rpcs = store.stats()["control_rpcs"]
        for _ in range(5):
            assert store.batched_contains(keys) == 32
        wait_for("the background report", lambda: store.stats()["touch_rpcs"])
        after = index.stats()
        assert store.stats()["touch_rpcs"] == 1
        assert store.stats()["control_rpcs"] == rpcs  # reports are not lookups' RPCs
        assert after["touches"] - before["touches"] == 1
        assert after["touched_keys"] - before["touched_keys"] == 32  # deduplicated
        assert after["lookups"] == before["lookups"]


def test_bad_keys_are_refused_with_the_stores_error() -> None:
    with kvfabric.connect("embedded://?capacity=8MiB") as store:
        with pytest.raises(kvfabric.InvalidKeyError):
            store.batched_contains([os.urandom(32), b"short"])
        with pytest.raises(kvfabric.InvalidKeyError):
            store.batched_exists(["not bytes" * 4])  # type: ignore[list-item]


# -- racing writers ------------------------------------------------------------------------------


def test_lookups_racing_with_puts_deletes_and_evictions_never_read_another_keys_value() -> None:
    """Writers put, delete and (a store a few times too small) evict while readers look up
    and read: every value read is its own key's, and lookups mostly answer from the image."""
    url = f"embedded://race-{uuid.uuid4().hex[:8]}?capacity=4MiB&grace=0"
    keys = _chain(2048)
    values = {k: _value(k, 4096) for k in keys}
    stop = threading.Event()
    wrong: list[bytes] = []
    errors: list[BaseException] = []
    stores: list[Store] = []
    rounds = {"writes": 0, "reads": 0}

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with kvfabric.connect(url) as store:
            while not stop.is_set():
                rounds["writes"] += 1
                start = int(rng.integers(0, len(keys) - 64))
                batch = keys[start : start + int(rng.integers(1, 64))]
                outcomes = store.batched_put(batch, [values[k] for k in batch])
                assert PutOutcome.FAILED not in outcomes
                if rng.random() < 0.3:
                    store.delete(batch[: len(batch) // 2])

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        store = kvfabric.connect(url)
        stores.append(store)
        while not stop.is_set():
            rounds["reads"] += 1
            start = int(rng.integers(0, len(keys) - 64))
            batch = keys[start : start + 64]
            hits = store.batched_contains(batch)
            for key, value in zip(batch[:hits], store.batched_get(batch[:hits]), strict=True):
                if value is not None and bytes(value) != values[key]:
                    wrong.append(key)

    def guarded(target: object, seed: int) -> None:
        try:
            target(seed)  # type: ignore[operator]
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            stop.set()

    with kvfabric.connect(url):  # keeps the shared store open for the threads
        threads = [threading.Thread(target=guarded, args=(writer, s)) for s in range(2)]
        threads += [threading.Thread(target=guarded, args=(reader, 10 + s)) for s in range(2)]
        for thread in threads:
            thread.start()
        try:
            # A count of rounds, not a time: a busy machine makes the race longer, never
            # smaller (an error in a thread ends it early: stop is set).
            wait_for(
                "500 rounds of writes raced by 500 rounds of reads",
                lambda: stop.is_set() or min(rounds.values()) >= 500,
            )
        finally:
            stop.set()
        for thread in threads:
            thread.join(30)
        counts = [store.stats() for store in stores]
        for store in stores:
            store.close()
    assert not errors, errors
    assert wrong == []
    lookups = sum(c["lookups"] for c in counts)
    onesided = sum(c["onesided_lookups"] for c in counts)
    print(
        f"{lookups} lookups, {onesided} one-sided, {sum(c['image_fallbacks'] for c in counts)} "
        f"fell back; {sum(c['get_hits'] for c in counts)} values read, "
        f"{sum(c['validation_failures'] for c in counts)} stale descriptors caught "
        f"in {rounds['writes']} rounds of writes and {rounds['reads']} of reads"
    )
    assert onesided > 0


# -- the prefetch cache keeps a lookup's wire forms ---------------------------------------------


def test_descriptors_from_wire_forms_are_built_when_taken() -> None:
    from kvfabric._client.prefetch import PrefetchCache

    cache = PrefetchCache(max_entries=8, ttl=5)
    descriptors = [
        Descriptor(
            key=os.urandom(32), node=1, region=0, offset=i * 64, length=1, rkey=3, version=i, crc=0
        )
        for i in range(6)
    ]
    wires = b"".join(d.to_bytes() for d in descriptors)
    assert len(wires) == 6 * DESCRIPTOR_SIZE
    keys = [d.key for d in descriptors]
    cache.remember_wires(keys, wires)
    cache.remember_wires(list(keys), wires)  # the same run again replaces it
    cache.remember(descriptors[4:])
    assert len(cache) == 6
    assert cache.take(keys[::-1]) == descriptors[::-1]
    cache.remember_wires([os.urandom(32) for _ in range(4)], wires[: 4 * DESCRIPTOR_SIZE])
    assert cache.take(keys[:4]) == [None] * 4  # the oldest made room
    # Keys 4 and 5 are held twice (two lookups found them), so 6 keys fill the 8 entries.
    assert len(cache) == 6
    assert cache.take(keys[4:]) == descriptors[4:]


def test_the_image_header_says_when_the_data_nodes_changed() -> None:
    index = MemoryIndex(grace=0.0)
    region = index.lookup_image()
    assert region is not None

    def generation() -> int:
        ImageGeometry.from_header(region.view)  # its check still holds
        return ImageGeometry.nodes_generation_of(region.view)

    before = generation()
    node = index.register_node(
        NodeInfo(name="n", regions=(RegionInfo(id=1, size=1 << 20, rkey=5),), endpoints=())
    )
    assert generation() == before + 1
    (extent,) = index.lease_extents(4096, 4096, 1)
    assert extent.nodes_generation == before + 1
    index.remove_node(node.id)
    assert generation() == before + 2
    index.close()


def test_extents_leased_before_the_nodes_changed_are_given_back_unwritten() -> None:
    with kvfabric.connect(f"embedded://{uuid.uuid4().hex}") as store:
        index = store.local_index
        assert index is not None
        assert store.batched_put(_keys(4), [b"v" * 100] * 4) == [PutOutcome.STORED] * 4
        assert index.stats()["extents"] == 1
        # Another node registers: the image's nodes generation moves on.
        index.register_node(NodeInfo(name="elsewhere", regions=(), endpoints=()))
        assert store.batched_put(_keys(4), [b"w" * 100] * 4) == [PutOutcome.STORED] * 4
        stats = index.stats()
        assert (stats["extents_returned"], stats["carve_refused"], stats["extents"]) == (1, 0, 1)
