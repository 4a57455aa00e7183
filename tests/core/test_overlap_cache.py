"""The prefix cache with one step in flight (the engine's overlap): blocks a dispatched step writes
are cached at dispatch, so the next step's admissions hit them; blocks holding a token still being
sampled (PENDING) are never keyed by the placeholder."""

import random

import pytest

from jaxserve.core.request import PENDING
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import SchedulerConfig


def overlapped(sched: Scheduler, arrivals: dict[int, list[Request]], seed: int = 0, vocab: int = 50) -> None:
    """The engine's loop: schedule and dispatch step n + 1, then land step n (its tokens were PENDING
    while step n + 1 was scheduled). Checks the cache's keys against the live tokens every step."""
    rng, inflight, n = random.Random(seed), None, 0
    while sched.has_unfinished_requests() or arrivals or inflight is not None:
        for r in arrivals.pop(n, []):
            sched.add_request(r)
        out = sched.schedule()
        sched.kv.check_invariants()
        sched.dispatched(out)
        if inflight is not None:
            sampled = {s.request.request_id: rng.randrange(vocab) for s in inflight.scheduled
                       if s.samples and not s.request.is_finished}
            sched.update_from_output(inflight, sampled)
        inflight = out if out.scheduled else None
        for r in sched.running:
            keys, bs = sched.kv.keys(r), sched.config.block_size
            for i in range(sched.kv._committed[r.request_id]):
                block = keys.block_tokens(i)
                assert PENDING not in block, f"{r.request_id}: block {i} cached under a placeholder"
                assert list(block) == r.token_ids[i * bs:(i + 1) * bs], f"{r.request_id}: block {i} keyed stale"
        sched.kv.check_invariants()
        n += 1
        assert n < 10_000, "no progress"


def cfg(**kw) -> SchedulerConfig:
    base = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_a_prefix_whose_last_chunk_is_on_the_device_is_hit_by_the_next_admission(prefix_cache):
    # a: 64 prompt tokens in step 0 and its last one in step 1; b (same 64) arrives for step 1, while
    # step 0 is still in flight: it must take a's 16 blocks, not compute them again
    prefix = list(range(1, 65))
    a, b = Request("a", prefix + [90], 3), Request("b", prefix + [91], 3)
    sched = Scheduler(cfg(prefix_cache=prefix_cache))
    overlapped(sched, {0: [a], 1: [b]})
    assert b.num_cached_tokens == 64
    assert sched.stats()["prefix_cache_hits"] == 64


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_of_tokens_still_being_sampled_are_never_cached_by_placeholder(prefix_cache, seed):
    # identical prompts (as n > 1 samples) whose outputs differ: each decode step dispatches with the
    # token before it still PENDING; a block keyed by the placeholder would be shared between them
    # although their tokens differ (overlapped() checks every cached block against the live tokens)
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 13))]
    reqs = [Request(f"r{i}", list(prompt), rng.randrange(5, 30)) for i in range(3)]
    later = Request("late", list(prompt), 4)
    sched = Scheduler(cfg(prefix_cache=prefix_cache, max_num_batched_tokens=8))
    overlapped(sched, {0: reqs, 6: [later]}, seed=seed)
    assert sched.kv.num_free_blocks + sched.kv.cache.num_evictable == sched.kv.num_blocks - 1
