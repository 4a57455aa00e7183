"""vLLM-style prefix cache: a flat table from chained block hashes to block ids.

A block's identity is H(parent hash, its tokens, cache_salt), so equal hashes mean equal prefixes.
Unreferenced cached blocks wait in an eviction queue:
- `lru`: exact least-recently-released order (a released request's tail blocks go first, as vLLM).
- `trunk`: as far as a flat table can tell trunks from leaves: blocks with no cached child go
  first, then blocks with fewer hits (log2 buckets), then the least recent.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from .block_pool import BlockPool
from .prefix_cache import BlockKeys, PrefixCache


class HashPrefixCache(PrefixCache):
    def __init__(self, pool: BlockPool, block_size: int, eviction: str = "lru") -> None:
        super().__init__(pool, block_size, eviction)
        self.table: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self.parent_hash: dict[int, bytes | None] = {}
        self.num_children: dict[bytes, int] = {}
        self.hits: dict[int, int] = {}
        self.last_access: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, oldest first
        self._heap: list[tuple[tuple[int, int, int], int, int]] = []  # (key, block, version)
        self._version: dict[int, int] = {}
        self._evictable: set[int] = set()
        self._removed_hashes: list[bytes] = []  # of the evict call in progress (events)

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, keys: BlockKeys, max_blocks: int) -> list[int]:
        out = []
        for i in range(max_blocks):
            b = self.table.get(keys.block_hash(i))
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, block_ids: list[int]) -> None:
        t = self.now()
        for b in block_ids:
            self.hits[b] += 1
            self.last_access[b] = t

    def insert(self, keys: BlockKeys, block_ids: list[int], start: int, end: int) -> list[int]:
        out = []
        t = self.now()
        run = start  # first block of the current run of newly cached blocks (events)
        for i in range(start, end):
            h = keys.block_hash(i)
            b = self.table.get(h)
            if b is not None:
                self._emit_stored(keys, run, i)
                run = i + 1
            if b is None:
                b = block_ids[i]
                assert b not in self.block_hash, f"block {b} cached under two hashes"
                parent = keys.block_hash(i - 1) if i else None
                self.table[h] = b
                self.block_hash[b] = h
                self.parent_hash[b] = parent
                self.hits[b] = 0
                self.last_access[b] = t
                if parent is not None:
                    self.num_children[parent] = self.num_children.get(parent, 0) + 1
            out.append(b)
        self._emit_stored(keys, run, end)
        return out

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.block_hash

    # ---- eviction -----------------------------------------------------------------------------
    def on_ref(self, block_id: int) -> None:
        self._evictable.discard(block_id)
        self._lru.pop(block_id, None)

    def on_unref(self, block_id: int) -> None:
        self._evictable.add(block_id)
        self.last_access[block_id] = self.now()
        if self.eviction == "lru":
            self._lru[block_id] = None
        else:
            self._push(block_id)

    def _trunk_key(self, b: int) -> tuple[int, int, int]:
        has_child = self.num_children.get(self.block_hash[b], 0) > 0
        return (int(has_child), self.hits[b].bit_length(), self.last_access[b])

    def _push(self, b: int) -> None:
        v = self._version.get(b, 0) + 1
        self._version[b] = v
        heapq.heappush(self._heap, (self._trunk_key(b), b, v))

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self.block_hash)

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and self._evictable:
            if self.eviction == "lru":
                b, _ = self._lru.popitem(last=False)
            else:
                key, b, v = heapq.heappop(self._heap)
                if b not in self._evictable or v != self._version[b]:
                    continue  # stale entry
                if key != self._trunk_key(b):
                    self._push(b)
                    continue
            self._remove(b)
            out.append(b)
        if self.events is not None:
            self.events.removed(self._removed_hashes)
        self._removed_hashes = []
        return out

    def _remove(self, b: int) -> None:
        self._evictable.discard(b)
        h = self.block_hash.pop(b)
        del self.table[h]
        if self.events is not None:
            self._removed_hashes.append(h)
        parent = self.parent_hash.pop(b)
        del self.hits[b], self.last_access[b]
        self._version.pop(b, None)
        if parent is not None:
            self.num_children[parent] -= 1
            if not self.num_children[parent]:
                del self.num_children[parent]
            pb = self.table.get(parent)
            if pb is not None and pb in self._evictable and self.eviction == "trunk":
                self._push(pb)  # its key fell: it may be a leaf now

    def check_invariants(self) -> None:
        assert len(self.table) == len(self.block_hash)
        for h, b in self.table.items():
            assert self.block_hash[b] == h
            assert not self.pool.is_free(b), f"cached block {b} is also free"
        expect = {b for b in self.block_hash if self.pool.ref_cnt[b] == 0}
        assert expect == self._evictable, "evictable set disagrees with ref counts"
        if self.eviction == "lru":
            assert set(self._lru) == self._evictable
        children: dict[bytes, int] = {}
        for p in self.parent_hash.values():
            if p is not None:
                children[p] = children.get(p, 0) + 1
        assert children == self.num_children, "child counters disagree with a recount"
