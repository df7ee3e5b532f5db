"""The ``tcp`` transport: one-sided reads and writes emulated by threads on the data node.

The fallback for nodes no RDMA fabric reaches. The node checks every segment again (a
client is not trusted) and moves bytes straight between the socket and region memory; the
client keeps a pool of authenticated connections per node. This module is the plug-in the
``tcp`` entry point names (its registration hook); the pieces, one job each:

- ``transport``: the options, the capabilities, and the client and node made from them;
- ``wire``: the frame format (version 2) and its limits;
- ``auth``: the per-connection challenge and response: the secret never crosses the wire,
  and a recorded handshake is refused on any other connection;
- ``tls``: optional TLS (``tcp.tls=true``) from the standard library's ``ssl``;
- ``tuning``: a connection's socket options, and how many lanes a large read takes;
- ``stream``: socket I/O bounded by deadlines: plain, kvfabric's native loops (a client's
  frame, request to last payload with its CRC32Cs, is one native call that takes the GIL
  back once); with TLS, Python's ``ssl`` (the GIL back per ``ssl`` call);
- ``gate``: the node's accept loop, where connections that have not authenticated wait,
  bounded in number, time and memory;
- ``server``: the node's side, a thread per authenticated connection;
- ``client``, over ``connection`` (one authenticated connection and its frames), ``pool``
  (the idle connections kept per node) and ``batches`` (a batch cut into frames or lanes).

Threats and what each setting defends against: docs/security.md.
"""

from __future__ import annotations

from kvfabric.spi import Registry, Transport, hookimpl
from kvfabric.transports.tcp.transport import TcpTransport

__all__ = ["TcpTransport"]


@hookimpl
def kvfabric_register_transports(registry: Registry[Transport]) -> None:
    registry.add(TcpTransport.name, TcpTransport)
