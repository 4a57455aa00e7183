"""`--kv-events-config`: a ZMQ subscriber decodes the server's KV events exactly as vLLM's own
example (examples/online_serving/kv_events_subscriber.py) does: msgspec array_like tagged structs,
multipart (topic, seq, payload), replay over a REQ socket. Both prefix caches, same events."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from jaxserve.errors import UserError
from jaxserve.server.kv_events import KVEventsConfig, offset_endpoint

from .conftest import ServerThread, free_port


# vLLM's types as its subscriber example declares them (field order is the wire contract)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


TOPIC = "kv-events"
PROMPT = list(range(300, 340))  # 40 tokens: 2 full 16-token blocks


def collect(sub, decoder, until, timeout=30.0) -> list[tuple[int, Any]]:
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            for e in decoder.decode(payload).events:
                out.append((int.from_bytes(seq, "big"), e))
            if until(out):
                return out
    raise AssertionError(f"timed out; got {out}")


def run_one(tiny_llama, cache: str) -> dict:
    pub, replay_port = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC, "buffer_steps": 100}
    server = ServerThread(tiny_llama, {"prefix_cache": cache}, precompile=False,
                          kv_events_config=json.dumps(cfg))
    ctx = zmq.Context.instance()
    # replay client: a DEALER (vLLM's example uses REQ, which keeps only the first of the replies)
    sub, req = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.connect(f"tcp://127.0.0.1:{pub}")
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        time.sleep(0.5)  # PUB/SUB slow joiner
        decoder = Decoder(type=KVEventBatch)
        client = server.client()
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, temperature=0)
        got = collect(sub, decoder, lambda o: any(isinstance(e, BlockStored) for _, e in o))
        stored = [e for _, e in got if isinstance(e, BlockStored)]
        assert stored[0].token_ids == PROMPT[:32] and stored[0].parent_block_hash is None
        assert len(stored[0].block_hashes) == 2 and stored[0].block_size == 16
        assert stored[0].medium == "GPU" and stored[0].lora_id is None

        assert server.on_engine(lambda e: e.scheduler.kv.evict(1)) == 1  # forced eviction
        got += collect(sub, decoder, lambda o: any(isinstance(e, BlockRemoved) for _, e in o))
        removed = [e for _, e in got if isinstance(e, BlockRemoved)]
        assert removed[0].block_hashes == stored[0].block_hashes[1:]  # the tail block goes first

        with server.http() as h:
            assert h.post("/reset_prefix_cache").status_code == 200
        got += collect(sub, decoder, lambda o: isinstance(o[-1][1], AllBlocksCleared))

        # replay from seq 0: every batch again, in order, then vLLM's end marker (-1, b"")
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000), "no replay answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed += [(int.from_bytes(seq, "big"), e) for e in decoder.decode(payload).events]
        assert replayed == got
        assert [s for s, _ in got] == sorted(s for s, _ in got)
        return {"stored": stored[0], "removed": removed[0]}
    finally:
        sub.close(0)
        req.close(0)
        server.stop()


def test_both_caches_publish_vllms_events(tiny_llama):
    radix = run_one(tiny_llama, "radix")
    hashed = run_one(tiny_llama, "hash")
    assert radix == hashed  # same chained hashes, same events, whichever cache design


def test_config_errors_name_the_field():
    for text, word in (("{", "not JSON"), ('{"enable_kv_cache_events": true, "colour": 1}', "'colour'"),
                       ('{"publisher": "kafka"}', "kafka"), ('{"hwm": 0}', "hwm")):
        with pytest.raises(UserError, match=word) as e:
            KVEventsConfig.parse(text)
        assert e.value.param == "kv_events_config"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
