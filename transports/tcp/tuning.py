"""A tcp data connection's socket options (no Nagle, the size of its send buffer), and how
many connections a large read moves over at once.

Nagle is off on both sides: each request and reply is written whole and then waited on, so
Nagle would only hold back its last partial packet for an ACK.

The send buffer (``tcp.send_buffer``, on the client for its writes and on the node for its
reads) is the kernel's to size, except between two processes of one host. By default
(``auto``) a connection whose peer is on this host (a loopback address, or the connection's
own address at both ends) gets a fixed 256 KiB; any other keeps the kernel's autotuning.
Over loopback, the receiver copies what the sender just copied in. With autotuning the
sender stays up to 4 MiB (``tcp_wmem``'s maximum) ahead of the receiver, and the bytes have
left the cache by the time the receiver reads them. With 256 KiB (512 KiB in use, since the
kernel doubles what it is given) they are still there, and large puts and gets run faster
than with autotuning, smaller or larger fixed sizes (docs/performance.md). Other machines'
caches differ: ``kvfabric bench`` measures, and ``tcp.send_buffer`` changes it.

Across a network the buffer must hold what is in flight, bandwidth times round trip (100
Gb/s at 50 µs is 625 KB), and autotuning sizes it to that; ``auto`` leaves it alone there.
A size (``tcp.send_buffer=1MiB``) fixes it for every connection. ``0`` leaves every
connection to autotuning. The kernel caps what is asked at ``net.core.wmem_max``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

from kvfabric._runtime.cpus import usable_cpus
from kvfabric.errors import ConfigError
from kvfabric.spi import parse_size

__all__ = [
    "AUTO",
    "LOCAL_SEND_BUFFER",
    "MAX_READ_LANES",
    "on_this_host",
    "parse_read_lanes",
    "parse_send_buffer",
    "tune",
]

AUTO = -1
"""``tcp.send_buffer=auto``: :data:`LOCAL_SEND_BUFFER` to a peer on this host, else the
kernel's autotuning."""
LOCAL_SEND_BUFFER = 256 * 1024
# Past this a send buffer only holds memory: 64 MiB in flight is 400 Gb/s at 1.3 ms.
_MAX_SEND_BUFFER = 64 << 20


MAX_READ_LANES = 8
"""The most connections one read may use at once (the native call's limit)."""
# ``tcp.read_lanes=auto``: two lanes where the process can keep at least this many CPUs busy.
_LANES_MIN_CPUS = 4


def parse_read_lanes(text: str | int) -> int:
    """``tcp.read_lanes``: ``auto`` or 1 to :data:`MAX_READ_LANES` connections per large read.

    ``auto`` is 2 where this process can keep at least 4 CPUs busy (those it may run on,
    capped by its cgroups' CPU quota: :func:`kvfabric._runtime.cpus.usable_cpus`), else 1. A
    second lane is a second receiving thread: it speeds a large read up, but on a machine
    with few CPUs what it gains is CPU taken from the rest of the process, a busy Python
    thread beside it included (docs/performance.md).
    """
    if isinstance(text, str) and text.strip().lower() == "auto":
        return 2 if usable_cpus() >= _LANES_MIN_CPUS else 1
    try:
        lanes = int(text)
    except ValueError:
        raise ConfigError(
            f"tcp.read_lanes is auto or 1 to {MAX_READ_LANES}, not {text!r}"
        ) from None
    if not 1 <= lanes <= MAX_READ_LANES:
        raise ConfigError(f"tcp.read_lanes is auto or 1 to {MAX_READ_LANES}, not {text!r}")
    return lanes


def parse_send_buffer(text: str | int) -> int:
    """``auto`` (:data:`AUTO`), ``0`` (autotuning) or a size of at most 64 MiB."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return AUTO
    size = parse_size(text)
    if size > _MAX_SEND_BUFFER:
        raise ConfigError(f"tcp.send_buffer is at most 64MiB, not {text!r} (auto, 0 or a size)")
    return size


def on_this_host(sock: socket.socket) -> bool:
    """Whether the peer of connected ``sock`` is this host: its address is a loopback one,
    or the same as this end's (a connection to one of this host's own addresses)."""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except (OSError, IndexError, TypeError):  # not connected, or not an IP socket
        return False
    if peer == local:
        return True
    try:
        return ipaddress.ip_address(peer.partition("%")[0]).is_loopback
    except ValueError:
        return False


def tune(sock: socket.socket, send_buffer: int) -> None:
    """Set up a connected data socket: Nagle off, the send buffer as ``send_buffer`` says.

    Raises ``OSError`` if Nagle cannot be turned off (the socket is dead); a send buffer the
    kernel refuses is left to autotuning.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = LOCAL_SEND_BUFFER if send_buffer == AUTO and on_this_host(sock) else send_buffer
    if size > 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
