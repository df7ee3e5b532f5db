"""A controller's writes, as a client asks for them: chunked, and with outcomes that are true.

Every request here may be large (a put of a hundred thousand keys), so each is sent in
chunks through a :class:`~kvfabric._control.session.ControlSession` (one round trip for a
normal batch, a few pipelined ones for a large one). The requests that reserve space
(allocate, lease extents) carry this client's id, so the controller can bound what one
client holds (:mod:`kvfabric._control.reservations`).

An outcome is reported only when it is known:

- an allocate not answered whole fails whole, and the grants of the chunks that were
  answered are given back at once (those never answered end with their lease);
- a publish whose reply (or a chunk's) did not come is *settled*: an ``ABORT`` of those
  grants releases each that was still pending and answers, per grant, whether it is
  published — served before the abort, or refused after it, since the abort took the grant;
  so a late publish can never make a grant reported not published readable;
- the records of a ``publish_carved`` chunk left unanswered are settled the same way: their
  extents are given back (a later publish into them is refused), then each key is resolved;
  the record is stored where the key resolves to the record's version.

What the controller answers neither before nor after (it died, or cannot be reached for the
whole deadline) stays unknown: :class:`OutcomeUnknownError` carries what is known and marks
the rest None, and the writer treats those as not stored (see
:mod:`kvfabric._client.writes`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvfabric._control.client import ControlClient
from kvfabric._control.session import ControlSession, Reply, allowance, chunks
from kvfabric._runtime import forks
from kvfabric._runtime.codec import Reader
from kvfabric._wire import protocol as p
from kvfabric._wire.protocol import MsgType
from kvfabric.descriptor import Descriptor
from kvfabric.errors import ControllerUnavailableError, ProtocolError, RemoteError
from kvfabric.keys import KEY_SIZE
from kvfabric.spi.events import EngineBlock
from kvfabric.spi.index import (
    AllocateResult,
    Allocation,
    AllocationKind,
    AllocationRequest,
    CarvedRecord,
    CarveOutcome,
    Copies,
    Extent,
    GrantRef,
)

__all__ = ["OutcomeUnknownError", "RemoteWrites"]

T = TypeVar("T")


class OutcomeUnknownError(ControllerUnavailableError):
    """The controller answered neither a publish (or some of its chunks) nor the question
    what became of it: ``outcomes`` holds one entry per item published, None where it is
    unknown. ``held``: nothing of the unknown ones was given back as far as this client
    knows (no abort or return of them was answered), so their slots are still the
    writer's until their lease ends."""

    def __init__(self, message: str, outcomes: Sequence[object], *, held: bool) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)
        self.held = held


class RemoteWrites:
    """The write requests of one client of a controller."""

    def __init__(self, client: ControlClient) -> None:
        self.client = client
        self._client_id = secrets.randbits(63) | 1
        self._generation = forks.generation()

    @property
    def client_id(self) -> int:
        """Who reserves: drawn when the client connects, and again in a forked child (a
        process of its own reserves under a bound of its own); never 0."""
        if self._generation != forks.generation():
            self._client_id = secrets.randbits(63) | 1
            self._generation = forks.generation()
        return self._client_id

    # -- allocate ----------------------------------------------------------------------

    def allocate(self, requests: Sequence[AllocationRequest]) -> AllocateResult:
        head = p.write_client(self.client_id)
        ranges = chunks(len(requests), p.ALLOCATION_REQUEST_SIZE)
        bodies = [head + p.write_allocation_requests(requests[c.start : c.stop]) for c in ranges]
        if len(bodies) == 1:
            timeout = allowance(len(requests), self.client.timeout)
            r = self.client.call(MsgType.ALLOCATE, bodies[0], timeout=timeout)
            return _allocated(r, len(requests))
        results: list[AllocateResult] = []
        with self.client.session() as session:
            replies = session.exchange(MsgType.ALLOCATE, bodies, items=len(requests))
            failure: Exception | None = None
            for c, reply in zip(ranges, replies, strict=True):
                if isinstance(reply, Reader):
                    try:
                        results.append(_allocated(reply, len(c)))
                        continue
                    except ProtocolError as exc:
                        reply = exc
                failure = failure or _failure(MsgType.ALLOCATE, reply, self.client)
            if failure is None and len(session.epochs) > 1:
                # The controller restarted between chunks: the first ones' grants are gone.
                failure = ControllerUnavailableError("the controller restarted during an allocate")
            if failure is not None:
                # All or nothing: what was granted goes back now, not when its lease ends.
                granted = [
                    GrantRef.of(d)
                    for result in results
                    for a in result.allocations
                    for d in (*_granted(a), *a.replicas)
                ]
                if granted:
                    self._abort(session, granted)
                raise failure
        return AllocateResult(
            allocations=tuple(a for result in results for a in result.allocations),
            evictions=sum(result.evictions for result in results),
            lease=min(result.lease for result in results),
        )

    # -- publish and abort -------------------------------------------------------------

    def publish(
        self, grants: Sequence[GrantRef], blocks: Mapping[bytes, EngineBlock] | None = None
    ) -> list[bool]:
        """``blocks``: what the events should say of some keys, sent with their grants."""
        if blocks:
            encoded = _encode_blocks(blocks)
            ranges = chunks(len(grants), p.GRANT_SIZE + max(map(len, encoded.values())))
            bodies = [
                p.write_grants(part) + _blocks_of((g.key for g in part), encoded)
                for part in (grants[c.start : c.stop] for c in ranges)
            ]
        else:
            ranges = chunks(len(grants), p.GRANT_SIZE)
            bodies = [p.write_grants(grants[c.start : c.stop]) for c in ranges]
        published: list[bool | None] = [None] * len(grants)
        with self.client.session() as session:
            replies = session.exchange(MsgType.PUBLISH, bodies, items=len(grants))
            errors = _fill_flags(published, ranges, replies)
            unknown = [i for i, flag in enumerate(published) if flag is None]
            settled: list[bool | None] = []
            if unknown:
                settled = self._abort(session, [grants[i] for i in unknown])
                for i, flag in zip(unknown, settled, strict=True):
                    published[i] = flag
            silent = session.silent
        if None in published:
            if errors and not silent:
                raise errors[0]  # refused, and so was the question: nothing was served
            raise OutcomeUnknownError(
                f"controller {self.client.endpoint} did not say whether a publish was served",
                published,
                # An abort answered in part may have released the rest: none is the writer's.
                held=all(flag is None for flag in settled),
            )
        return [bool(flag) for flag in published]

    def abort(self, grants: Sequence[GrantRef]) -> None:
        with self.client.session() as session:
            settled = self._abort(session, grants)
        if None in settled:
            raise ControllerUnavailableError(f"controller {self.client.endpoint}: abort unanswered")

    def _abort(self, session: ControlSession, grants: Sequence[GrantRef]) -> list[bool | None]:
        """Give ``grants`` up; per grant whether it is published (None: not answered)."""
        ranges = chunks(len(grants), p.GRANT_SIZE)
        bodies = [p.write_grants(grants[c.start : c.stop]) for c in ranges]
        published: list[bool | None] = [None] * len(grants)
        replies = session.exchange(MsgType.ABORT, bodies, items=len(grants))
        _fill_flags(published, ranges, replies)
        return published

    # -- extents -----------------------------------------------------------------------

    def lease_extents(
        self, need: int, want: int, count: int, exclude: Sequence[int], returned: Sequence[int]
    ) -> list[Extent]:
        body = p.write_client(self.client_id) + p.write_lease_request(
            need, want, count, exclude, returned
        )
        r = self.client.call(MsgType.LEASE_EXTENTS, body)
        extents = p.read_extents(r)
        r.end()
        if len(extents) > count:
            raise ProtocolError(f"{len(extents)} extents leased of {count} asked for")
        return extents

    def publish_carved(
        self,
        records: Sequence[CarvedRecord],
        again: Sequence[bytes],
        blocks: Mapping[bytes, EngineBlock] | None = None,
    ) -> list[CarveOutcome]:
        # The records in order (an extent's are published in the order they lie), then the
        # keys found stored again, in chunks of their own; each record's block, if it has
        # one, in its chunk.
        if blocks:
            encoded = _encode_blocks(blocks)
            ranges = (
                chunks(len(records), p.CARVED_SIZE + max(map(len, encoded.values())))
                if records
                else []
            )
            bodies = [
                p.write_carved(part, ()) + _blocks_of((r.key for r in part), encoded)
                for part in (records[c.start : c.stop] for c in ranges)
            ]
        else:
            ranges = chunks(len(records), p.CARVED_SIZE) if records else []
            bodies = [p.write_carved(records[c.start : c.stop], ()) for c in ranges]
        if again:
            bodies += [
                p.write_carved((), again[c.start : c.stop]) for c in chunks(len(again), KEY_SIZE)
            ]
        outcomes: list[CarveOutcome | None] = [None] * len(records)
        with self.client.session() as session:
            replies = session.exchange(
                MsgType.PUBLISH_CARVED, bodies, items=len(records) + len(again)
            )
            errors: list[Exception] = []
            for c, reply in zip(ranges, replies, strict=False):
                chunk = _read_chunk(reply, len(c), p.read_carve_outcomes, errors)
                if chunk is not None:
                    outcomes[c.start : c.stop] = chunk
            unknown = [i for i, outcome in enumerate(outcomes) if outcome is None]
            held = True
            if unknown:
                held = not self._settle_carved(session, records, unknown, outcomes)
            silent = session.silent
        if None in outcomes:
            if errors and not silent:
                raise errors[0]
            raise OutcomeUnknownError(
                f"controller {self.client.endpoint} did not say whether records were published",
                outcomes,
                held=held,
            )
        return [o for o in outcomes if o is not None]

    def _settle_carved(
        self,
        session: ControlSession,
        records: Sequence[CarvedRecord],
        unknown: list[int],
        outcomes: list[CarveOutcome | None],
    ) -> bool:
        """What became of records whose publish went unanswered: their extents are given
        back first (no later publish into them is taken), then their keys resolved. Whether
        the extents were given back (the controller answered that)."""
        extents = sorted({records[i].extent for i in unknown})
        body = p.write_client(self.client_id) + p.write_lease_request(0, 0, 0, (), extents)
        (given_back,) = session.exchange(MsgType.LEASE_EXTENTS, [body], items=len(extents))
        if not isinstance(given_back, Reader):
            return False  # not known to be given back: a resolve now would prove nothing
        keys = [records[i].key for i in unknown]
        ranges = chunks(len(keys), KEY_SIZE)
        replies = session.exchange(
            MsgType.RESOLVE, [p.write_keys(keys[c.start : c.stop]) for c in ranges], items=len(keys)
        )
        errors: list[Exception] = []
        for c, reply in zip(ranges, replies, strict=True):
            copies = _read_chunk(reply, len(c), _read_resolved, errors)
            if copies is None:
                continue
            for j, found in zip(c, copies.descriptors, strict=True):
                i = unknown[j]
                copy_versions = {d.version for d in copies.alternates.get(j - c.start, ())}
                if found is not None:
                    copy_versions.add(found.version)
                stored = records[i].version in copy_versions
                outcomes[i] = CarveOutcome.STORED if stored else CarveOutcome.REFUSED
        return True


def _encode_blocks(blocks: Mapping[bytes, EngineBlock]) -> dict[bytes, bytes]:
    """Each key's block in its wire form, once (a chunk takes those of its keys)."""
    return {key: p.encode_block(key, block) for key, block in blocks.items()}


def _blocks_of(keys: Iterable[bytes], encoded: Mapping[bytes, bytes]) -> bytes:
    """The blocks section of one chunk: its keys' blocks (each once), or nothing."""
    mine = [encoded[key] for key in dict.fromkeys(keys) if key in encoded]
    return p.write_blocks(mine) if mine else b""


def _granted(allocation: Allocation) -> tuple[Descriptor, ...]:
    """The key's own grant, if it got one (its replicas aside)."""
    if allocation.kind is AllocationKind.GRANTED and allocation.descriptor is not None:
        return (allocation.descriptor,)
    return ()


def _allocated(r: Reader, count: int) -> AllocateResult:
    result = p.read_allocate_result(r)
    r.end()
    if len(result.allocations) != count:
        raise ProtocolError(f"{len(result.allocations)} allocations for {count} requests")
    return result


def _read_resolved(r: Reader) -> Copies:
    return p.read_copies(r, optional=True)


def _read_chunk(
    reply: Reply,
    count: int,
    read: Callable[[Reader], Sequence[T]] | Callable[[Reader], Copies],
    errors: list[Exception],
) -> Any:
    """One chunk's reply of ``count`` items read whole, or None: not answered, or answered
    with an error (kept in ``errors``); either way, what the chunk did is not known."""
    if reply is None:
        return None
    if isinstance(reply, Reader):
        try:
            value = read(reply)
            reply.end()
            n = len(value.descriptors) if isinstance(value, Copies) else len(value)
            if n != count:
                raise ProtocolError(f"a reply of {n} items to a chunk of {count}")
            return value
        except ProtocolError as exc:
            reply = exc
    errors.append(reply)
    return None


def _fill_flags(
    flags: list[bool | None],
    ranges: list[range],
    replies: list[Reply],
) -> list[Exception]:
    """Each answered chunk's flags into ``flags`` (a chunk not answered, or answered with
    an error, stays None: what it did is not known). The errors."""
    errors: list[Exception] = []
    for c, reply in zip(ranges, replies, strict=True):
        chunk = _read_chunk(reply, len(c), p.read_flags, errors)
        if chunk is not None:
            flags[c.start : c.stop] = chunk
    return errors


def _failure(msg_type: MsgType, reply: Reply, client: ControlClient) -> Exception:
    """What a chunk that failed raises: its error, or no reply in time."""
    if isinstance(reply, RemoteError | ProtocolError):
        return reply
    return ControllerUnavailableError(
        f"controller {client.endpoint} did not answer a {msg_type.name} in time"
    )
