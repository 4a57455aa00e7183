"""KV-cache events in vLLM's shape (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), jax-free.

Prefix-aware routers (llm-d, NVIDIA Dynamo, the Gateway API Inference Extension) keep an index of
which blocks each replica holds from these events. Both prefix caches report to a `KVEventSink`:
a bounded, lock-free (CPython deque) buffer the engine thread appends to and a publisher thread
drains. When nobody drains it fast enough, new events are dropped and counted: a slow or absent
subscriber never slows a step (subscribers see the gap as missing sequence numbers downstream).

Field order is vLLM's (vllm/distributed/kv_events.py, as its subscriber example decodes it:
msgspec structs with `array_like=True, tag=True`, i.e. `[tag, field, ...]`).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

MEDIUM = "GPU"  # vLLM's name for the engine's own KV memory (the device tier), whatever the chip


def external_hash(h: bytes) -> int:
    """A block hash as routers take it: a non-negative 63-bit integer (msgpack int64 or uint64)."""
    return int.from_bytes(h[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


class BlockStored(NamedTuple):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(NamedTuple):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_array(event: KVEvent) -> list:
    """msgspec's tagged array_like layout: the class name, then the fields in order."""
    return [type(event).__name__, *event]


class KVEventSink:
    """Bounded buffer of KV events; the caches call stored/removed/cleared on the engine thread."""

    def __init__(self, block_size: int, capacity: int = 100_000, medium: str | None = MEDIUM) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.medium = medium
        self.dropped = 0
        self._events: deque[KVEvent] = deque()

    def _put(self, event: KVEvent) -> None:
        if len(self._events) >= self.capacity:
            self.dropped += 1
            return
        self._events.append(event)

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        """A chain of consecutive full blocks was cached; parent is the hash of the block before."""
        assert len(token_ids) == len(hashes) * self.block_size
        self._put(BlockStored([external_hash(h) for h in hashes],
                              None if parent is None else external_hash(parent),
                              token_ids, self.block_size, None, self.medium))

    def removed(self, hashes: list[bytes]) -> None:
        if hashes:
            self._put(BlockRemoved([external_hash(h) for h in hashes], self.medium))

    def cleared(self) -> None:
        self._put(AllBlocksCleared())

    def drain(self, limit: int = 1 << 30) -> list[KVEvent]:
        """Take up to `limit` buffered events, oldest first (safe from another thread)."""
        out: list[KVEvent] = []
        while self._events and len(out) < limit:
            out.append(self._events.popleft())
        return out

    def __len__(self) -> int:
        return len(self._events)
