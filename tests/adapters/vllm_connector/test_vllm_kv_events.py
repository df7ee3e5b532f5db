"""kvfabric's KV events read with vLLM's own classes, and the connector's events naming
blocks as vLLM does.

A subscriber written for vLLM's events decodes with ``vllm.distributed.kv_events``'
``KVEventBatch``: kvfabric's payloads must be exactly what vLLM's publisher would send for
the same events, and a router that tracks vLLM's block hashes must find them in the events
of what the connector stored.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm.v1", reason="needs vLLM: tox -e vllm")

from kv_event_subscriber import Decoded, Subscriber
from test_vllm import BLOCK, ENGINE, SHARED, EngineProcess
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

import kvfabric
from kvfabric import EngineBlock, PutOutcome
from kvfabric._control.kv_event_wire import EventKind, encode_batch
from kvfabric.keys import chain_keys
from kvfabric.testing import Cluster, free_port, wait_for

pytestmark = pytest.mark.slow

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def vllm_decode(payload: bytes) -> Decoded:
    """vLLM's own decoder; each event back as a map for the subscriber's view."""
    batch = _decoder.decode(payload)
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    return batch.ts, events, batch.data_parallel_rank


def test_payloads_are_byte_for_byte_what_vllm_encodes() -> None:
    key = bytes(range(32))
    chain = [
        EngineBlock(hash=b"\x01" * 32, token_ids=range(16), block_size=16),
        EngineBlock(hash=b"\x02" * 32, parent=b"\x01" * 32, token_ids=range(16, 32), block_size=16),
    ]
    lora = EngineBlock(hash=7, parent=6, token_ids=[1, 2], block_size=16, lora_id=3, lora_name="a")
    changes = [
        (EventKind.CLEARED, b"", None),
        (EventKind.STORED, key, chain[0]),
        (EventKind.STORED, key, chain[1]),
        (EventKind.STORED, key, lora),
        (EventKind.STORED, key, None),
        (EventKind.REMOVED, key, b"\x02" * 32),
        (EventKind.REMOVED, key, None),
    ]
    theirs = KVEventBatch(
        ts=1234.5,
        events=[
            AllBlocksCleared(),
            BlockStored(
                block_hashes=[b"\x01" * 32, b"\x02" * 32],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="kvfabric",
                lora_name=None,
            ),
            BlockStored(
                block_hashes=[7],
                parent_block_hash=6,
                token_ids=[1, 2],
                block_size=16,
                lora_id=3,
                medium="kvfabric",
                lora_name="a",
            ),
            BlockStored(
                block_hashes=[key],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="kvfabric",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=[b"\x02" * 32, key], medium="kvfabric"),
        ],
        data_parallel_rank=0,
    )
    assert encode_batch(changes, 1234.5) == msgspec.msgpack.encode(theirs)


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def cluster(ports: tuple[int, int]) -> Iterator[Cluster]:
    pub, replay = ports
    events = ["--kv-events", f"tcp://*:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]
    with Cluster(nodes=1, capacity="256MiB", controller_args=events) as cluster:
        cluster.wait_nodes(1)
        yield cluster


@pytest.fixture(scope="module")
def subscriber(cluster: Cluster, ports: tuple[int, int]) -> Iterator[Subscriber]:
    pub, replay = ports
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", decode=vllm_decode)
    sub.replay_from(0)
    try:
        yield sub
    finally:
        sub.close()


def test_vllms_decoder_reads_every_store_and_removal_in_order(
    cluster: Cluster, subscriber: Subscriber
) -> None:
    keys = chain_keys(list(range(6)), 1, namespace=b"kv-events-vllm")
    with kvfabric.connect(cluster.url()) as store:
        assert store.batched_put(keys, [b"v" * 4096] * 6) == [PutOutcome.STORED] * 6
        assert store.delete(keys[:2]) == 2

        def follows() -> bool:
            subscriber.poll()
            return subscriber.view() >= set(keys[2:]) and not subscriber.view() & set(keys[:2])

        wait_for("the events, decoded by vLLM's KVEventBatch", follows)
    kinds = [e["type"] for e in subscriber.events()]
    assert kinds[0] == "AllBlocksCleared"
    assert kinds.index("BlockRemoved") > max(i for i, k in enumerate(kinds) if k == "BlockStored")


def test_the_connectors_events_name_blocks_by_vllms_hashes(
    cluster: Cluster, subscriber: Subscriber, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = tmp_path_factory.mktemp("vllm-kv-events")
    model = logs / "tiny-llama"
    subprocess.run([sys.executable, str(ENGINE), "--make-model", str(model)], check=True)
    engine = EngineProcess("E", cluster.url(), model, logs)
    try:
        engine.reply(timeout=600)
        engine.generate(SHARED)
        assert engine.call("flush")["flushed"]
        hashes = engine.call("block_hashes", prompt=SHARED)["hashes"]
        named: list[Any] = [bytes.fromhex(h) if isinstance(h, str) else h for h in hashes]
        assert len(named) == len(SHARED) // BLOCK

        def stored() -> list[dict[str, Any]]:
            subscriber.poll()
            return [
                e
                for e in subscriber.events()
                if e["type"] == "BlockStored" and set(e["block_hashes"]) & set(named)
            ]

        events = wait_for(
            "the connector's stores, named by vLLM's hashes",
            stored,
            until=lambda found: {h for e in found for h in e["block_hashes"]} >= set(named),
        )
        # One chain, as vLLM's own events describe it: each block's tokens, its parent the
        # block before it.
        in_order = [h for e in events for h in e["block_hashes"]]
        assert in_order[: len(named)] == named
        assert events[0]["parent_block_hash"] is None
        assert events[0]["block_size"] == BLOCK
        tokens = [t for e in events for t in e["token_ids"]]
        assert tokens[: len(named) * BLOCK] == SHARED[: len(named) * BLOCK]
    finally:
        engine.close()
