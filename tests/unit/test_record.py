from __future__ import annotations

import pytest

from kvfabric._runtime.record import (
    HEADER_SIZE,
    SLOT_ALIGN,
    Failure,
    checksum,
    pack_header,
    pack_headers,
    parse_header,
    record_size,
    validate_record,
)
from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor
from kvfabric.errors import ProtocolError, ValidationError

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))
PAYLOAD = b"kv bytes " * 100


def _descriptor(**overrides: int | bytes) -> Descriptor:
    fields: dict[str, int | bytes] = {
        "key": KEY,
        "node": 1,
        "region": 0,
        "offset": 4096,
        "length": len(PAYLOAD),
        "rkey": 0xDEADBEEF,
        "version": 7,
        "crc": checksum(PAYLOAD),
    }
    fields.update(overrides)
    return Descriptor(**fields)  # type: ignore[arg-type]


def test_checksum_is_crc32c() -> None:
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_descriptor_wire_form_round_trips() -> None:
    d = _descriptor()
    data = d.to_bytes()
    assert len(data) == DESCRIPTOR_SIZE
    assert Descriptor.from_bytes(data) == d
    with pytest.raises(ProtocolError):
        Descriptor.from_bytes(data[:-1])


@pytest.mark.parametrize(
    ("field", "value"),
    [("key", b"short"), ("node", -1), ("region", 2**32), ("version", 2**64), ("crc", 2**32)],
)
def test_descriptor_validates_its_fields(field: str, value: int | bytes) -> None:
    with pytest.raises(ValueError, match=field):
        _descriptor(**{field: value})


def test_a_trusted_descriptor_and_one_given_a_crc_equal_the_checked_ones() -> None:
    d = _descriptor()
    fields = {name: getattr(d, name) for name in ("key", "node", "region", "offset")}
    fields |= {name: getattr(d, name) for name in ("length", "rkey", "version", "crc")}
    trusted = Descriptor.trusted(**fields)
    assert trusted == d
    assert trusted.to_bytes() == d.to_bytes()
    published = d.with_crc(0xDEADBEEF)
    assert published == _descriptor(crc=0xDEADBEEF)
    assert published.to_bytes() == _descriptor(crc=0xDEADBEEF).to_bytes()
    assert d.crc != 0xDEADBEEF  # the original is unchanged
    with pytest.raises(ValueError, match="crc"):
        d.with_crc(2**32)


def test_record_size_aligns_header_plus_payload() -> None:
    assert record_size(0) == HEADER_SIZE
    assert record_size(1) == HEADER_SIZE + SLOT_ALIGN
    assert record_size(SLOT_ALIGN) == HEADER_SIZE + SLOT_ALIGN


def test_a_good_record_validates() -> None:
    header = pack_header(KEY, 7, len(PAYLOAD), checksum(PAYLOAD))
    assert len(header) == HEADER_SIZE
    validate_record(header, PAYLOAD, _descriptor(), KEY)
    parsed = parse_header(header)
    assert (parsed.key, parsed.version, parsed.length) == (KEY, 7, len(PAYLOAD))


def test_a_batch_of_headers_packed_at_once_equals_each_packed_alone() -> None:
    keys = [KEY, OTHER, bytes(32)]
    versions, lengths, crcs = [7, 2**64 - 1, 0], [len(PAYLOAD), 0, 2**40], [1, 2**32 - 1, 0]
    packed = pack_headers(keys, versions, lengths, crcs)
    assert packed == b"".join(map(pack_header, keys, versions, lengths, crcs))
    assert parse_header(packed[HEADER_SIZE : 2 * HEADER_SIZE]).key == OTHER
    assert pack_headers([], [], [], []) == b""


@pytest.mark.parametrize(
    ("keys", "versions", "lengths", "crcs", "error"),
    [
        ([KEY[:31]], [1], [1], [1], TypeError),
        ([KEY], [-1], [1], [1], ValueError),
        ([KEY], [1], [1], [2**32], ValueError),
        ([KEY], [1, 2], [1], [1], ValueError),
    ],
)
def test_a_batch_of_headers_refuses_what_one_header_cannot_hold(
    keys: list[bytes], versions: list[int], lengths: list[int], crcs: list[int], error: type
) -> None:
    with pytest.raises(error, match="pack_headers"):
        pack_headers(keys, versions, lengths, crcs)


def _fails(failure: Failure, header: bytes, payload: bytes, d: Descriptor, key: bytes) -> None:
    with pytest.raises(ValidationError, match=failure.value):
        validate_record(header, payload, d, key)


def test_each_kind_of_bad_record_is_refused() -> None:
    crc = checksum(PAYLOAD)
    good = pack_header(KEY, 7, len(PAYLOAD), crc)
    d = _descriptor()
    _fails(Failure.MAGIC, b"XXXX" + good[4:], PAYLOAD, d, KEY)
    _fails(Failure.MAGIC, bytes(HEADER_SIZE), PAYLOAD, d, KEY)  # zeroed slot
    flipped = bytearray(good)
    flipped[20] ^= 1
    _fails(Failure.HEADER_CRC, bytes(flipped), PAYLOAD, d, KEY)
    _fails(Failure.KEY, pack_header(OTHER, 7, len(PAYLOAD), crc), PAYLOAD, d, KEY)
    _fails(Failure.KEY, good, PAYLOAD, d, OTHER)  # the key asked for differs
    _fails(Failure.VERSION, pack_header(KEY, 8, len(PAYLOAD), crc), PAYLOAD, d, KEY)
    _fails(Failure.LENGTH, good, PAYLOAD[:-1], d, KEY)
    corrupted = bytearray(PAYLOAD)
    corrupted[500] ^= 0x10
    _fails(Failure.CRC, good, bytes(corrupted), d, KEY)
    _fails(Failure.CRC, good, PAYLOAD, _descriptor(crc=crc ^ 1), KEY)
