"""One interface for the prefix caches (`hash`, `radix`, `off`) and the per-request block keys.

Locking contract (all caches): a cached block is *referenced* while `pool.ref_cnt[b] > 0`, i.e. some
request's block table holds it. The cache may only evict cached blocks whose ref_cnt is 0. The
`KVManager` is the only caller: it tells the cache about every 0->1 (`on_ref`) and 1->0 (`on_unref`)
transition of a cached block, and puts the block ids that `evict` returns back into the pool.
Only full blocks of known tokens whose K/V is written, or is being written by a dispatched step, are
ever inserted: steps run on the device in dispatch order, so a step that reuses a block reads it
written (scheduler.py `dispatched`); a block holding a token still being sampled is inserted when
the token lands.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array

from .block_pool import BlockPool
from .kv_events import KVEventSink


class BlockKeys:
    """Lazily computed identities of a request's full blocks (token tuples and chained hashes).

    Full blocks never change (tokens are only appended), so the memo stays valid for the request's
    life, preemptions included.
    """

    __slots__ = ("tokens", "salt", "block_size", "_seed", "_tuples", "_hashes")

    def __init__(self, tokens: list[int], salt: str | None, block_size: int, seed: bytes) -> None:
        self.tokens = tokens  # the request's live token list
        self.salt = salt
        self.block_size = block_size
        self._seed = seed
        self._tuples: list[tuple[int, ...]] = []
        self._hashes: list[bytes] = []

    @property
    def num_full_blocks(self) -> int:
        return len(self.tokens) // self.block_size

    def block_tokens(self, i: int) -> tuple[int, ...]:
        while len(self._tuples) <= i:
            j = len(self._tuples) * self.block_size
            self._tuples.append(tuple(self.tokens[j : j + self.block_size]))
        return self._tuples[i]

    def block_hash(self, i: int) -> bytes:
        """Chained hash of block i: H(parent hash, its tokens, salt), seeded. Not Python's hash()."""
        while len(self._hashes) <= i:
            k = len(self._hashes)
            parent = self._hashes[k - 1] if k else self._seed
            self._hashes.append(hash_block(parent, self.block_tokens(k), self.salt))
        return self._hashes[i]


def hash_block(parent: bytes, tokens: tuple[int, ...], salt: str | None) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


class PrefixCache(ABC):
    """Maps block-aligned token prefixes to blocks holding their K/V; see the module docstring."""

    def __init__(self, pool: BlockPool, block_size: int, eviction: str = "lru") -> None:
        self.pool = pool
        self.block_size = block_size
        self.eviction = eviction
        self._tick = 0  # logical clock for recency
        self.events: KVEventSink | None = None  # set to publish BlockStored/BlockRemoved (kv_events)

    def _emit_stored(self, keys: BlockKeys, start: int, end: int) -> None:
        """Report newly cached full blocks [start, end) of one request as one chained BlockStored."""
        if self.events is None or end <= start:
            return
        bs = self.block_size
        self.events.stored([keys.block_hash(i) for i in range(start, end)],
                           keys.block_hash(start - 1) if start else None,
                           list(keys.tokens[start * bs : end * bs]))

    def now(self) -> int:
        self._tick += 1
        return self._tick

    @abstractmethod
    def match(self, keys: BlockKeys, max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix, at most max_blocks. Takes no reference."""

    @abstractmethod
    def touch(self, block_ids: list[int]) -> None:
        """A request is about to reuse these matched blocks: count the hit, refresh recency."""

    @abstractmethod
    def insert(self, keys: BlockKeys, block_ids: list[int], start: int, end: int) -> list[int]:
        """Cache the request's full blocks [start, end); block_ids[:start] are already cached.

        Returns the block ids the request should hold for [start, end): where an identical block is
        already cached, its id replaces the request's own (the caller swaps and frees the copy).
        """

    @abstractmethod
    def is_cached(self, block_id: int) -> bool: ...

    @abstractmethod
    def on_ref(self, block_id: int) -> None:
        """A cached block went from 0 to 1 reference: no longer evictable."""

    @abstractmethod
    def on_unref(self, block_id: int) -> None:
        """A cached block went from 1 to 0 references: evictable now."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Cached blocks with no reference."""

    @property
    @abstractmethod
    def num_cached(self) -> int: ...

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Drop up to n unreferenced cached blocks by the eviction policy; returns their ids."""

    @abstractmethod
    def check_invariants(self) -> None: ...


class NoPrefixCache(PrefixCache):
    """`--prefix-cache off`: nothing is cached, every released block goes straight back to the pool."""

    def match(self, keys: BlockKeys, max_blocks: int) -> list[int]:
        return []

    def touch(self, block_ids: list[int]) -> None:
        pass

    def insert(self, keys: BlockKeys, block_ids: list[int], start: int, end: int) -> list[int]:
        return block_ids[start:end]

    def is_cached(self, block_id: int) -> bool:
        return False

    def on_ref(self, block_id: int) -> None:
        raise AssertionError("no block is cached")

    on_unref = on_ref

    @property
    def num_evictable(self) -> int:
        return 0

    @property
    def num_cached(self) -> int:
        return 0

    def evict(self, n: int) -> list[int]:
        return []

    def check_invariants(self) -> None:
        pass


def make_prefix_cache(kind: str, pool: BlockPool, block_size: int, eviction: str) -> PrefixCache:
    from .hash_cache import HashPrefixCache
    from .radix_cache import RadixPrefixCache

    caches = {"off": NoPrefixCache, "hash": HashPrefixCache, "radix": RadixPrefixCache}
    if kind not in caches:
        raise ValueError(f"prefix_cache={kind!r}: choose one of {sorted(caches)}")
    return caches[kind](pool, block_size, eviction)
