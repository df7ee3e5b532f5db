"""The backend plug point: what gives a data node its memory.

A backend hands out *regions* — contiguous memory areas — that transports register and the
index carves into slots. Backends are selected by entry-point name (group
``kvfabric.backends``) and declare what kind of memory they give as data on the class.
"""

from __future__ import annotations

import abc
import enum
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from kvfabric.spi.options import Plugin

__all__ = ["Backend", "BackendConfig", "MemoryKind", "Region", "new_rkey"]


class MemoryKind(enum.Enum):
    DRAM = "dram"
    FILE = "file"
    CUDA = "cuda"


def new_rkey() -> int:
    """A random 64-bit capability: knowing it is what entitles a client to a region."""
    return secrets.randbits(64) or 1


@attrs.frozen(kw_only=True)
class Region:
    """A contiguous memory area a backend gives to a data node.

    ``path`` is set when another process on this host can open and map the same memory
    (``path_offset`` bytes into that file); transports such as ``shm`` require it.
    """

    id: int
    size: int
    rkey: int
    kind: MemoryKind
    view: memoryview = attrs.field(eq=False, repr=False)
    path: str | None = None
    path_offset: int = 0


@attrs.frozen(kw_only=True)
class BackendConfig:
    capacity: int
    region_size: int = 1 << 30
    path: str | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict)
    """The backend's declared options, parsed (every one present, defaulted if not given)."""


class Backend(Plugin, abc.ABC):
    """Owns a data node's regions for the node's lifetime."""

    memory_kind: ClassVar[MemoryKind]
    shareable: ClassVar[bool]
    """True when regions carry a ``path`` another local process can map."""
    persistent: ClassVar[bool] = False
    """True when regions can hold records from before this process started (files): the
    node scans them before its first registration. Memory that starts empty is scanned
    only when the node registers again (its controller restarted) — scanning fresh memory
    would find nothing, and would commit every page of it."""

    @abc.abstractmethod
    def __init__(self, config: BackendConfig) -> None: ...

    @abc.abstractmethod
    def regions(self) -> Sequence[Region]:
        """The regions, in id order; fixed for the backend's lifetime."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory. Views handed out earlier must not be used afterwards."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
