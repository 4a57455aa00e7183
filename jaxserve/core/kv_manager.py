"""Gives requests KV blocks, shares cached prefixes between them, and counts what it does.

Memory pressure escalates in order: free blocks -> evict unreferenced cached blocks. Preemption,
the last step, is the scheduler's decision (it picks the victim) and calls `free`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import NULL_BLOCK, BlockPool
from .prefix_cache import BlockKeys, make_prefix_cache
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class KVStats:
    queries: int = 0  # prompt tokens looked up on admission
    hits: int = 0  # of which found in the cache
    hit_blocks: int = 0
    evictions: int = 0  # cached blocks dropped to make room


class KVManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: str = "radix",
        eviction: str = "lru",
        hash_seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = make_prefix_cache(prefix_cache, self.pool, block_size, eviction)
        self.caching = prefix_cache != "off"
        self.stats = KVStats()
        self._seed = hash_seed.to_bytes(8, "little", signed=True)
        self._keys: dict[str, BlockKeys] = {}
        self._committed: dict[str, int] = {}  # full blocks of the request already in the cache
        self._holders: dict[str, Request] = {}  # requests holding blocks (for invariant checks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_available_blocks(self) -> int:
        """Blocks a request could get right now: free plus evictable."""
        return self.pool.num_free + self.cache.num_evictable

    def keys(self, req: Request) -> BlockKeys:
        k = self._keys.get(req.request_id)
        if k is None:
            k = BlockKeys(req.token_ids, req.cache_salt, self.block_size, self._seed)
            self._keys[req.request_id] = k
        return k

    def match(self, req: Request) -> list[int]:
        """Cached blocks for the request's prefix, leaving at least one token to compute."""
        if not self.caching:
            return []
        return self.cache.match(self.keys(req), (req.num_tokens - 1) // self.block_size)

    def allocate(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None, reserve: int = 0
    ) -> bool:
        """Give req blocks for num_new_tokens more tokens (after its cache hit, if admitting).

        hit_blocks: blocks from `match`, taken only when req holds no blocks yet. Returns False,
        changing nothing, if free + evictable blocks are not enough, or would fall below reserve.
        """
        bs = self.block_size
        if not hit_blocks:
            need = (req.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(req.block_ids)
            if need <= 0 and req.block_ids:
                return True  # fast path: a decode token that fits in its last block
            hit_blocks = []
        else:
            assert not req.block_ids, "cache hits are only taken on admission"
            num_computed = req.num_computed_tokens + len(hit_blocks) * bs
            need = cdiv(num_computed + num_new_tokens, bs) - len(hit_blocks)
        reserved_hits = sum(1 for b in hit_blocks if self.pool.ref_cnt[b] == 0)
        if need + reserve > self.num_available_blocks - reserved_hits:
            return False
        if not req.block_ids:  # admission: the cache lookup counts now
            self.stats.queries += req.num_tokens
            self.stats.hits += len(hit_blocks) * self.block_size
            self.stats.hit_blocks += len(hit_blocks)
            self._committed[req.request_id] = len(hit_blocks)
            self._holders[req.request_id] = req
            self.cache.touch(hit_blocks)
            for b in hit_blocks:
                self._ref(b)
            req.block_ids = list(hit_blocks)
        if need > self.pool.num_free:
            self.evict(need - self.pool.num_free)
        for _ in range(max(need, 0)):
            req.block_ids.append(self.pool.pop())
        return True

    def evict(self, n: int) -> int:
        """Drop up to n unreferenced cached blocks back to the free list; returns how many."""
        evicted = self.cache.evict(n)
        self.stats.evictions += len(evicted)
        for b in evicted:
            self.pool.push(b)
        return len(evicted)

    def reset_cache(self) -> int:
        """Drop every unreferenced cached block (blocks in use stay cached); returns how many.

        KV events: the dropped blocks' BlockRemoved, then AllBlocksCleared when nothing stays cached."""
        n = self.evict(self.cache.num_evictable)
        if self.cache.events is not None and self.cache.num_cached == 0:
            self.cache.events.cleared()
        return n

    def commit(self, req: Request) -> None:
        """Cache the request's newly full blocks whose K/V is written or being written by a
        dispatched step (later steps run after it), of known tokens only: a block holding a PENDING
        placeholder waits until its token lands (its key needs the token)."""
        if not self.caching:
            return
        start, full = self._committed[req.request_id], req.num_computed_tokens // self.block_size
        if full <= start:
            return  # no newly full block (most calls: a decode step inside a block)
        end = min(full, req.num_known_tokens // self.block_size)  # not past a PENDING placeholder
        if end <= start:
            return
        ids = self.cache.insert(self.keys(req), req.block_ids, start, end)
        for i, b in enumerate(ids, start):
            own = req.block_ids[i]
            if b != own:  # an identical block is cached: share it, drop our copy
                self._ref(b)
                req.block_ids[i] = b
                self._unref(own)
        self._committed[req.request_id] = end

    def free(self, req: Request) -> None:
        """Release the request's blocks; full cached ones stay cached (evictable), tail first."""
        for b in reversed(req.block_ids):
            self._unref(b)
        req.block_ids = []
        self._committed.pop(req.request_id, None)
        self._holders.pop(req.request_id, None)

    def forget(self, req: Request) -> None:
        """The request is finished: drop its memoised block keys too."""
        self.free(req)
        self._keys.pop(req.request_id, None)

    def _ref(self, b: int) -> None:
        if self.pool.incref(b):
            self.cache.on_ref(b)

    def _unref(self, b: int) -> None:
        if self.pool.decref(b):
            if self.cache.is_cached(b):
                self.cache.on_unref(b)
            else:
                self.pool.push(b)

    def check_invariants(self) -> None:
        """free + cached-unreferenced + referenced == total (null block aside), and more."""
        pool, cache = self.pool, self.cache
        pool.check_invariants()
        cache.check_invariants()
        refs = [0] * pool.num_blocks
        for req in self._holders.values():
            assert not req.is_finished, f"finished request {req.request_id} still holds blocks"
            for b in req.block_ids:
                assert b != NULL_BLOCK, "the null block was handed out"
                assert not pool.is_free(b), f"block {b} is free but in {req.request_id}'s table"
                refs[b] += 1
        assert refs == pool.ref_cnt, "ref counts disagree with the block tables"
        referenced = sum(1 for r in refs if r > 0)
        cached_unref = sum(1 for b in range(1, pool.num_blocks) if refs[b] == 0 and cache.is_cached(b))
        assert cached_unref == cache.num_evictable
        assert pool.num_free + cached_unref + referenced == pool.num_blocks - 1, "a block leaked"
        for req in self._holders.values():
            c = self._committed[req.request_id]
            assert all(cache.is_cached(b) for b in req.block_ids[:c]) or not self.caching
