"""Talking to Redis for the redis index: one server or a cluster, one round trip per shard.

:class:`ShardSet` knows which master serves which hash slot (``CLUSTER SLOTS``, or a single
server that serves them all) and runs a batch of calls as one pipeline per master, every
master's pipeline at the same time: a batch is one *round* of as many *round trips* as the
masters it touches, and both are counted. Nothing is retried behind the caller's back
(redis-py's default retries would resend a write that may have run): a master that does not
answer makes its calls fail with :class:`~kvfabric.errors.ControllerUnavailableError`, the
topology is read again before the next batch, and the index decides what a failed call means
(a miss for a lookup, no grant for a put). Only a call refused with ``MOVED``/``ASK`` (it ran
nowhere) is sent once more, to the master now serving its slot.

The function library is loaded (``FUNCTION LOAD REPLACE``) on each master the first time it
is seen; a master that answers "Function not found" (one that was reset, or a node added
later) gets it then, and its pipeline runs again — the refused calls ran nowhere either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from redis.backoff import NoBackoff
from redis.client import Redis
from redis.connection import BlockingConnectionPool, parse_url
from redis.exceptions import AskError, AuthenticationError, MovedError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvfabric.errors import ConfigError, ControllerUnavailableError, RemoteError

__all__ = ["Call", "Round", "ShardSet"]

# How often the topology may be read again after a failure (a dead master would otherwise
# be asked on every call).
_REFRESH_INTERVAL = 0.1
_parse_url: Callable[[str], dict[str, Any]] = parse_url
_WAIT_TIMEOUT_MS = 1000


@attrs.frozen(kw_only=True)
class Call:
    """One command for the master serving ``slot``."""

    slot: int
    args: tuple[Any, ...]


@attrs.frozen(kw_only=True)
class Round:
    """What a batch returned: a value or an exception per call, and where each went."""

    values: list[Any]
    shards: list[str]
    """Address of the master each call went to ("" when no master serves its slot)."""
    durable: list[bool]
    """Whether the call's master had it acknowledged by the replicas asked for (or none were
    asked for)."""


class _Shard:
    __slots__ = ("address", "client", "loaded", "replicas", "round_trips")

    def __init__(self, address: str, client: Any) -> None:
        self.address = address
        self.client = client
        self.loaded = False
        self.replicas = 0
        self.round_trips = 0


class ShardSet:
    """The masters of one Redis deployment, and batches run over them."""

    def __init__(self, url: str, *, timeout: float, pool: int, library: str) -> None:
        try:
            kwargs = _parse_url(url)
        except ValueError as exc:
            raise ConfigError(f"redis url {url!r}: {exc}") from None
        self._seed = f"{kwargs.pop('host', '127.0.0.1')}:{kwargs.pop('port', 6379)}"
        if kwargs.pop("db", 0) not in (0, "0"):
            raise ConfigError(
                f"redis url {url!r}: the index uses database 0 (Cluster has no other)"
            )
        # The index's own options say these (redis.pool, redis.timeout).
        for name in ("max_connections", "timeout", "socket_timeout", "socket_connect_timeout"):
            kwargs.pop(name, None)
        self._kwargs = {
            **kwargs,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # Never resend: a write that timed out may have run.
            "retry": Retry(NoBackoff(), 0),
        }
        self._pool_size = pool
        self._timeout = timeout
        self._library = library
        self._lock = threading.Lock()
        self._shards: dict[str, _Shard] = {}
        self._owners: list[_Shard] | None = None
        """Master of every slot (cluster), or None: one server serves every slot."""
        self._single: _Shard | None = None
        self._stale = True
        self._last_refresh = 0.0
        self.rounds = 0
        self.round_trips = 0
        self.failed_round_trips = 0
        self.refreshes = 0

    # -- topology ----------------------------------------------------------------------------

    @property
    def cluster(self) -> bool:
        return self._owners is not None

    def masters(self) -> list[str]:
        with self._lock:
            return sorted({s.address for s in self._current_masters()})

    def master_of(self, slot: int) -> str:
        shard = self._owner(slot)
        return shard.address if shard is not None else ""

    def round_trips_by_master(self) -> dict[str, int]:
        with self._lock:
            return {s.address: s.round_trips for s in self._shards.values()}

    def refresh(self, *, force: bool = False) -> None:
        """Read which master serves which slot (rate limited unless ``force``)."""
        with self._lock:
            now = time.monotonic()
            if not force and not self._stale:
                return
            if not force and now - self._last_refresh < _REFRESH_INTERVAL:
                if self._single is None and self._owners is None:
                    raise ControllerUnavailableError("redis: no server answered yet")
                return
            self._last_refresh = now
            self._read_topology()
            self._stale = False
            self.refreshes += 1

    def _read_topology(self) -> None:
        candidates = [self._seed, *(a for a in self._shards if a != self._seed)]
        last: Exception | None = None
        for address in candidates:
            shard = self._shard(address)
            try:
                reply = shard.client.execute_command("CLUSTER SLOTS")
            except AuthenticationError as exc:
                raise ConfigError(
                    f"redis {address}: {exc} (give user:password@ in the redis url)"
                ) from None
            except ResponseError as exc:
                if str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                    raise ConfigError(
                        f"redis {address}: {exc} (give user:password@ in the redis url)"
                    ) from None
                if "cluster support disabled" not in str(exc):
                    last = exc
                    continue
                self._owners = None
                self._single = shard
                self._prepare([shard])
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                last = exc
                continue
            owners: list[_Shard | None] = [None] * 16384
            masters: dict[str, _Shard] = {}
            for entry in reply:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                master_address = f"{host or address.rsplit(':', 1)[0]}:{int(master[1])}"
                owner = masters.get(master_address) or self._shard(master_address)
                masters[master_address] = owner
                for slot in range(start, end + 1):
                    owners[slot] = owner
            self._prepare(list(masters.values()))
            self._owners = [o if o is not None else _NOBODY for o in owners]
            self._single = None
            return
        raise ControllerUnavailableError(f"redis: no server of {candidates} answers: {last}")

    def _prepare(self, masters: Sequence[_Shard]) -> None:
        """Load the functions on masters seen for the first time; learn their replicas."""
        for shard in masters:
            try:
                if not shard.loaded:
                    self._load(shard)
                info = shard.client.info("replication")
                shard.replicas = int(info.get("connected_slaves", 0))
            except (RedisConnectionError, RedisTimeoutError):
                # Its slots' calls fail until the next refresh; the others go on.
                self._stale = True

    def _load(self, shard: _Shard) -> None:
        try:
            shard.client.execute_command("FUNCTION", "LOAD", "REPLACE", self._library)
        except ResponseError as exc:
            # A user without the right to load functions relies on the operator having
            # loaded them (docs/redis.md); if they are missing, calls say so.
            if "NOPERM" not in str(exc) and "no permissions" not in str(exc):
                raise RemoteError(f"redis {shard.address}: loading the functions: {exc}") from None
        shard.loaded = True

    def _shard(self, address: str) -> _Shard:
        shard = self._shards.get(address)
        if shard is None:
            host, port = address.rsplit(":", 1)
            # More threads than connections wait for one (up to the timeout) rather than fail.
            # (redis-py leaves this constructor unannotated.)
            pool = BlockingConnectionPool(  # type: ignore[no-untyped-call, unused-ignore]
                host=host,
                port=int(port),
                max_connections=self._pool_size,
                timeout=self._timeout,
                **self._kwargs,
            )
            client = Redis(connection_pool=pool)
            shard = self._shards[address] = _Shard(address, client)
        return shard

    def _current_masters(self) -> list[_Shard]:
        if self._single is not None:
            return [self._single]
        if self._owners is None:
            return []
        return list({id(s): s for s in self._owners if s is not _NOBODY}.values())

    def _owner(self, slot: int) -> _Shard | None:
        with self._lock:
            if self._single is not None:
                return self._single
            if self._owners is None:
                return None
            owner = self._owners[slot]
            return None if owner is _NOBODY else owner

    # -- batches -----------------------------------------------------------------------------

    def run(self, calls: Sequence[Call], *, wait_replicas: int = 0) -> Round:
        """Run ``calls``: one pipeline per master, all at once (one round).

        ``wait_replicas``: after its calls, each master waits (``WAIT``) until that many of
        its replicas (at most as many as it has) acknowledged them; ``Round.durable`` says
        where they did.
        """
        self.refresh()
        values: list[Any] = [None] * len(calls)
        shards = [""] * len(calls)
        durable = [True] * len(calls)
        pending = list(range(len(calls)))
        for attempt in range(2):
            groups: dict[str, tuple[_Shard, list[int]]] = {}
            for i in pending:
                owner = self._owner(calls[i].slot)
                if owner is None:
                    values[i] = ControllerUnavailableError(
                        f"redis: no master serves slot {calls[i].slot}"
                    )
                    continue
                groups.setdefault(owner.address, (owner, []))[1].append(i)
                shards[i] = owner.address
            self._execute(groups, calls, values, durable, wait_replicas)
            moved = [i for i in pending if _moved(values[i])]
            if not moved:
                break
            if attempt:
                for i in moved:
                    values[i] = ControllerUnavailableError(f"redis: slot {calls[i].slot} moved")
                break
            # MOVED/ASK: the call ran nowhere; the slot has a new master now.
            self.refresh(force=True)
            pending = moved
        return Round(values=values, shards=shards, durable=durable)

    def _execute(
        self,
        groups: dict[str, tuple[_Shard, list[int]]],
        calls: Sequence[Call],
        values: list[Any],
        durable: list[bool],
        wait_replicas: int,
    ) -> None:
        if not groups:
            return
        with self._lock:
            self.rounds += 1
            self.round_trips += len(groups)
            for shard, _ in groups.values():
                shard.round_trips += 1

        # Every master's pipeline is sent, then the replies are read: all masters work at
        # once, without handing each pipeline to a thread of its own on every call.
        sent: list[tuple[_Shard, list[int], list[tuple[Any, ...]], int, Any]] = []
        for shard, indexes in groups.values():
            wait = min(wait_replicas, shard.replicas)
            commands = [calls[i].args for i in indexes]
            if wait:
                commands.append(("WAIT", wait, _WAIT_TIMEOUT_MS))
            try:
                sent.append((shard, indexes, commands, wait, self._send(shard, commands)))
            except (RedisConnectionError, RedisTimeoutError) as exc:
                self._failed(shard, indexes, values, durable, exc)
        for shard, indexes, commands, wait, connection in sent:
            results: list[Any] = []
            try:
                self._receive(shard, connection, len(commands), results)
                if any(_missing_function(r) for r in results):
                    # Nothing ran (every call is refused the same way): load, run again.
                    with self._lock:
                        self.round_trips += 1
                        shard.round_trips += 1
                    self._load(shard)
                    results = []
                    self._receive(shard, self._send(shard, commands), len(commands), results)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # The calls answered before the failure stand (what they did is known); the
                # others failed. A WAIT not answered leaves none of them known durable.
                answered = min(len(results), len(indexes)) if not wait else 0
                for i, result in zip(indexes[:answered], results, strict=False):
                    values[i] = _map_error(shard, result)
                self._failed(shard, indexes[answered:], values, durable, exc)
                for i in indexes[:answered]:
                    durable[i] = True
                continue
            acked = results[-1] if wait else None
            for i, result in zip(indexes, results, strict=False):
                values[i] = _map_error(shard, result)
                durable[i] = acked is None or (isinstance(acked, int) and acked >= wait)
                if isinstance(values[i], ControllerUnavailableError):
                    with self._lock:
                        self._stale = True

    def _failed(
        self,
        shard: _Shard,
        indexes: list[int],
        values: list[Any],
        durable: list[bool],
        exc: Exception,
    ) -> None:
        with self._lock:
            self._stale = True
            self.failed_round_trips += 1
        error = ControllerUnavailableError(f"redis {shard.address}: {exc}")
        for i in indexes:
            values[i] = error
            durable[i] = False

    @staticmethod
    def _send(shard: _Shard, commands: list[tuple[Any, ...]]) -> Any:
        """Send a pipeline; returns the connection its replies will come on."""
        pool = shard.client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command(connection.pack_commands(commands))
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        return connection

    @staticmethod
    def _receive(shard: _Shard, connection: Any, count: int, results: list[Any]) -> None:
        """The replies of a pipeline sent on ``connection`` (an error reply as its
        exception), into ``results`` as they come: a failure leaves those read there."""
        pool = shard.client.connection_pool
        try:
            for _ in range(count):
                try:
                    results.append(connection.read_response())
                except ResponseError as exc:
                    results.append(exc)
        except BaseException:
            # Replies we did not read would answer the next caller: drop the connection.
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def execute(self, slot: int, *args: Any) -> Any:
        """One command, for the rare paths (registration, restore); raises what it returns."""
        value = self.run([Call(slot=slot, args=args)]).values[0]
        if isinstance(value, Exception):
            raise value
        return value

    def close(self) -> None:
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            if shard.client is not None:
                shard.client.close()
                shard.client.connection_pool.disconnect()


_NOBODY = _Shard("", None)


def _moved(value: Any) -> bool:
    return isinstance(value, MovedError | AskError)


def _missing_function(value: Any) -> bool:
    return isinstance(value, ResponseError) and "Function not found" in str(value)


def _map_error(shard: _Shard, value: Any) -> Any:
    """Errors a call can come back with, as kvfabric's (MOVED/ASK stay for a second try)."""
    if not isinstance(value, Exception) or _moved(value):
        return value
    text = str(value)
    if isinstance(value, RedisConnectionError | RedisTimeoutError) or text.startswith(
        ("CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN", "READONLY")
    ):
        return ControllerUnavailableError(f"redis {shard.address}: {text}")
    return RemoteError(f"redis {shard.address}: {text}")
