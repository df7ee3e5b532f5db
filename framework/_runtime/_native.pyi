# Types of the C extension built from csrc/ (contracts: kvfabric._runtime.native), grouped by
# the C file that holds each (csrc/module.c lists them).
from collections.abc import Sequence

from _typeshed import FileDescriptorLike, ReadableBuffer, WriteableBuffer

# module.c
GIL_RELEASE_MIN: int
IOV_MAX: int
CRC32C_PASS: str
CRC32C_PASSES: tuple[str, ...]

# sockets.c raises it
class PeerClosed(ConnectionError):
    received: int

# crc_batch.c
def crc32c(data: ReadableBuffer, value: int = 0, /) -> int: ...
def crc32c_with(pass_name: str, data: ReadableBuffer, value: int = 0, /) -> int: ...
def copy_crc32c_with(
    pass_name: str, dest: WriteableBuffer, src: ReadableBuffer, value: int = 0, /
) -> int: ...
def crc32c_many(
    values: Sequence[ReadableBuffer | Sequence[ReadableBuffer]],
    initial: Sequence[int] | None = None,
) -> list[int]: ...

# headers.c
def pack_headers(
    keys: Sequence[bytes], versions: Sequence[int], lengths: Sequence[int], crcs: Sequence[int], /
) -> bytes: ...

# copies.c
def copy_many(
    pairs: Sequence[tuple[WriteableBuffer, ReadableBuffer]],
    crc_spans: Sequence[tuple[int, int]] | None = None,
    crc_of_source: bool = False,
    threads: int = 1,
) -> list[int]: ...

# prefault.c
def prefault(buffer: ReadableBuffer, write: bool = True, force_touch: bool = False) -> bool: ...

# sockets.c
def send_all(
    fd: FileDescriptorLike, buffers: Sequence[ReadableBuffer], deadline: float | None
) -> int: ...
def send_checksummed(
    fd: FileDescriptorLike,
    buffers: Sequence[ReadableBuffer],
    deadline: float | None,
    crc_spans: Sequence[tuple[int, int]],
) -> list[int]: ...
def serve_reads(
    fd: FileDescriptorLike,
    regions: Sequence[tuple[int, int, ReadableBuffer, int]],
    counters: WriteableBuffer,
    idle_since: WriteableBuffer,
    header: WriteableBuffer,
    idle_timeout: float,
    frame_timeout: float,
    max_batch_bytes: int,
    busy_poll: float = 0.0,
) -> tuple[int, int]: ...
def recv_into_all(
    fd: FileDescriptorLike,
    buffers: Sequence[WriteableBuffer],
    deadline: float | None,
    crc_spans: Sequence[tuple[int, int]] | None = None,
) -> list[int]: ...

# exchange.c
def request_reply(
    fd: FileDescriptorLike,
    request: Sequence[ReadableBuffer],
    reply: WriteableBuffer,
    payloads: Sequence[WriteableBuffer],
    deadline: float | None,
    status_offset: int = 0,
    crc_spans: Sequence[tuple[int, int]] | None = None,
    busy_poll: float = 0.0,
    hold_gil: float = 0.0,
) -> list[int]: ...

# One lane of request_reply_lanes: fd, request, reply, payloads, status_offset, crc_spans.
LaneArgs = tuple[
    FileDescriptorLike,
    Sequence[ReadableBuffer],
    WriteableBuffer,
    Sequence[WriteableBuffer],
    int,
    Sequence[tuple[int, int]] | None,
]

def request_reply_lanes(
    lanes: Sequence[LaneArgs],
    deadline: float | None,
    busy_poll: float = 0.0,
) -> list[list[int]]: ...

# module.c
def gil_reacquisitions() -> int: ...
def gil_handoffs() -> int: ...
def parallel_copies() -> int: ...

# mutex.c
class Mutex:
    def acquire(self) -> bool: ...
    def release(self) -> None: ...
    def locked(self) -> bool: ...
    def __enter__(self) -> bool: ...
    def __exit__(self, *exc: object) -> None: ...

# ucp.c
def ucp_post(
    rma: int,
    flush: int,
    ep: int,
    param: int,
    buffers: Sequence[ReadableBuffer],
    remote: Sequence[tuple[int, int]],
    put: bool,
) -> tuple[int, list[int]]: ...
def ucp_wait(
    fns: Sequence[int],
    worker: int,
    efd: int,
    requests: Sequence[int],
    mutex: Mutex,
    deadline: float | None,
    spins: int,
    idle_ms: int,
    crc_buffers: Sequence[ReadableBuffer] | None = None,
    crc_spans: Sequence[tuple[int, int]] | None = None,
    crc_first: bool = False,
    try_first: bool = False,
) -> tuple[int, list[int], list[int]]: ...
