"""The KV event publisher and wire form, in process: batches, merging, bounds, replay."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvfabric import EngineBlock
from kvfabric._control.controller import Controller
from kvfabric._control.kv_event_wire import EventKind, decode_batch, encode_batch
from kvfabric._control.kv_events import END_SEQ, EventQueue, KvEventPublisher, binds
from kvfabric.errors import ConfigError
from kvfabric.indexes.memory import MemoryIndex
from kvfabric.spi import IndexConfig, IndexEvents
from kvfabric.testing import wait_for

KEY = bytes(range(32))


def _block(i: int, parent: int | None, tokens: int = 4) -> EngineBlock:
    return EngineBlock(
        hash=i, parent=parent, token_ids=range(i * tokens, i * tokens + tokens), block_size=4
    )


def test_a_chain_of_full_blocks_is_one_block_stored_as_vllm_runs_them() -> None:
    changes = [
        (EventKind.STORED, KEY, _block(1, None)),
        (EventKind.STORED, KEY, _block(2, 1)),
        (EventKind.STORED, KEY, _block(7, 5)),  # not the chain's next: an event of its own
        (EventKind.STORED, KEY, None),
        (EventKind.REMOVED, KEY, 2),
        (EventKind.REMOVED, KEY, None),
        (EventKind.CLEARED, b"", None),
    ]
    ts, events, rank = decode_batch(encode_batch(changes, 12.5))
    assert (ts, rank) == (12.5, 0)
    assert [e["type"] for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert events[0]["block_hashes"] == [1, 2]
    assert events[0]["token_ids"] == list(range(4, 12))
    assert events[1]["parent_block_hash"] == 5
    assert events[2]["block_hashes"] == [KEY]
    assert events[3] == {"type": "BlockRemoved", "block_hashes": [2, KEY], "medium": "kvfabric"}


def test_the_payload_is_a_msgpack_array_of_ts_events_and_rank() -> None:
    raw = msgspec.msgpack.decode(encode_batch([(EventKind.CLEARED, b"", None)], 1.0))
    assert raw == [1.0, [{"type": "AllBlocksCleared"}], 0]


def test_engine_blocks_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        EngineBlock(hash=1 << 64)
    with pytest.raises(ValueError, match="of 0 bytes"):
        EngineBlock(hash=b"")
    with pytest.raises(TypeError):
        EngineBlock(hash="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        EngineBlock(hash=1, token_ids=[-1])


def test_binds_by_vllms_rule() -> None:
    assert binds("tcp://*:5557")
    assert binds("ipc:///tmp/x")
    assert binds("tcp://[::]:1")
    assert not binds("tcp://10.0.0.1:5557")


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """What the replay socket answers to ``start``, the end marker last."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        frames = []
        while not frames or frames[-1][2] != END_SEQ:
            assert dealer.poll(30_000), "the replay socket did not answer"
            frames.append(dealer.recv_multipart())
        return frames
    finally:
        dealer.close(linger=0)


def test_a_full_queue_drops_its_oldest_counted_and_the_next_batch_skips_a_number() -> None:
    queue = EventQueue(bound=4)
    publisher = KvEventPublisher(
        "tcp://*:0", replay="tcp://127.0.0.1:0", queue=queue, first_seq=100
    )
    try:
        for i in range(10):
            queue.stored(i.to_bytes(32, "big"), None)  # nobody drains: the thread is not started
        assert queue.dropped == 6
        assert len(queue) == 4
        publisher.start()
        wait_for("a batch sent", lambda: publisher.stats()["kv_event_batches"] == 1)
        (_, _, seq, payload), _end = _replay(publisher.replay_endpoint, 0)
        # Number 100 went to the dropped changes: the gap tells subscribers of the loss.
        assert int.from_bytes(seq, "big") == 101
        assert [e["block_hashes"][0][-1] for e in decode_batch(payload)[1]] == [6, 7, 8, 9]
        assert publisher.stats()["kv_events_dropped"] == 6
        assert publisher.stats()["kv_event_gaps"] == 1
    finally:
        publisher.close()


def test_replay_answers_a_start_with_the_batches_kept_since_and_the_end_marker() -> None:
    publisher = KvEventPublisher("tcp://*:0", replay="tcp://127.0.0.1:0", topic="kv", first_seq=0)
    publisher.start()
    try:
        for i in range(3):
            publisher.queue.stored(i.to_bytes(32, "big"), None)
            wait_for(
                "a batch sent",
                lambda i=i: publisher.stats()["kv_event_batches"] == i + 1,  # type: ignore[misc]
            )
        frames = _replay(publisher.replay_endpoint, 1)
        assert [(f[1], int.from_bytes(f[2], "big")) for f in frames[:-1]] == [
            (b"kv", 1),
            (b"kv", 2),
        ]
        assert frames[-1] == [b"", b"", END_SEQ, b""]
    finally:
        publisher.close()


def test_a_controller_refuses_kv_events_with_an_index_that_reports_none() -> None:
    class Silent(MemoryIndex):
        def report_events(self, events: IndexEvents) -> bool:
            return False

    index = Silent.create(IndexConfig())
    publisher = KvEventPublisher("tcp://*:0")
    try:
        with pytest.raises(ConfigError, match="reports no KV events"):
            Controller(listen="tcp://127.0.0.1:0", index=index, kv_events=publisher)
    finally:
        publisher.close()
        index.close()


def test_an_embedded_store_takes_blocks_and_checks_them() -> None:
    import kvfabric

    keys = [bytes([i]) * 32 for i in range(2)]
    with kvfabric.connect("embedded://?capacity=8MiB") as store:
        blocks = [EngineBlock(hash=1), None]
        assert (
            store.batched_put(keys, [b"a", b"b"], blocks=blocks) == [kvfabric.PutOutcome.STORED] * 2
        )
        with pytest.raises(ValueError, match="1 blocks for 2 keys"):
            store.batched_put(keys, [b"a", b"b"], blocks=[None])
        with pytest.raises(TypeError, match="not an EngineBlock"):
            store.batched_put(keys, [b"a", b"b"], blocks=[1, None])  # type: ignore[list-item]


def test_replay_without_events_is_refused_naming_the_options() -> None:
    import argparse

    from kvfabric._tools.server_build import kv_events_from

    args = argparse.Namespace(kv_events=None, kv_events_replay="tcp://*:1", kv_events_topic="")
    with pytest.raises(ConfigError, match=r"--kv-events-replay.*--kv-events"):
        kv_events_from(args)
    assert kv_events_from(argparse.Namespace(kv_events=None, kv_events_replay=None)) is None


def test_an_endpoint_in_use_fails_at_start_naming_the_option() -> None:
    first = KvEventPublisher("tcp://*:0")
    try:
        with pytest.raises(ConfigError, match="--kv-events: cannot bind"):
            KvEventPublisher(first.endpoint.replace("0.0.0.0", "*"))
    finally:
        first.close()
