"""``--tenants FILE``: the tenants a controller serves, read from TOML.

One table per tenant::

    [team-a]
    secret_file = "/etc/kvfabric/team-a.secret"   # the tenant's credential
    quota = "16GiB"                               # bytes its values may hold
    ttl = "1h"                                    # optional: its values expire after this

A relative ``secret_file`` is taken from the tenants file's directory. Every mistake (an
unknown key, a missing one, a size or duration that does not parse, an unreadable or empty
secret, two tenants with the same secret or the same tag) is a ConfigError naming the
tenant and the key, before anything listens.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import tomllib

from kvfabric._control.security import load_secret
from kvfabric._control.tenant_keys import TenantKeys, valid_tenant_name
from kvfabric.errors import ConfigError
from kvfabric.spi.units import parse_duration, parse_size

__all__ = ["TenantSpec", "load_tenants"]

_KEYS = {"secret_file", "quota", "ttl"}


@attrs.frozen
class TenantSpec:
    """One tenant as configured."""

    keys: TenantKeys
    quota: int
    """Bytes of records (headers included) its values may hold."""
    ttl: float | None
    """Seconds after which a value it stored expires (None: never)."""

    @property
    def name(self) -> str:
        return self.keys.name


def load_tenants(path: str) -> list[TenantSpec]:
    """The tenants in ``path`` (at least one)."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--tenants: cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--tenants: {path} is not TOML: {exc}") from exc
    if not tables:
        raise ConfigError(f"--tenants: {path} names no tenant (one [NAME] table per tenant)")
    base = Path(path).parent
    read = [_spec(name, table, base, path) for name, table in tables.items()]
    _check_distinct(read, path)
    return [spec for spec, _ in read]


def _spec(name: str, table: object, base: Path, path: str) -> tuple[TenantSpec, bytes]:
    """The tenant, and its secret."""
    where = f"--tenants {path}: tenant [{name}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: a table ([{name}] with secret_file and quota) expected")
    try:
        valid_tenant_name(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    unknown = set(table) - _KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {sorted(unknown)[0]!r}; accepted: secret_file, quota, ttl"
        )
    for required in ("secret_file", "quota"):
        if required not in table:
            raise ConfigError(f"{where}: {required} is required")
    secret_file = Path(str(table["secret_file"]))
    if not secret_file.is_absolute():
        secret_file = base / secret_file
    try:
        secret = load_secret(str(secret_file))
        quota = parse_size(table["quota"])
        ttl = None if "ttl" not in table else parse_duration(table["ttl"])
    except (ConfigError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    assert secret is not None  # a named file never gives None
    if quota <= 0:
        raise ConfigError(f"{where}: quota must be a size above 0, got {table['quota']!r}")
    if ttl is not None and ttl <= 0:
        raise ConfigError(f"{where}: ttl must be a duration above 0, got {table['ttl']!r}")
    return TenantSpec(keys=TenantKeys.from_secret(name, secret), quota=quota, ttl=ttl), secret


def _check_distinct(read: list[tuple[TenantSpec, bytes]], path: str) -> None:
    """Two tenants with one secret would each hold the other's credential; two with one
    tag would share a namespace."""
    seen_secrets: dict[bytes, str] = {}
    seen_tags: dict[bytes, str] = {}
    for spec, secret in read:
        other = seen_secrets.setdefault(secret, spec.name)
        if other != spec.name:
            raise ConfigError(
                f"--tenants {path}: tenants [{other}] and [{spec.name}] have the same "
                "secret; each tenant needs its own"
            )
        other = seen_tags.setdefault(spec.keys.tag, spec.name)
        if other != spec.name:
            raise ConfigError(
                f"--tenants {path}: tenant names [{other}] and [{spec.name}] collide in "
                "their 4-byte key tag; rename one"
            )
