"""The read contract against a controller that answers badly: counted misses, never exceptions.

The controller here is a small ZeroMQ ROUTER on 127.0.0.1 that answers every request with an
``ERROR`` reply, with bytes that are not a frame, or with a reply of the wrong type: what a
real controller does when it refuses a request, and what a broken one might do.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import zmq

import kvfabric
from kvfabric import PutOutcome
from kvfabric._control.client import ControlClient, ControllerRefusedError, UnknownNodeError
from kvfabric._runtime.codec import Writer
from kvfabric._wire.protocol import (
    REPLY_BIT,
    ErrorCode,
    MsgType,
    decode_header,
    encode,
)
from kvfabric.keys import chain_keys
from kvfabric.testing import free_port

Reply = Callable[[int], bytes]


def _error(code: int) -> Reply:
    body = Writer().u32(code).text("refused for the test").getvalue()
    return lambda request_id: encode(MsgType.ERROR, request_id, body, 1)


REPLIES: dict[str, Reply] = {
    "error reply": _error(ErrorCode.INTERNAL),
    "bytes that are not a frame": lambda request_id: b"not a kvfabric frame at all",
    "reply of the wrong type": lambda request_id: encode(MsgType.STATS | REPLY_BIT, request_id),
}


class FakeController:
    """A ROUTER answering every request with ``reply(request_id)``; counts what it got."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.port = free_port()
        self.requests = 0
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._bound.wait(10)

    def _serve(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                identity, frame = sock.recv_multipart()
                header, _ = decode_header(frame)
                # A usage report goes off the calls' path (not a control RPC of theirs).
                self.requests += header.type != MsgType.USAGE
                sock.send_multipart([identity, self.reply(header.request_id)])
        finally:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(params=sorted(REPLIES))
def fake(request: pytest.FixtureRequest) -> Iterator[FakeController]:
    controller = FakeController(REPLIES[request.param])
    yield controller
    controller.close()


def _keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n)), 1, namespace=uuid.uuid4().bytes)


def test_a_controller_answering_badly_gives_counted_misses_and_no_exception(
    fake: FakeController,
) -> None:
    with kvfabric.connect(f"kvfabric://127.0.0.1:{fake.port}?control_timeout=5s") as store:
        keys = _keys(3)
        before = store.stats()
        assert store.batched_contains(keys) == 0
        assert store.batched_exists(keys) == [False] * 3
        assert store.batched_get(keys) == [None] * 3
        assert store.batched_get(keys, into=[bytearray(16) for _ in keys]) == [None] * 3
        assert store.batched_get_scattered(keys, [[bytearray(8)] for _ in keys]) == [False] * 3
        assert store.locate(keys) == [None] * 3
        assert store.batched_put(keys, [b"a", b"b", b"c"]) == [PutOutcome.FAILED] * 3
        assert store.delete(keys) == 0
        assert store.ping() is False
        after = store.stats()
    calls = 9
    assert after["control_rpcs"] - before["control_rpcs"] == calls
    assert after["controller_errors"] - before["controller_errors"] == calls
    assert after["controller_unavailable"] == 0
    assert after["get_misses"] == 9
    assert after["put_failures"] == 3
    assert after["delete_failures"] == 1
    assert fake.requests == after["control_rpcs"]  # construction asked for the nodes too


def test_without_a_controller_delete_and_put_report_failure_without_raising() -> None:
    with kvfabric.connect(f"kvfabric://127.0.0.1:{free_port()}?control_timeout=200ms") as store:
        keys = _keys(2)
        assert store.delete(keys) == 0
        assert store.batched_put(keys, [b"a", b"b"]) == [PutOutcome.FAILED] * 2
        assert store.locate(keys) == [None, None]
        stats = store.stats()
    assert stats["delete_failures"] == 1
    assert stats["put_failures"] == 2
    assert stats["controller_unavailable"] >= 1
    assert stats["controller_errors"] == 0


def test_programming_errors_still_raise_whatever_the_controller_does(
    fake: FakeController,
) -> None:
    with kvfabric.connect(f"kvfabric://127.0.0.1:{fake.port}?control_timeout=5s") as store:
        with pytest.raises(kvfabric.InvalidKeyError):
            store.batched_get([b"short"])
        with pytest.raises(ValueError, match="buffers for"):
            store.batched_get(_keys(2), into=[bytearray(1)])


@pytest.mark.parametrize(
    ("code", "error", "expected_code"),
    [
        (ErrorCode.UNKNOWN_NODE, UnknownNodeError, ErrorCode.UNKNOWN_NODE),
        (ErrorCode.BAD_VERSION, ControllerRefusedError, ErrorCode.BAD_VERSION),
        (999, ControllerRefusedError, 999),
    ],
)
def test_the_client_maps_error_codes_to_a_field_not_to_message_text(
    code: int, error: type[ControllerRefusedError], expected_code: int
) -> None:
    fake = FakeController(_error(code))
    client = ControlClient(f"tcp://127.0.0.1:{fake.port}", timeout=5)
    try:
        with pytest.raises(error) as caught:
            client.call(MsgType.NODES)
        assert type(caught.value) is error
        assert caught.value.code == expected_code
    finally:
        client.close()
        fake.close()
