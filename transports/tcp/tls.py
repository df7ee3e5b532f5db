"""TLS for the ``tcp`` data plane (``tcp.tls=true``): the standard library's ``ssl``.

The node presents a certificate (``tcp.tls_cert``, ``tcp.tls_key``); a client verifies
it against ``tcp.tls_ca`` (or the system's CAs) and the host in the node's address, so an
attacker on the path cannot stand in for the node, and every byte after the greeting is
encrypted and authenticated (TLS 1.2 at least; 1.3 where both sides have it). There is no
unverified mode: a TLS that accepted any certificate would let that attacker relay the
handshake and then read and alter the data. The client's credential stays the secret,
proved inside TLS by the handshake (``kvfabric.transports.tcp.auth``).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from kvfabric.errors import ConfigError

__all__ = ["ca_file", "client_context", "pem_file", "server_context"]


def pem_file(text: str) -> str:
    """An option naming a readable file (its PEM is loaded when the transport starts);
    empty: none."""
    if not text:
        return ""
    path = Path(text).expanduser()
    if not path.is_file():
        raise ConfigError(f"no such file: {text}")
    return str(path)


def ca_file(text: str) -> str:
    """A client's trust anchors: checked here, so a bad file is refused as an option error."""
    path = pem_file(text)
    if not path:
        return ""
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{text} holds no usable CA certificate: {exc}") from None
    return path


def server_context(cert: str, key: str) -> ssl.SSLContext:
    if not cert:
        raise ConfigError("tcp.tls=true on a node needs tcp.tls_cert (and tcp.tls_key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key or None)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tcp: cannot load the certificate {cert} / key {key}: {exc}") from exc
    return context


def client_context(ca: str) -> ssl.SSLContext:
    # PROTOCOL_TLS_CLIENT: certificate and host name checked (CERT_REQUIRED, check_hostname).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if ca:
            context.load_verify_locations(cafile=ca)
        else:
            context.load_default_certs()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tcp: cannot load the CA certificates {ca}: {exc}") from exc
    return context
