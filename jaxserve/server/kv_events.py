"""`--kv-events-config`: vLLM's KV-event publisher (ZMQ PUB + ROUTER replay, msgpack batches).

Wire format, as vLLM's `ZmqEventPublisher` sends it and its subscriber example reads it:
- PUB multipart frames `(topic, seq as 8-byte big-endian, payload)`; payload is a msgpack
  `KVEventBatch` = `[ts, [event, ...]]`, each event `[tag, field, ...]` (msgspec `array_like`,
  `tag=True`): `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
- Replay: a REQ client sends a start seq (8-byte big-endian) to the ROUTER at `replay_endpoint`;
  it gets every buffered `(seq, payload)` from there on, then `(-1 as 8 signed bytes, b"")`.

The engine thread only appends to the cache's bounded `KVEventSink`; this thread drains it into
one batch per poll, so a slow or absent subscriber (PUB drops at its high-water mark) never
slows a step.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

from jaxserve.core.kv_events import KVEventSink, event_to_array
from jaxserve.errors import UserError

log = logging.getLogger("jaxserve.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (same names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" | "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # events buffered between the engine and this thread
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"Invalid --kv-events-config: not JSON ({e.msg}); give e.g. "
                            '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'.',
                            param="kv_events_config") from None
        if not isinstance(raw, dict):
            raise UserError("Invalid --kv-events-config: must be a JSON object.", param="kv_events_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UserError(f"Invalid --kv-events-config: unknown field {unknown[0]!r}; known fields: "
                            f"{', '.join(sorted(known))}.", param="kv_events_config")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise UserError(f"Invalid --kv-events-config: publisher={cfg.publisher!r}; choose 'zmq' or "
                            "'null'.", param="kv_events_config")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"Invalid --kv-events-config: {name}={v!r} must be an integer >= 1.",
                                param="kv_events_config")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for data-parallel rank r: a tcp port + r, an inproc/ipc name + `_dp{r}`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class ZmqKVEventPublisher:
    """Drains a `KVEventSink` on its own thread and publishes vLLM-format batches."""

    POLL_S = 0.005

    def __init__(self, cfg: KVEventsConfig, sink: KVEventSink) -> None:
        try:
            import msgpack
            import zmq
        except ImportError:
            raise UserError("--kv-events-config with publisher 'zmq' needs pyzmq and msgpack: "
                            "pip install 'jaxserve[kv-events]'.", param="kv_events_config") from None
        self._zmq, self._pack = zmq, msgpack.Packer()
        self.sink = sink
        self.topic = cfg.topic.encode()
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if any(m in cfg.endpoint for m in ("*", "::")) or cfg.endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(cfg.endpoint)  # vLLM's rule: bind a wildcard, connect to a host
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise UserError(f"Invalid --kv-events-config: cannot open {cfg.endpoint!r} / "
                            f"{cfg.replay_endpoint!r}: {e}.", param="kv_events_config") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                events = self.sink.drain(limit=10_000)
                if events:
                    self._publish(events)
                elif stopping:
                    return
                else:
                    time.sleep(self.POLL_S)
            except Exception:  # never let the publisher take the server down
                log.exception("KV event publisher")
                time.sleep(0.1)

    def _publish(self, events) -> None:
        payload = self._pack.pack([time.time(), [event_to_array(e) for e in events]])
        seq = self.seq
        self.seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("Ignoring a replay request with %d frames (want identity, '', seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._close()

    def _close(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)


def attach_kv_events(engine, text: str | None, rank: int = 0) -> ZmqKVEventPublisher | None:
    """Parse `--kv-events-config`, hook a sink into the engine's prefix cache, start publishing.

    Call before the engine thread starts. `rank` offsets the endpoints as vLLM does for data
    parallel ranks (replicas launched by `--data-parallel-size`)."""
    if not text:
        return None
    cfg = KVEventsConfig.parse(text)
    if not cfg.active:
        return None
    cfg.endpoint = offset_endpoint(cfg.endpoint, rank)
    cfg.replay_endpoint = offset_endpoint(cfg.replay_endpoint, rank)
    kv = engine.scheduler.kv
    if not kv.caching:
        raise UserError("--kv-events-config needs a prefix cache: drop --prefix-cache off.",
                        param="kv_events_config")
    sink = KVEventSink(kv.block_size, capacity=cfg.max_queue_size)
    publisher = ZmqKVEventPublisher(cfg, sink)
    kv.cache.events = sink
    return publisher
