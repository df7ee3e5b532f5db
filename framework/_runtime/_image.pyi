# Types of the C extension built from csrc/image.c (contracts: kvfabric._runtime.image).
from collections.abc import Sequence

from _typeshed import ReadableBuffer, WriteableBuffer

def image_store(
    image: WriteableBuffer, bucket: int, wire: bytes | None, overflow: int, /
) -> None: ...
def image_beat(image: WriteableBuffer, alive: bool, /) -> None: ...
def first_bad_key(keys: Sequence[object], /) -> int: ...
def image_prefix(
    image: ReadableBuffer,
    keys: Sequence[bytes],
    image_id: int,
    max_age: float,
    checksums: bool = True,
    stamps: WriteableBuffer | None = None,
    now: float = 0.0,
    /,
) -> tuple[int, int, bytes]: ...
def image_exists(
    image: ReadableBuffer,
    keys: Sequence[bytes],
    image_id: int,
    max_age: float,
    checksums: bool = True,
    stamps: WriteableBuffer | None = None,
    now: float = 0.0,
    /,
) -> tuple[bool, bytes]: ...
def image_apply(
    mirror: WriteableBuffer,
    header: ReadableBuffer,
    entries: ReadableBuffer,
    first: int,
    cursor: int,
    /,
) -> tuple[int, int, int]: ...
