"""The waiting queue and the order in which it is admitted.

- `fcfs`: arrival order; preempted requests go back to the front (they keep their place).
- `priority`: lower `Request.priority` first, then arrival.
- `lpm` (longest prefix match, SGLang's cache-aware policy): the request with the longest cached
  prefix first. Aging bounds starvation: a request passed over for `lpm_max_wait_steps` steps in
  which others were admitted is served in fcfs order before all warm ones. Above `lpm_max_queue`
  waiting requests, matching every prompt each step costs too much and the order falls back to fcfs.

In-batch dedup: a request whose first uncached block is being computed right now by another request
(a prefill in progress, or one admitted earlier this step) is deferred a step, so it hits the cache
instead of computing the same new prefix twice.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING
from collections.abc import Iterator

from .request import Request

if TYPE_CHECKING:
    from .kv_manager import KVManager
    from .scheduler_config import SchedulerConfig


class WaitingQueue:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self._q: deque[Request] = deque()
        self._pending: set[bytes] = set()
        self._dedup = config.dedup_in_batch and config.prefix_cache != "off"

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def remove_many(self, reqs: list[Request]) -> None:
        if reqs:
            gone = {id(r) for r in reqs}
            self._q = deque(r for r in self._q if id(r) not in gone)

    def age(self, others_admitted: bool) -> None:
        if others_admitted:
            for r in self._q:
                r.wait_steps += 1

    def ordered(self, running: list[Request], step: int) -> Iterator[Request]:
        """Waiting requests in admission order for this step (a snapshot)."""
        if self._dedup:
            self._pending = set()
            for r in running:
                if r.num_tokens - r.num_computed_tokens > 1:  # a prefill in progress
                    self._add_pending(r, r.num_computed_tokens // self.kv.block_size)
        policy = self.config.policy
        if policy == "priority":
            return iter(sorted(self._q, key=lambda r: (r.priority, r.arrival_time)))
        if policy == "lpm" and self.kv.caching and len(self._q) <= self.config.lpm_max_queue:
            limit = self.config.lpm_max_wait_steps
            aged = [r for r in self._q if r.wait_steps >= limit]
            warm = [r for r in self._q if r.wait_steps < limit]
            warm.sort(key=lambda r: -len(self.kv.match(r)))  # stable: ties stay fcfs
            return iter(aged + warm)
        return iter(list(self._q))

    def _add_pending(self, req: Request, first_block: int) -> None:
        keys = self.kv.keys(req)
        for i in range(first_block, req.num_tokens // self.kv.block_size):
            self._pending.add(keys.block_hash(i))

    def should_defer(self, req: Request, num_hit_blocks: int) -> bool:
        if not self._dedup or not self._pending:
            return False
        if num_hit_blocks >= (req.num_tokens - 1) // self.kv.block_size:
            return False  # nothing more of it could come from the cache
        return self.kv.keys(req).block_hash(num_hit_blocks) in self._pending

    def note_admitted(self, req: Request, num_cached_tokens: int) -> None:
        if self._dedup:
            self._add_pending(req, num_cached_tokens // self.kv.block_size)
