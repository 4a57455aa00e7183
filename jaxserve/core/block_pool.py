"""The physical KV blocks: reference counts and the free list.

Block 0 is the null block: padding writes of a ragged step land there, so it is never handed out.
The pool knows nothing about prefix caching; a block with ref_cnt 0 is either here (free) or held
by the prefix cache (cached, unreferenced, evictable). `KVManager` keeps the two apart.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # FIFO: a freed block goes to the back, so recently freed memory is reused last.
        self._free: deque[int] = deque(range(1, num_blocks))
        self._is_free = [True] * num_blocks
        self._is_free[NULL_BLOCK] = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def pop(self) -> int:
        """Take a free block; the caller owns one reference to it."""
        block_id = self._free.popleft()
        self._is_free[block_id] = False
        self.ref_cnt[block_id] = 1
        return block_id

    def push(self, block_id: int) -> None:
        """Return an unreferenced, uncached block to the free list."""
        assert block_id != NULL_BLOCK, "the null block is never freed"
        assert self.ref_cnt[block_id] == 0, f"block {block_id} freed with ref_cnt {self.ref_cnt[block_id]}"
        assert not self._is_free[block_id], f"block {block_id} freed twice"
        self._is_free[block_id] = True
        self._free.append(block_id)

    def incref(self, block_id: int) -> bool:
        """Add a reference; True if the block just went from unreferenced to referenced."""
        assert not self._is_free[block_id] and block_id != NULL_BLOCK
        self.ref_cnt[block_id] += 1
        return self.ref_cnt[block_id] == 1

    def decref(self, block_id: int) -> bool:
        """Drop a reference; True if the block is now unreferenced."""
        assert self.ref_cnt[block_id] > 0, f"block {block_id} released more often than taken"
        self.ref_cnt[block_id] -= 1
        return self.ref_cnt[block_id] == 0

    def check_invariants(self) -> None:
        assert self.ref_cnt[NULL_BLOCK] == 0 and not self._is_free[NULL_BLOCK], "null block in use"
        assert len(set(self._free)) == len(self._free), "a block is twice in the free list"
        assert sum(self._is_free) == len(self._free)
        for b in self._free:
            assert self._is_free[b] and self.ref_cnt[b] == 0, f"free block {b} is referenced"
        assert all(r >= 0 for r in self.ref_cnt), "negative ref count"
