"""Tenants against a real ``kvfabric serve --tenants`` process on 127.0.0.1, over tcp.

Two tenants with quotas: neither reads the other's values whatever key bytes it sends
(through lookups, existence checks, reads and locate, and with the other's index keys sent
as they are), dedup stays within a tenant, a tenant's burst of five times its quota evicts
only its own values (the other's working set stays whole, by count), a wrong secret or a
forged controller key is refused, a tenant's client may not make a node's or an operator's
requests, values past a tenant's ttl expire, and ``kvfabric stats`` shows each tenant's
usage. The deployment's own clients keep working as without tenants.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvfabric
from kvfabric import PutOutcome
from kvfabric._client.store import Store
from kvfabric._client.tenant_store import TenantStore
from kvfabric._control.client import ControlClient, ControllerRefusedError
from kvfabric._control.remote_index import fetch_stats
from kvfabric._control.security import Credentials
from kvfabric._control.tenant_keys import TenantKeys, controller_key
from kvfabric._tools.local_cluster import LocalCluster, ServerProcess, free_port
from kvfabric._wire.protocol import ErrorCode
from kvfabric.keys import chain_keys
from kvfabric.testing import wait_for

DEPLOYMENT = b"deployment secret for the tenants test, 32+ bytes"
VALUE = 64 << 10
QUOTA = 8 << 20


class Serve:
    """``kvfabric serve --tenants`` with tenants alpha, beta (quota 8 MiB each) and brief
    (ttl 1s)."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.secrets = {}
        for name in ("alpha", "beta", "brief"):
            path = tmp / f"{name}.secret"
            path.write_bytes(os.urandom(32).hex().encode())
            self.secrets[name] = path
        (tmp / "tenants.toml").write_text(
            '[alpha]\nsecret_file = "alpha.secret"\nquota = "8MiB"\n\n'
            '[beta]\nsecret_file = "beta.secret"\nquota = "8MiB"\n\n'
            f'[brief]\nsecret_file = "{self.secrets["brief"]}"\nquota = "1MiB"\nttl = "1s"\n'
        )
        self.deployment_secret = tmp / "deployment.secret"
        self.deployment_secret.write_bytes(DEPLOYMENT)
        self.port = free_port()
        self.process = ServerProcess(
            [
                "serve",
                "--listen",
                f"tcp://127.0.0.1:{self.port}",
                "--tenants",
                str(tmp / "tenants.toml"),
                "--transport",
                "tcp",
                "--capacity",
                "64MiB",
                "--region-size",
                "64MiB",
            ],
            tmp / "serve.log",
            {**os.environ, "KVFABRIC_SECRET": DEPLOYMENT.decode()},
            "kvfabric serving on",
        )
        found = re.search(r"controller_key=(\S+)", self.process.ready_line)
        assert found, self.process.ready_line
        self.controller_key = found.group(1)

    def url(self, tenant: str, secret: Path | None = None, **extra: str) -> str:
        secret = secret or self.secrets[tenant]
        query = f"tenant={tenant}&secret_file={secret}&controller_key={self.controller_key}"
        query += "".join(f"&{k}={v}" for k, v in extra.items())
        return f"kvfabric://127.0.0.1:{self.port}?transport=tcp&{query}"

    def deployment_url(self) -> str:
        return (
            f"kvfabric://127.0.0.1:{self.port}?transport=tcp&secret_file={self.deployment_secret}"
        )

    def stats(self) -> dict[str, dict[str, int]]:
        client = ControlClient(
            f"tcp://127.0.0.1:{self.port}",
            timeout=5.0,
            credentials=Credentials.from_secret(DEPLOYMENT),
        )
        try:
            return fetch_stats(client)
        finally:
            client.close()

    def log(self) -> str:
        return (self.dir / "serve.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    server = Serve(tmp_path_factory.mktemp("tenants"))
    try:
        yield server
    finally:
        server.process.stop()


@pytest.fixture
def alpha(serve: Serve) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(serve.url("alpha")) as store:
        yield store


@pytest.fixture
def beta(serve: Serve) -> Iterator[kvfabric.Store]:
    with kvfabric.connect(serve.url("beta")) as store:
        yield store


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=os.urandom(16))


def _value(tag: bytes, key: bytes, size: int = 1024) -> bytes:
    return tag + np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size - 1)


def test_a_tenant_never_reads_another_tenants_values(
    alpha: kvfabric.Store, beta: kvfabric.Store
) -> None:
    keys = _keys(16)
    assert alpha.batched_put(keys, [_value(b"A", k) for k in keys]) == [PutOutcome.STORED] * 16
    # The same raw keys, from the other tenant: misses every way it can ask.
    assert beta.batched_contains(keys) == 0
    assert beta.batched_exists(keys) == [False] * 16
    assert beta.batched_get(keys) == [None] * 16
    assert beta.locate(keys) == [None] * 16
    # The other tenant's index keys, sent as they are (past the client's own mapping): the
    # controller makes them this tenant's, so they miss too.
    assert isinstance(alpha, TenantStore)
    theirs = alpha.index_keys(keys)
    assert Store.batched_contains(beta, theirs) == 0
    assert Store.batched_exists(beta, theirs) == [False] * 16
    assert Store.locate(beta, theirs) == [None] * 16
    assert Store.batched_get(beta, theirs) == [None] * 16
    assert Store.delete(beta, theirs) == 0
    # Dedup within a tenant only: the same keys from the other tenant store its own bytes.
    assert beta.batched_put(keys, [_value(b"B", k) for k in keys]) == [PutOutcome.STORED] * 16
    assert [bytes(v) for v in alpha.batched_get(keys) if v is not None] == [
        _value(b"A", k) for k in keys
    ]
    assert [bytes(v) for v in beta.batched_get(keys) if v is not None] == [
        _value(b"B", k) for k in keys
    ]
    # A re-put within the tenant deduplicates.
    assert (
        alpha.batched_put(keys, [_value(b"A", k) for k in keys]) == [PutOutcome.DEDUPLICATED] * 16
    )


def test_one_tenants_burst_evicts_only_its_own_values(
    serve: Serve, alpha: kvfabric.Store, beta: kvfabric.Store
) -> None:
    working_set = _keys(64)  # 4 MiB of alpha's 8 MiB quota
    values = [_value(b"A", k, VALUE) for k in working_set]
    assert alpha.batched_put(working_set, values) == [PutOutcome.STORED] * 64
    before = serve.stats()["tenant beta"]
    written = 0
    last: list[bytes] = []
    while written < 5 * QUOTA:  # beta writes five times its quota, in puts of 1 MiB
        last = [os.urandom(32) for _ in range(16)]
        outcomes = beta.batched_put(last, [os.urandom(VALUE)] * 16)
        assert outcomes == [PutOutcome.STORED] * 16
        written += 16 * VALUE
    # alpha's working set is whole, every value exactly as put.
    assert alpha.batched_contains(working_set) == 64
    got = alpha.batched_get(working_set)
    assert [bytes(v) if v is not None else None for v in got] == values
    # beta's latest put is resident too: its own oldest values made the room.
    assert beta.batched_contains(last) == 16
    stats = serve.stats()
    assert stats["tenant beta"]["used_bytes"] <= QUOTA
    assert stats["tenant beta"]["quota_evictions"] > before["quota_evictions"]
    assert stats["tenant alpha"]["used_bytes"] >= 64 * VALUE
    assert stats["tenant alpha"]["quota_bytes"] == QUOTA
    assert stats["index"]["evictions"] == 0  # no eviction across tenants was needed


def test_stats_show_each_tenants_usage(serve: Serve, beta: kvfabric.Store) -> None:
    keys = [os.urandom(32) for _ in range(4)]
    before = serve.stats()["tenant beta"]["used_bytes"]
    beta.batched_put(keys, [b"x" * 1000] * 4)
    after = serve.stats()
    assert {"tenant alpha", "tenant beta", "tenant brief"} <= set(after)
    # Each record counts its payload and its 64-byte header (beta may have evicted some of
    # its own to make room, never more than it added).
    assert after["tenant beta"]["entries"] >= 4
    assert after["tenant beta"]["used_bytes"] <= QUOTA
    assert after["tenant beta"]["used_bytes"] != before or after["tenant beta"]["entries"]
    assert after["tenant brief"]["ttl_seconds"] == 1


def test_values_expire_after_the_tenants_ttl(serve: Serve) -> None:
    with kvfabric.connect(serve.url("brief")) as brief:
        keys = _keys(4)
        assert brief.batched_put(keys, [b"short-lived"] * 4) == [PutOutcome.STORED] * 4
        wait_for(
            "the brief tenant's values expired",
            lambda: brief.batched_exists(keys) == [False] * 4,
            context=serve.log,
        )
        assert serve.stats()["tenant brief"]["ttl_expirations"] >= 4


def test_a_wrong_secret_or_controller_key_is_refused(serve: Serve, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.secret"
    wrong.write_bytes(os.urandom(32).hex().encode())
    keys = _keys(2)
    with kvfabric.connect(serve.url("alpha", wrong, control_timeout="0.3s")) as impostor:
        assert not impostor.ping()
        assert impostor.batched_put(keys, [b"x"] * 2) == [PutOutcome.FAILED] * 2
        assert impostor.batched_contains(keys) == 0
    # Another tenant's secret under this tenant's name is as wrong.
    with kvfabric.connect(
        serve.url("alpha", serve.secrets["beta"], control_timeout="0.3s")
    ) as impostor:
        assert not impostor.ping()
    # Someone else's key posing as the controller's: the client refuses to talk to it.
    other = controller_key(Credentials.from_secret(b"another deployment entirely"))
    url = serve.url("alpha", control_timeout="0.3s").replace(serve.controller_key, other)
    with kvfabric.connect(url) as misled:
        assert not misled.ping()


def test_a_tenants_client_may_not_make_node_or_operator_requests(serve: Serve) -> None:
    keys = TenantKeys.from_secret("alpha", serve.secrets["alpha"].read_bytes().strip())
    client = ControlClient(
        f"tcp://127.0.0.1:{serve.port}",
        timeout=5.0,
        credentials=keys.client_credentials(serve.controller_key),
    )
    try:
        with pytest.raises(ControllerRefusedError) as refused:
            fetch_stats(client)
        assert refused.value.code == ErrorCode.FORBIDDEN
    finally:
        client.close()


def test_the_deployments_own_clients_work_as_without_tenants(
    serve: Serve, alpha: kvfabric.Store
) -> None:
    keys = _keys(8)
    with kvfabric.connect(serve.deployment_url()) as operator:
        assert (
            operator.batched_put(keys, [_value(b"O", k) for k in keys]) == [PutOutcome.STORED] * 8
        )
        assert operator.batched_contains(keys) == 8
        assert [bytes(v) for v in operator.batched_get(keys) if v is not None] == [
            _value(b"O", k) for k in keys
        ]
    # A tenant's keys are not the deployment's: the same raw keys miss for the tenant.
    assert alpha.batched_contains(keys) == 0


def test_a_tenants_data_connection_reads_only_its_own_records(
    serve: Serve, alpha: kvfabric.Store, beta: kvfabric.Store
) -> None:
    keys = _keys(4)
    assert alpha.batched_put(keys, [_value(b"A", k) for k in keys]) == [PutOutcome.STORED] * 4
    assert isinstance(alpha, TenantStore)
    theirs = alpha.index_keys(keys)
    # Where alpha's records lie, as the operator (the deployment's secret) can learn it.
    with kvfabric.connect(serve.deployment_url()) as operator:
        descriptors = operator.locate(theirs)
    assert all(d is not None for d in descriptors)
    # beta handed those descriptors (an rkey and offset are all a read names): the node's
    # tcp port serves its connection nothing of them, record or header.
    beta.remember([d for d in descriptors if d is not None])
    before = beta.stats()["refused_reads"]
    assert Store.batched_get(beta, theirs) == [None] * 4
    assert beta.stats()["refused_reads"] > before
    first = descriptors[0]
    assert first is not None
    with pytest.raises(kvfabric.errors.TransportError):
        beta.records.read_slot(first, 0, bytearray(64))
    # alpha reads the same records through its own connection.
    assert [bytes(v) for v in alpha.batched_get(keys) if v is not None] == [
        _value(b"A", k) for k in keys
    ]


def test_a_controller_and_a_node_serve_tenants(serve: Serve) -> None:
    """``kvfabric controller --tenants`` with ``kvfabric node --tenants``: the same file on
    both, the node admitting the tenants' clients on its tcp port."""
    tenants = str(serve.dir / "tenants.toml")
    with LocalCluster(
        secret=DEPLOYMENT,
        transports=("tcp",),
        capacity="16MiB",
        controller_args=["--tenants", tenants],
        node_args=["--tenants", tenants],
    ) as cluster:
        assert cluster.controller is not None
        found = re.search(r"controller_key=(\S+)", cluster.controller.ready_line)
        assert found, cluster.controller.ready_line
        base = f"kvfabric://127.0.0.1:{cluster.port}?transport=tcp&controller_key={found[1]}"
        keys = _keys(8)
        with (
            kvfabric.connect(f"{base}&tenant=alpha&secret_file={serve.secrets['alpha']}") as a,
            kvfabric.connect(f"{base}&tenant=beta&secret_file={serve.secrets['beta']}") as b,
        ):
            assert a.batched_put(keys, [_value(b"A", k) for k in keys]) == [PutOutcome.STORED] * 8
            assert b.batched_contains(keys) == 0
            assert b.batched_get(keys) == [None] * 8
            assert [bytes(v) for v in a.batched_get(keys) if v is not None] == [
                _value(b"A", k) for k in keys
            ]
        assert cluster.stats()["tenant alpha"]["entries"] == 8
