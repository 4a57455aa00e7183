"""KV events from both prefix caches: the same events, in vLLM's shape, for the same traffic."""

import pytest

from jaxserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSink, external_hash
from jaxserve.core.kv_manager import KVManager
from jaxserve.core.prefix_cache import BlockKeys
from jaxserve.core.request import Request

from .test_prefix_cache import serve

BOTH = ["hash", "radix"]
BS = 4


def manager(cache: str, num_blocks: int = 16, capacity: int = 1000) -> KVManager:
    kv = KVManager(num_blocks, BS, cache, "lru", hash_seed=7)
    kv.cache.events = KVEventSink(BS, capacity=capacity)
    return kv


def chain(tokens: list[int], n: int) -> list[int]:
    keys = BlockKeys(tokens, None, BS, (7).to_bytes(8, "little", signed=True))
    return [external_hash(keys.block_hash(i)) for i in range(n)]


@pytest.mark.parametrize("cache", BOTH)
def test_store_share_evict_reset(cache):
    kv = manager(cache)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    serve(kv, a, "a")
    (ev,) = kv.cache.events.drain()
    assert ev == BlockStored(chain(a, 2), None, a[:8], BS, None, "GPU")

    b = a[:8] + [1, 2, 3, 4, 5]  # shares a's 2 blocks, adds one more
    _, hit = serve(kv, b, "b")
    assert hit == 8
    (ev,) = kv.cache.events.drain()
    # the new block chains onto a's second block: parent hash = a's block 1
    assert ev == BlockStored(chain(b, 3)[2:], chain(a, 2)[1], b[8:12], BS, None, "GPU")

    evicted = kv.evict(1)  # LRU: b's tail block goes first
    assert evicted == 1
    assert kv.cache.events.drain() == [BlockRemoved(chain(b, 3)[2:], "GPU")]

    kv.reset_cache()
    events = kv.cache.events.drain()
    assert [type(e) for e in events] == [BlockRemoved, AllBlocksCleared]
    assert set(events[0].block_hashes) == set(chain(a, 2)) and events[0].medium == "GPU"


@pytest.mark.parametrize("cache", BOTH)
def test_reset_with_a_running_request_is_not_all_cleared(cache):
    kv = manager(cache)
    serve(kv, list(range(8)), "done")
    held = Request("held", list(range(50, 59)), 1)
    assert kv.allocate(held, held.num_tokens, kv.match(held))
    held.num_computed_tokens = held.num_tokens
    kv.commit(held)
    kv.cache.events.drain()
    kv.reset_cache()
    events = kv.cache.events.drain()
    assert [type(e) for e in events] == [BlockRemoved]  # held's blocks stay cached: no AllBlocksCleared
    assert set(events[0].block_hashes) == set(chain(list(range(8)), 2))


def test_both_caches_emit_the_same_stores():
    logs = {}
    for cache in BOTH:
        kv = manager(cache)
        for i, p in enumerate([list(range(12)), list(range(8)) + [9, 9, 9, 9, 9], list(range(4)) + [7] * 9]):
            serve(kv, p, f"r{i}")
        logs[cache] = kv.cache.events.drain()
    assert logs["hash"] == logs["radix"]
    assert all(isinstance(e, BlockStored) for e in logs["hash"])


def test_bounded_queue_drops_and_counts():
    kv = manager("hash", num_blocks=64, capacity=2)
    for i in range(5):
        serve(kv, [1000 * i + t for t in range(5)], f"r{i}")
    assert len(kv.cache.events) == 2 and kv.cache.events.dropped == 3
