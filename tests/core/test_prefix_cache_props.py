"""Random op sequences over tiny vocabularies (many shared prefixes) against the KV manager with
each cache; every invariant is checked after every op and no block may leak at the end."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv_manager import KVManager
from jaxserve.core.request import Request

CACHES = [("hash", "lru"), ("hash", "trunk"), ("radix", "lru"), ("radix", "trunk"), ("off", "lru")]


def _admit(kv: KVManager, req: Request, chunk: int, pending: dict) -> bool:
    hits = kv.match(req)
    cached = len(hits) * kv.block_size
    assert cached <= req.num_tokens - 1 and cached % kv.block_size == 0
    n = min(req.num_tokens - cached, chunk)
    if not kv.allocate(req, n, hits):
        assert not req.block_ids
        return False
    req.num_computed_tokens = cached
    pending[req.request_id] = n
    return True


@pytest.mark.parametrize("cache,eviction", CACHES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_ops_keep_invariants(cache, eviction, data):
    bs = data.draw(st.integers(1, 3), label="block_size")
    vocab = data.draw(st.integers(1, 3), label="vocab")
    kv = KVManager(data.draw(st.integers(3, 24), label="num_blocks"), bs, cache, eviction)
    waiting: list[Request] = []
    running: list[Request] = []
    pending: dict[str, int] = {}  # tokens allocated for, not yet computed
    token = st.integers(0, vocab - 1)
    for step in range(data.draw(st.integers(1, 60), label="steps")):
        op = data.draw(st.sampled_from(["new", "admit", "compute", "release", "preempt", "evict"]))
        if op == "new":
            prompt = data.draw(st.lists(token, min_size=1, max_size=4 * bs + 2))
            waiting.append(Request(f"r{step}", prompt, 8, cache_salt=data.draw(st.sampled_from([None, None, "s"]))))
        elif op == "admit" and waiting:
            req = waiting[data.draw(st.integers(0, len(waiting) - 1))]
            if _admit(kv, req, data.draw(st.integers(1, 6)), pending):
                waiting.remove(req)
                running.append(req)
        elif op == "compute" and running:
            req = running[data.draw(st.integers(0, len(running) - 1))]
            n = pending.get(req.request_id, 0)
            if n:  # the step ran: K/V written, newly full blocks go to the cache
                req.num_computed_tokens += n
                pending[req.request_id] = 0
                kv.commit(req)
                if req.num_computed_tokens == req.num_tokens:
                    req.append_token(data.draw(token))
            else:  # schedule the next chunk / decode token
                n = min(req.num_tokens - req.num_computed_tokens, data.draw(st.integers(1, 6)))
                if kv.allocate(req, n):
                    pending[req.request_id] = n
        elif op == "release" and running:
            req = running.pop(data.draw(st.integers(0, len(running) - 1)))
            kv.forget(req)
        elif op == "preempt" and running:
            req = running.pop(data.draw(st.integers(0, len(running) - 1)))
            kv.free(req)
            req.num_computed_tokens = 0
            pending[req.request_id] = 0
            waiting.insert(0, req)
        elif op == "evict":
            before = kv.cache.num_evictable
            got = kv.evict(data.draw(st.integers(0, 4)))
            assert kv.cache.num_evictable == before - got
        kv.check_invariants()
        for req in running:
            assert len(req.block_ids) * bs >= req.num_computed_tokens + pending.get(req.request_id, 0)
    for req in running:
        kv.forget(req)
    kv.check_invariants()
    assert kv.num_available_blocks == kv.num_blocks - 1, "a block leaked"
    kv.evict(kv.num_blocks)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.cache.num_cached == 0
