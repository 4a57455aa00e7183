"""SGLang-style prefix cache: a radix tree over block-aligned token runs.

Each node holds a run of full blocks (one token tuple per block) and their block ids; a request's
cached prefix is a root-to-node path that always ends at a node boundary (matches split nodes),
so every block of a node has the same reference count: that count is the node's lock count.
Only unlocked leaves are evictable; they sit in a heap ordered by the eviction policy (`lru`: last
access; `trunk`: hits in log2 buckets, then last access), so shared trunks, which many requests pass
through and hit, outlive disposable leaf tips. Evictable/protected block counts are running
counters, updated on each 0<->1 reference change, never recomputed by walking the tree.
Each `cache_salt` gets its own root, so salted requests never share blocks with others.
"""

from __future__ import annotations

import heapq
import itertools

from .block_pool import BlockPool
from .prefix_cache import BlockKeys, PrefixCache


class Node:
    __slots__ = ("parent", "keys", "blocks", "children", "last_access", "hits", "evicted")

    def __init__(self, parent: Node | None, keys: list, blocks: list[int], t: int = 0) -> None:
        self.parent = parent
        self.keys: list[tuple[int, ...]] = keys  # token tuple of each block
        self.blocks = blocks
        self.children: dict[tuple[int, ...], Node] = {}
        self.last_access = t
        self.hits = 0
        self.evicted = False


class RadixPrefixCache(PrefixCache):
    def __init__(self, pool: BlockPool, block_size: int, eviction: str = "lru") -> None:
        super().__init__(pool, block_size, eviction)
        self.roots: dict[str | None, Node] = {}
        self.node_of: dict[int, Node] = {}
        self.evictable = 0  # cached blocks with ref 0
        self.protected = 0  # cached blocks with ref > 0
        self._heap: list[tuple[tuple[int, ...], int, Node]] = []
        self._seq = itertools.count()
        self._hash_of: dict[int, bytes] = {}  # block -> chained hash, only while events are on

    def lock_ref(self, node: Node) -> int:
        return self.pool.ref_cnt[node.blocks[0]]

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, keys: BlockKeys, max_blocks: int) -> list[int]:
        node = self.roots.get(keys.salt)
        out: list[int] = []
        i = 0
        while node is not None and i < max_blocks:
            child = node.children.get(keys.block_tokens(i))
            if child is None:
                break
            j = 0
            while j < len(child.blocks) and i < max_blocks and child.keys[j] == keys.block_tokens(i):
                out.append(child.blocks[j])
                i += 1
                j += 1
            if j < len(child.blocks):
                self._split(child, j)
                break
            node = child
        return out

    def touch(self, block_ids: list[int]) -> None:
        t = self.now()
        last = None
        for b in block_ids:
            node = self.node_of[b]
            if node is not last:
                node.hits += 1
                node.last_access = t
                last = node

    def _split(self, node: Node, j: int) -> Node:
        """Cut node after its j-th block; returns the new parent holding the first j blocks."""
        assert 0 < j < len(node.blocks)
        top = Node(node.parent, node.keys[:j], node.blocks[:j], node.last_access)
        top.hits = node.hits
        node.parent.children[top.keys[0]] = top
        node.keys, node.blocks = node.keys[j:], node.blocks[j:]
        node.parent = top
        top.children[node.keys[0]] = node
        for b in top.blocks:
            self.node_of[b] = top
        return top

    def insert(self, keys: BlockKeys, block_ids: list[int], start: int, end: int) -> list[int]:
        t = self.now()
        if start == 0:
            node = self.roots.get(keys.salt)
            if node is None:
                node = self.roots[keys.salt] = Node(None, [], [], t)
            off = 0
        else:
            node = self.node_of[block_ids[start - 1]]
            off = node.blocks.index(block_ids[start - 1]) + 1
        ours = start > 0  # node holds our last block; exclusive if its lock count is 1
        out: list[int] = []
        run = start  # first block of the current run of newly cached blocks (events)
        for i in range(start, end):
            bt = keys.block_tokens(i)
            if off < len(node.blocks):
                if node.keys[off] == bt:  # someone cached the same block meanwhile
                    out.append(node.blocks[off])
                    off += 1
                    self._emit_stored(keys, run, i)
                    run = i + 1
                    continue
                node, off, ours = self._split(node, off), off, False
            child = node.children.get(bt)
            if child is not None:
                out.append(child.blocks[0])
                node, off, ours = child, 1, False
                self._emit_stored(keys, run, i)
                run = i + 1
                continue
            own = block_ids[i]
            assert own not in self.node_of and self.pool.ref_cnt[own] == 1
            if ours and node.parent is not None and not node.children and self.lock_ref(node) == 1:
                node.keys.append(bt)  # only this request holds the leaf: grow it in place
                node.blocks.append(own)
            else:
                new = Node(node, [bt], [own], t)
                node.children[bt] = new
                node, ours = new, True
            node.last_access = t
            off = len(node.blocks)
            self.node_of[own] = node
            self.protected += 1
            out.append(own)
            if self.events is not None:
                self._hash_of[own] = keys.block_hash(i)
        self._emit_stored(keys, run, end)
        if 0 < off < len(node.blocks):
            self._split(node, off)
        return out

    def is_cached(self, block_id: int) -> bool:
        return block_id in self.node_of

    # ---- eviction -----------------------------------------------------------------------------
    def on_ref(self, block_id: int) -> None:
        self.evictable -= 1
        self.protected += 1

    def on_unref(self, block_id: int) -> None:
        self.evictable += 1
        self.protected -= 1
        node = self.node_of[block_id]
        node.last_access = self.now()
        if not node.children and self.lock_ref(node) == 0 and self.pool.ref_cnt[node.blocks[-1]] == 0:
            self._push(node)

    def _key(self, node: Node) -> tuple[int, ...]:
        if self.eviction == "trunk":
            return (node.hits.bit_length(), node.last_access)
        return (node.last_access,)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (self._key(node), next(self._seq), node))

    def _evictable_leaf(self, node: Node) -> bool:
        return (
            not node.evicted
            and node.parent is not None
            and not node.children
            and all(self.pool.ref_cnt[b] == 0 for b in node.blocks)
        )

    @property
    def num_evictable(self) -> int:
        return self.evictable

    @property
    def num_cached(self) -> int:
        return self.evictable + self.protected

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        removed: list[bytes] = []
        while len(out) < n and self._heap:
            key, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node):
                continue
            if key != self._key(node):
                self._push(node)
                continue
            first = node.keys[0]
            for _ in range(min(n - len(out), len(node.blocks))):  # drop the tail first
                b = node.blocks.pop()
                node.keys.pop()
                del self.node_of[b]
                out.append(b)
                h = self._hash_of.pop(b, None)
                if h is not None:
                    removed.append(h)
            if node.blocks:
                self._push(node)
                continue
            node.evicted = True
            parent = node.parent
            del parent.children[first]
            if parent.parent is not None and self._evictable_leaf(parent):
                self._push(parent)
        self.evictable -= len(out)
        if self.events is not None:
            self.events.removed(removed)
        return out

    # ---- checks -------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        evictable = protected = 0
        seen: set[int] = set()
        in_heap = {id(e[2]) for e in self._heap}
        for node in self._nodes():
            for key, child in node.children.items():
                assert child.parent is node and child.keys[0] == key and not child.evicted
            if node.parent is None:
                assert not node.blocks
                continue
            assert node.blocks and len(node.blocks) == len(node.keys)
            refs = {self.pool.ref_cnt[b] for b in node.blocks}
            assert len(refs) == 1, f"blocks of one node with different lock counts {refs}"
            for b, k in zip(node.blocks, node.keys):
                assert len(k) == self.block_size
                assert self.node_of.get(b) is node, f"block {b} maps to another node"
                assert b not in seen, f"block {b} twice in the tree"
                assert not self.pool.is_free(b), f"cached block {b} is also free"
                seen.add(b)
            if refs == {0}:
                evictable += len(node.blocks)
                if not node.children:
                    assert id(node) in in_heap, "an unlocked leaf is missing from the heap"
            else:
                protected += len(node.blocks)
        assert seen == set(self.node_of), "node_of has blocks that are not in the tree"
        assert (evictable, protected) == (self.evictable, self.protected), (
            f"counters {(self.evictable, self.protected)} != recount {(evictable, protected)}"
        )
