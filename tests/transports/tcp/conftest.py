"""Fixtures for the tcp transport's tests: certificates for TLS on the data plane."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from tcp_raw import TlsFiles


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Certificates made with the ``openssl`` command (no Python crypto package needed)."""
    if shutil.which("openssl") is None:
        pytest.fail("the tls tests need the openssl command to make certificates")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(directory, "node")
    other_cert, other_key = _self_signed(directory, "stranger")
    return TlsFiles(cert=cert, key=key, other_cert=other_cert, other_key=other_key)
