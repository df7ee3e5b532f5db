"""Tenants as configured (``--tenants FILE``) and as a client names one (``tenant=NAME``):
what is accepted, and every mistake refused with the tenant and key named."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvfabric
from kvfabric._control.tenant_config import load_tenants
from kvfabric._control.tenant_keys import TAG, TenantKeys
from kvfabric.errors import ConfigError


def _file(tmp_path: Path, text: str) -> str:
    (tmp_path / "a.secret").write_text("secret of a, long enough\n")
    (tmp_path / "b.secret").write_text("secret of b, long enough\n")
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return str(path)


def test_tenants_are_read_with_quota_and_ttl(tmp_path: Path) -> None:
    specs = load_tenants(
        _file(
            tmp_path,
            '[a]\nsecret_file = "a.secret"\nquota = "1GiB"\n'
            '[b]\nsecret_file = "b.secret"\nquota = 4096\nttl = "90s"\n',
        )
    )
    assert [(s.name, s.quota, s.ttl) for s in specs] == [("a", 1 << 30, None), ("b", 4096, 90.0)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[a]\nsecret_file = "a.secret"\n', "quota is required"),
        ('[a]\nquota = "1GiB"\n', "secret_file is required"),
        ('[a]\nsecret_file = "a.secret"\nquota = "1GiB"\nqouta = 1\n', "unknown key 'qouta'"),
        ('[a]\nsecret_file = "a.secret"\nquota = "16G"\n', "tenant [a]"),
        ('[a]\nsecret_file = "a.secret"\nquota = "1GiB"\nttl = "soon"\n', "tenant [a]"),
        ('[a]\nsecret_file = "missing.secret"\nquota = "1GiB"\n', "cannot read"),
        ('["a b"]\nsecret_file = "a.secret"\nquota = "1GiB"\n', "not a tenant name"),
        (
            '[a]\nsecret_file = "a.secret"\nquota = "1GiB"\n'
            '[b]\nsecret_file = "a.secret"\nquota = "1GiB"\n',
            "same secret",
        ),
        ("", "names no tenant"),
        ("[a", "not TOML"),
    ],
)
def test_a_mistake_in_the_tenants_file_is_named(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_tenants(_file(tmp_path, text))


def test_index_keys_carry_the_tag_and_differ_per_tenant() -> None:
    a = TenantKeys.from_secret("a", b"secret")
    b = TenantKeys.from_secret("b", b"secret")
    key = bytes(32)
    (ka,), (kb,) = a.index_keys([key]), b.index_keys([key])
    assert ka[TAG] == a.tag
    assert kb[TAG] == b.tag
    assert ka != kb
    # The same secret under another name derives another credential.
    assert a.client_public != b.client_public
    assert a.data_token != b.data_token


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("tenant=a&secret_file={s}&controller_key={k}&index=redis", "shared index"),
        ("tenant=a&controller_key={k}", "secret_file"),
        ("tenant=a&secret_file={s}", "controller_key"),
        ("tenant=a&secret_file={s}&controller_key=short", "not a controller's public key"),
        ("controller_key={k}", "tenant=NAME"),
        ("tenant=a%20b&secret_file={s}&controller_key={k}", "not a tenant name"),
    ],
)
def test_a_tenants_url_is_checked_before_connecting(tmp_path: Path, query: str, says: str) -> None:
    secret = tmp_path / "a.secret"
    secret.write_text("secret of a")
    controller = "0" * 64
    url = "kvfabric://127.0.0.1:1?" + query.format(s=secret, k=controller)
    with pytest.raises(ConfigError, match=says):
        kvfabric.connect(url)


def test_a_controller_key_survives_the_url_whatever_its_curve_text_holds() -> None:
    # Curve's z85 text of a key can hold '&', '#', '%' and '+': as printed for a URL (hex),
    # the key parses back to the very key.
    from urllib.parse import parse_qsl

    import zmq.utils.z85

    from kvfabric._control.security import Credentials
    from kvfabric._control.tenant_keys import controller_key

    z85 = b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # '%Fc' would decode as one byte
    printed = controller_key(Credentials(z85, b"", b"", b"", b""))
    assert dict(parse_qsl(f"tenant=a&controller_key={printed}"))["controller_key"] == printed
    keys = TenantKeys.from_secret("a", b"secret")
    assert keys.client_credentials(printed).server_public == z85
    assert zmq.utils.z85.decode(z85) == bytes.fromhex(printed)
