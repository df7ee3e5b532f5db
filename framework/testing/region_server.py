"""A data node's memory and one transport's server side, alone in a process: the server half
of the transport conformance suite (:class:`kvfabric.testing.RegionServer` runs it).

``python -m kvfabric.testing.region_server --transport shm --capacity 8MiB`` creates the
backend's regions, registers them with the transport, prints the node's description as one
hex line on stdout, and serves until its stdin closes. ``RegionServer`` runs this file by its
path instead, so the child imports neither pytest nor the suites.
"""

from __future__ import annotations

import argparse
import sys

from kvfabric._node.node import DataNode
from kvfabric.spi.backend import BackendConfig
from kvfabric.spi.transport import TransportConfig
from kvfabric.spi.units import parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfabric.testing.region_server")
    parser.add_argument("--transport", required=True)
    parser.add_argument("--backend", default="dram")
    parser.add_argument("--capacity", default="8MiB")
    parser.add_argument("--region-size", default="4MiB")
    parser.add_argument("--token", default="")
    args = parser.parse_args(argv)
    node = DataNode.create(
        backend=args.backend,
        transports=[args.transport],
        backend_config=BackendConfig(
            capacity=parse_size(args.capacity), region_size=parse_size(args.region_size)
        ),
        transport_config=TransportConfig(host="127.0.0.1", token=args.token.encode()),
    )
    try:
        sys.stdout.write(node.info().to_bytes().hex() + "\n")
        sys.stdout.flush()
        sys.stdin.read()  # serve until the test closes our stdin (or dies)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
