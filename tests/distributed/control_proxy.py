"""A control-plane proxy that loses what a test tells it to, run as a process of its own.

``python control_proxy.py CONTROLLER --drop-requests PUBLISH,ABORT --drop-replies PUBLISH``
binds a ROUTER on 127.0.0.1 (any free port), prints ``listening on tcp://127.0.0.1:PORT``,
and forwards each client's frames to the controller over a DEALER of its own (one per client
socket, so the controller sees the clients' sockets apart), and the replies back — except
requests of the types in ``--drop-requests`` (never served: the controller never sees them)
and replies to the types in ``--drop-replies`` (served, but the client never hears of it).
``TYPE@N`` drops from the Nth frame of that type on (the earlier ones pass). It serves until
its stdin closes.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter

import zmq

from kvfabric._wire.protocol import REPLY_BIT, MsgType, decode_header


def _rules(text: str) -> dict[int, int]:
    """ "PUBLISH,ABORT@2" -> {type: the first occurrence dropped (1-based)}."""
    rules = {}
    for item in filter(None, text.split(",")):
        name, _, since = item.partition("@")
        rules[int(MsgType[name])] = int(since or 1)
    return rules


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("controller")
    parser.add_argument("--drop-requests", default="")
    parser.add_argument("--drop-replies", default="")
    args = parser.parse_args()
    drop_requests, drop_replies = _rules(args.drop_requests), _rules(args.drop_replies)
    seen_requests: Counter[int] = Counter()
    seen_replies: Counter[int] = Counter()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    front = context.socket(zmq.ROUTER)
    front.linger = 0
    port = front.bind_to_random_port("tcp://127.0.0.1")
    backends: dict[bytes, zmq.Socket[bytes]] = {}
    owners: dict[zmq.Socket[bytes], bytes] = {}
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    stopping = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stopping.set()), daemon=True).start()
    print(f"listening on tcp://127.0.0.1:{port}", flush=True)
    while not stopping.is_set():
        for sock, _ in poller.poll(100):
            if sock is front:
                identity, frame = front.recv_multipart()
                kind = decode_header(frame)[0].type
                seen_requests[kind] += 1
                if kind in drop_requests and seen_requests[kind] >= drop_requests[kind]:
                    continue
                backend = backends.get(identity)
                if backend is None:
                    backend = backends[identity] = context.socket(zmq.DEALER)
                    backend.linger = 0
                    backend.connect(args.controller)
                    owners[backend] = identity
                    poller.register(backend, zmq.POLLIN)
                backend.send(frame)
            else:
                frame = sock.recv()
                kind = decode_header(frame)[0].type & ~REPLY_BIT
                seen_replies[kind] += 1
                if kind in drop_replies and seen_replies[kind] >= drop_replies[kind]:
                    continue
                front.send_multipart([owners[sock], frame])
    for backend in backends.values():
        backend.close(linger=0)
    front.close(linger=0)
    context.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
