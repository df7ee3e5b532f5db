"""The ``tcp`` transport's options and capabilities, and the client and node it makes from them."""

from __future__ import annotations

from kvfabric._runtime.bounds import MAX_DURATION, bounded
from kvfabric.errors import ConfigError
from kvfabric.spi import (
    Capabilities,
    MemoryKind,
    OptionSpec,
    Transport,
    TransportClient,
    TransportConfig,
    TransportServer,
    parse_bool,
    parse_duration,
)
from kvfabric.transports.tcp.client import TcpClient
from kvfabric.transports.tcp.server import ServerLimits, TcpServer
from kvfabric.transports.tcp.tls import ca_file, client_context, pem_file, server_context
from kvfabric.transports.tcp.tuning import parse_read_lanes, parse_send_buffer

__all__ = ["TcpTransport"]

# Counts and timeouts that make sense: a node serves at least one connection, a handshake
# and a frame get some time, an idle limit of 0 means none.
_PER_NODE = bounded(int, at_least=0)
_AT_LEAST_ONE = bounded(int, at_least=1)
_TIMEOUT = bounded(parse_duration, above=0.0, at_most=MAX_DURATION, unit="s")
_IDLE = bounded(parse_duration, above=0.0, at_most=MAX_DURATION, zero="never", unit="s")

# A spin is a latency trade: past a millisecond it only burns a CPU.
_MAX_BUSY_POLL = 1e-3


def _parse_busy_poll(text: str | float) -> float:
    seconds = parse_duration(text)
    if seconds > _MAX_BUSY_POLL:
        raise ConfigError(f"tcp.busy_poll is at most 1ms, not {text!r} (0 turns it off)")
    return seconds


class TcpTransport(Transport):
    name = "tcp"
    # Any host; the fallback where no one-sided transport reaches.
    preference = 20
    options = (
        OptionSpec(name="pool", parse=_PER_NODE, default=8, help="idle connections kept per node"),
        OptionSpec(
            name="max_connections",
            parse=_AT_LEAST_ONE,
            default=1024,
            help="authenticated connections the node serves at once (a thread each)",
        ),
        OptionSpec(
            name="max_pending",
            parse=_AT_LEAST_ONE,
            default=128,
            help="connections still in their handshake; past it the oldest is closed",
        ),
        OptionSpec(
            name="handshake_timeout",
            parse=_TIMEOUT,
            default=5.0,
            help="a new connection must complete its handshake (TLS included) within this",
        ),
        OptionSpec(
            name="idle_timeout",
            parse=_IDLE,
            default=300.0,
            help="the node closes a connection idle between frames this long (0: never)",
        ),
        OptionSpec(
            name="frame_timeout",
            parse=_TIMEOUT,
            default=30.0,
            help="a frame and its reply, from the frame's first byte, must complete within this",
        ),
        OptionSpec(
            name="busy_poll",
            parse=_parse_busy_poll,
            default=50e-6,
            help="spin this long for a reply (client) or the next frame (node) before sleeping"
            " (0: off); waking a sleeping thread costs more than a small round trip",
        ),
        OptionSpec(
            name="send_buffer",
            parse=parse_send_buffer,
            default="auto",
            help="each connection's send buffer (client: writes, node: reads): auto is 256KiB "
            "to a peer on this host (its bytes stay in cache) and the kernel's autotuning to "
            "any other; 0 autotuning always; or a size",
        ),
        OptionSpec(
            name="read_lanes",
            parse=parse_read_lanes,
            default="auto",
            help="client: connections a read of 8MiB or more to one node moves over at once, "
            "a receiving thread each (1-8); auto is 2 on a host with 4 CPUs or more, else 1",
        ),
        OptionSpec(
            name="tls",
            parse=parse_bool,
            default=False,
            help="TLS on the data port (both sides); the node needs tls_cert, clients tls_ca",
        ),
        OptionSpec(
            name="tls_cert",
            parse=pem_file,
            default="",
            help="node: PEM certificate chain presented with tcp.tls",
        ),
        OptionSpec(
            name="tls_key",
            parse=pem_file,
            default="",
            help="node: PEM private key of tls_cert (default: inside tls_cert)",
        ),
        OptionSpec(
            name="tls_ca",
            parse=ca_file,
            default="",
            help="client: PEM CA certificate(s) to verify nodes by (default: the system's)",
        ),
    )
    capabilities = Capabilities(
        one_sided=False,
        local_only=False,
        memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.FILE}),
    )

    @classmethod
    def create_server(cls, config: TransportConfig) -> TransportServer:
        options = cls.parse_options(config.options)
        limits = ServerLimits(
            max_connections=int(options["max_connections"]),
            max_pending=int(options["max_pending"]),
            handshake_timeout=float(options["handshake_timeout"]),
            idle_timeout=float(options["idle_timeout"]),
            frame_timeout=float(options["frame_timeout"]),
            busy_poll=float(options["busy_poll"]),
            send_buffer=parse_send_buffer(options["send_buffer"]),
        )
        tls = server_context(options["tls_cert"], options["tls_key"]) if options["tls"] else None
        return TcpServer(config, limits, tls)

    @classmethod
    def create_client(cls, config: TransportConfig) -> TransportClient:
        options = cls.parse_options(config.options)
        tls = client_context(options["tls_ca"]) if options["tls"] else None
        return TcpClient(
            config,
            int(options["pool"]),
            tls,
            float(options["busy_poll"]),
            parse_send_buffer(options["send_buffer"]),
            parse_read_lanes(options["read_lanes"]),
        )
