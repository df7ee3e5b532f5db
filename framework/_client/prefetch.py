"""The prefetch cache: descriptors a lookup already resolved, kept for the read that follows.

Per client, thread-safe, bounded by entry count and by age. It holds only leading runs of
hits from recent lookups, and is a speed shortcut, never a source of truth: every read is
validated, and a descriptor that fails validation is dropped and resolved again.

A lookup hands over its run of hits as one *batch* — its keys and their descriptors, as
objects or, from the lookup image, as wire bytes — and pays nothing per key: filling a dict
and building a ``Descriptor`` per key would cost more than a lookup from the image itself.
The per-key work happens when a read takes them: batches
are indexed by key then (newest wins) and descriptors built from their wire form one at a
time. A lookup that no read follows never pays for it.

Where values have copies on several nodes, a batch also keeps each key's other copies as
the lookup returned them, for the read to fall over to. A batch from the lookup image, or
handed over by another process, does not hold them: a read that needs them asks the image.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice, repeat

from kvfabric.descriptor import DESCRIPTOR_SIZE, Descriptor

__all__ = ["PrefetchCache"]


Alternates = Mapping[int, tuple[Descriptor, ...]]


class _Batch:
    """One lookup's hits: ``keys[i]``'s descriptor is ``descriptors[i]`` or the i-th wire
    form in ``wires``, its other copies ``alternates[i]`` (absent: none known). Entries
    before ``start`` were pushed out by newer ones.

    ``keys`` may be the caller's own list (a lookup from the image does not copy it): a
    caller that changes it afterwards can make an entry find the wrong position, so a
    descriptor from ``wires`` counts only if its own key is the key asked for, and only the
    first ``count`` keys (as many as at the lookup) are ever indexed."""

    __slots__ = (
        "absorbed",
        "alternates",
        "count",
        "descriptors",
        "expires",
        "keys",
        "positions",
        "start",
        "wires",
    )

    def __init__(
        self,
        keys: Sequence[bytes],
        expires: float,
        *,
        descriptors: Sequence[Descriptor] = (),
        wires: bytes = b"",
        alternates: Alternates | None = None,
    ) -> None:
        self.keys = keys
        self.count = len(keys)
        self.expires = expires
        self.descriptors = descriptors
        self.wires = wires
        self.alternates = alternates
        self.start = 0
        self.absorbed = False
        self.positions: dict[bytes, int] | None = None

    def live(self) -> int:
        return self.count - self.start

    def find(self, key: bytes) -> int | None:
        if self.positions is None:
            try:
                # strict=False: the caller may have shortened its list since.
                pairs = zip(islice(self.keys, self.count), range(self.count), strict=False)
                self.positions = dict(pairs)
            except TypeError:  # a key the caller replaced by something unhashable
                self.positions = {}
        i = self.positions.get(key)
        return None if i is None or i < self.start else i


def _same_run(a: Sequence[bytes], b: Sequence[bytes]) -> bool:
    """Whether two runs of keys are the same lookup, told in O(1): same length, same first
    and last key (chained keys name their whole prefix; a rare false match only costs a
    prefetch miss)."""
    return len(a) == len(b) and a[0] == b[0] and a[-1] == b[-1]


class PrefetchCache:
    def __init__(
        self,
        *,
        max_entries: int = 65536,
        ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0 or ttl < 0:
            raise ValueError("max_entries and ttl must not be negative")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._batches: deque[_Batch] = deque()
        """Every batch with live entries, oldest first."""
        self._entries = 0
        """Live entries over all batches (a key in two batches counts twice)."""
        self._pending: list[_Batch] = []
        """Batches not indexed yet, oldest first."""
        self._index: dict[bytes, _Batch] = {}
        """Key -> the newest indexed batch holding it."""

    def __len__(self) -> int:
        with self._lock:
            self._absorb()
            return len(self._index)

    def remember(
        self, descriptors: Sequence[Descriptor], alternates: Alternates | None = None
    ) -> None:
        """Keep a lookup's leading run of hits; the oldest entries make room.

        ``alternates``: position -> the other copies of that key, as the lookup returned
        them (keys stored once are absent).
        """
        if self.max_entries == 0 or not descriptors:
            return
        expires = self._clock() + self.ttl
        self._add(
            _Batch(
                [d.key for d in descriptors],
                expires,
                descriptors=descriptors,
                alternates=alternates,
            )
        )

    def remember_wires(
        self, keys: Sequence[bytes], wires: bytes, alternates: Alternates | None = None
    ) -> None:
        """The same for descriptors given as wire forms, one per key in order."""
        if self.max_entries == 0 or not keys:
            return
        self._add(_Batch(keys, self._clock() + self.ttl, wires=wires, alternates=alternates))

    def take(self, keys: Sequence[bytes]) -> list[Descriptor | None]:
        """The cached descriptor of each key (``None`` if absent or expired)."""
        return self.take_copies(keys)[0]

    def take_copies(
        self, keys: Sequence[bytes]
    ) -> tuple[list[Descriptor | None], dict[int, tuple[Descriptor, ...]]]:
        """The cached descriptor of each key, and by position the other copies known of
        those that have some."""
        with self._lock:
            self._absorb()
            now = self._clock()
            index = self._index
            out: list[Descriptor | None] = []
            others: dict[int, tuple[Descriptor, ...]] = {}
            for key in keys:
                batch = index.get(key)
                found = None
                if batch is not None:
                    i = batch.find(key) if batch.expires > now else None
                    if i is None:
                        del index[key]
                    else:
                        if batch.descriptors:
                            found = batch.descriptors[i]
                        else:
                            found = Descriptor.from_bytes(batch.wires, i * DESCRIPTOR_SIZE)
                            if found.key != key:  # the caller changed its list of keys
                                found = None
                        if batch.alternates and i in batch.alternates:
                            others[len(out)] = batch.alternates[i]
                out.append(found)
            return out, others

    def drop(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._absorb()
            for key in keys:
                self._index.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._batches.clear()
            self._pending.clear()
            self._index.clear()
            self._entries = 0

    # -- internals -------------------------------------------------------------------------

    def _add(self, batch: _Batch) -> None:
        with self._lock:
            excess = batch.count - self.max_entries
            if excess > 0:
                batch.start = excess
            last = self._batches[-1] if self._batches else None
            if last is not None and not last.absorbed and _same_run(last.keys, batch.keys):
                # The same lookup again before any read (an engine polling a waiting
                # request): the newer batch replaces it, so the cache does not fill with
                # copies of one run (and the copy's memory is reused while warm).
                self._batches.pop()
                self._pending.pop()
                self._entries -= last.live()
            self._batches.append(batch)
            self._pending.append(batch)
            self._entries += batch.live()
            self._trim()

    def _absorb(self) -> None:
        """Index the batches remembered since the last read (newer ones win)."""
        index = self._index
        for batch in self._pending:
            if batch.live() > 0:
                keys = islice(batch.keys, batch.start, batch.count)
                with contextlib.suppress(TypeError):  # an unhashable key the caller put in
                    index.update(zip(keys, repeat(batch)))
                batch.absorbed = True
        self._pending.clear()

    def _trim(self) -> None:
        """Push the oldest entries out until the bound holds."""
        while self._entries > self.max_entries:
            oldest = self._batches[0]
            gone = min(oldest.live(), self._entries - self.max_entries)
            if oldest.absorbed:
                index = self._index
                with contextlib.suppress(TypeError):  # an unhashable key the caller put in
                    for key in islice(oldest.keys, oldest.start, oldest.start + gone):
                        if index.get(key) is oldest:
                            del index[key]
            oldest.start += gone
            self._entries -= gone
            if oldest.live() == 0:
                self._batches.popleft()
