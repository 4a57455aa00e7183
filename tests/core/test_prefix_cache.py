"""Behaviour of both prefix caches through the KV manager: order of eviction, isolation, reuse."""

import pytest

from jaxserve.core.kv_manager import KVManager
from jaxserve.core.request import Request

BOTH = ["hash", "radix"]


def compute(kv: KVManager, req: Request) -> int:
    """Admit req with its cache hit and compute its whole prompt; returns the hit in tokens."""
    hits = kv.match(req)
    assert kv.allocate(req, req.num_tokens - len(hits) * kv.block_size, hits)
    req.num_computed_tokens = req.num_tokens
    kv.commit(req)
    kv.check_invariants()
    return len(hits) * kv.block_size


def serve(kv: KVManager, prompt: list[int], rid: str, salt: str | None = None) -> tuple[Request, int]:
    req = Request(rid, prompt, 1, cache_salt=salt)
    hit = compute(kv, req)
    kv.forget(req)
    kv.check_invariants()
    return req, hit


@pytest.mark.parametrize("cache", BOTH)
def test_exact_lru_order(cache):
    kv = KVManager(16, 2, cache, "lru")
    blocks = {}
    for name, base in [("a", 10), ("b", 20), ("c", 30)]:
        req = Request(name, [base, base + 1, base + 2, base + 3, base + 4], 1)  # 2 full blocks + 1
        compute(kv, req)
        blocks[name] = req.block_ids[:2]
        kv.forget(req)
    # re-use a: it becomes the most recent
    _, hit = serve(kv, [10, 11, 12, 13, 99], "a2")
    assert hit == 4
    order = [kv.cache.evict(1)[0] for _ in range(6)]
    # least recently released first; within a request, the tail block first (as vLLM)
    want = [blocks["b"][1], blocks["b"][0], blocks["c"][1], blocks["c"][0], blocks["a"][1], blocks["a"][0]]
    assert order == want
    for b in order:
        kv.pool.push(b)
    kv.check_invariants()


@pytest.mark.parametrize("cache", BOTH)
@pytest.mark.parametrize("eviction", ["lru", "trunk"])
def test_trunk_survives_a_flood_of_one_off_leaves_only_under_trunk(cache, eviction):
    bs = 2
    kv = KVManager(20, bs, cache, eviction)  # 19 usable blocks
    trunk = list(range(100, 108))  # 4 blocks
    for i in range(3):  # three branches hang off the trunk; the 2nd and 3rd hit it
        serve(kv, trunk + [200 + 10 * i, 201 + 10 * i, 202 + 10 * i, 203 + 10 * i, 5], f"branch{i}")
    for i in range(12):  # one-off prompts, 3 blocks each: 36 blocks through a 19-block cache
        serve(kv, [1000 + 10 * i + j for j in range(5)], f"flood{i}")
    assert kv.stats.evictions > 0
    _, hit = serve(kv, trunk + [7, 8, 9], "late")
    if eviction == "trunk":
        assert hit == len(trunk)
    else:
        assert hit < len(trunk)


@pytest.mark.parametrize("cache", BOTH)
def test_cache_salt_isolates(cache):
    kv = KVManager(32, 4, cache)
    prompt = list(range(13))
    assert serve(kv, prompt, "x1", "x")[1] == 0
    assert serve(kv, prompt, "y1", "y")[1] == 0
    assert serve(kv, prompt, "n1", None)[1] == 0
    assert serve(kv, prompt, "x2", "x")[1] == 12
    assert serve(kv, prompt, "y2", "y")[1] == 12
    assert serve(kv, prompt, "n2", None)[1] == 12


@pytest.mark.parametrize("cache", BOTH)
def test_prefix_one_token_short_of_a_block_boundary_reuses_the_full_blocks_before_it(cache):
    bs = 4
    kv = KVManager(32, bs, cache)
    prompt = list(range(1, 4 * bs + 1))  # 4 full blocks
    serve(kv, prompt, "first")
    req = Request("short", prompt[: 3 * bs - 1], 1)  # one token short of 3 blocks
    hit = compute(kv, req)
    assert hit == 2 * bs and req.block_ids[:2] == kv.match(Request("probe", prompt, 1))[:2]
    kv.forget(req)
    # exactly on a boundary: at least one token is computed, so the last full block is not reused
    assert serve(kv, prompt[: 3 * bs], "boundary")[1] == 2 * bs
    assert serve(kv, prompt[: 3 * bs + 1], "past")[1] == 3 * bs


def test_off_caches_nothing():
    kv = KVManager(16, 2, "off")
    serve(kv, [1, 2, 3, 4, 5], "a")
    assert serve(kv, [1, 2, 3, 4, 5], "b")[1] == 0
    assert kv.num_free_blocks == 15


@pytest.mark.parametrize("cache", BOTH)
def test_two_requests_computing_the_same_block_end_up_sharing_one(cache):
    kv = KVManager(16, 2, cache)
    a, b = Request("a", [1, 2, 3, 4, 5], 1), Request("b", [1, 2, 3, 4, 6], 1)
    for r in (a, b):  # both admitted before either committed: no hit
        assert kv.allocate(r, r.num_tokens, kv.match(r))
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        kv.commit(r)
        kv.check_invariants()
    assert a.block_ids[:2] == b.block_ids[:2]  # b's duplicate copies went back to the pool
    assert kv.num_free_blocks == 15 - 4
    kv.forget(a)
    kv.forget(b)
    kv.check_invariants()


def test_radix_split_on_partial_match_and_counters():
    kv = KVManager(32, 2, "radix")
    serve(kv, [1, 2, 3, 4, 5, 6, 7], "a")  # one node of 3 blocks
    req, hit = serve(kv, [1, 2, 3, 4, 9, 9, 9], "b")  # splits after 2 blocks
    assert hit == 4
    cache = kv.cache
    root = cache.roots[None]
    (top,) = root.children.values()
    assert len(top.blocks) == 2 and len(top.children) == 2
    assert cache.evictable == cache.num_cached == 4 and cache.protected == 0
    kv.check_invariants()
