"""Seeded request workloads shared by the simulator and the real-model benchmarks.

Each generator yields `WorkItem(arrival_time_s, prompt_token_ids, max_tokens)` (a NamedTuple, so
`for t, prompt, max_tokens in gen(...)` works), sorted by arrival time, token ids < vocab_size.
Arrival times assume a server that sustains roughly a few thousand tokens per second; scale them
with `time_scale` for a slower engine (e.g. the CPU model).
"""

from __future__ import annotations

import random
from typing import NamedTuple
from collections.abc import Callable, Iterator


class WorkItem(NamedTuple):
    arrival_time: float  # seconds from the start
    prompt_token_ids: list[int]
    max_tokens: int


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _shared_prefix(num_requests: int, seed: int, vocab_size: int, time_scale: float, rate: float,
                   prefix_len: int, suffix: tuple[int, int], out: tuple[int, int],
                   share: float) -> Iterator[WorkItem]:
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    for t in _poisson_times(rng, num_requests, rate):
        n = rng.randint(*suffix)
        if rng.random() < share:
            prompt = prefix + _tokens(rng, n, vocab_size)
        else:
            prompt = _tokens(rng, prefix_len + n, vocab_size)
        yield WorkItem(t * time_scale, prompt, rng.randint(*out))


def prefill_heavy(num_requests: int = 200, seed: int = 0, vocab_size: int = 32000,
                  time_scale: float = 1.0) -> Iterator[WorkItem]:
    """The seed's prefill-heavy run: 80% share a 256-token prefix; short outputs."""
    return _shared_prefix(num_requests, seed, vocab_size, time_scale, rate=80.0, prefix_len=256,
                          suffix=(16, 128), out=(4, 32), share=0.8)


def decode_heavy(num_requests: int = 200, seed: int = 0, vocab_size: int = 32000,
                 time_scale: float = 1.0) -> Iterator[WorkItem]:
    """The seed's decode-heavy run: 80% share a tiny 32-token prefix; small prompts, long outputs."""
    return _shared_prefix(num_requests, seed, vocab_size, time_scale, rate=20.0, prefix_len=32,
                          suffix=(16, 64), out=(128, 384), share=0.8)


def agent_tree(num_requests: int = 240, seed: int = 0, vocab_size: int = 32000,
               time_scale: float = 1.0, fanout: tuple[int, ...] = (3, 3, 2),
               root_len: int = 512, step_len: int = 48, noise_share: float = 0.35) -> Iterator[WorkItem]:
    """Agent sessions whose contexts form trees, interleaved with one-off requests.

    Each session has a root context (system prompt + task) that fans out into branches (e.g. search
    flights -> several hotel searches -> compare -> book); every level appends `step_len` tokens to
    its parent's full context and arrives a little after it. One-off requests (no sharing) flood the
    cache between sessions, which is where trunk-aware eviction and cache-aware scheduling matter.
    """
    rng = random.Random(seed)
    items: list[WorkItem] = []
    per_tree = 1
    width = 1
    for f in fanout:
        width *= f
        per_tree += width
    num_noise = int(num_requests * noise_share)
    num_trees = max(1, (num_requests - num_noise) // per_tree)
    for t0 in _poisson_times(rng, num_trees, rate=1.5):
        root = _tokens(rng, root_len, vocab_size)
        items.append(WorkItem(t0, root, rng.randint(16, 48)))
        level = [(root, t0)]
        for f in fanout:
            nxt = []
            for ctx, t in level:
                for _ in range(f):
                    child = ctx + _tokens(rng, rng.randint(step_len // 2, step_len), vocab_size)
                    tc = t + rng.uniform(0.2, 1.0)
                    items.append(WorkItem(tc, child, rng.randint(16, 48)))
                    nxt.append((child, tc))
            level = nxt
    end = max(i.arrival_time for i in items)
    for _ in range(num_noise):
        items.append(WorkItem(rng.uniform(0, end), _tokens(rng, rng.randint(200, 600), vocab_size),
                              rng.randint(16, 64)))
    items.sort(key=lambda i: i.arrival_time)
    for it in items[:num_requests]:
        yield WorkItem(it.arrival_time * time_scale, it.prompt_token_ids, it.max_tokens)


def multi_turn_chat(num_requests: int = 200, seed: int = 0, vocab_size: int = 32000,
                    time_scale: float = 1.0, turns: int = 5) -> Iterator[WorkItem]:
    """Conversations: each turn's prompt is the previous prompt + a reply + a new user message."""
    rng = random.Random(seed)
    items = []
    num_convs = max(1, num_requests // turns)
    for t in _poisson_times(rng, num_convs, rate=4.0):
        ctx = _tokens(rng, rng.randint(64, 256), vocab_size)  # system prompt + first message
        for _ in range(turns):
            out = rng.randint(32, 128)
            items.append(WorkItem(t, list(ctx), out))
            ctx = ctx + _tokens(rng, out, vocab_size) + _tokens(rng, rng.randint(16, 64), vocab_size)
            t += rng.uniform(1.0, 3.0)  # the user reads and types
    items.sort(key=lambda i: i.arrival_time)
    for it in items[:num_requests]:
        yield WorkItem(it.arrival_time * time_scale, it.prompt_token_ids, it.max_tokens)


def no_sharing(num_requests: int = 200, seed: int = 0, vocab_size: int = 32000,
               time_scale: float = 1.0) -> Iterator[WorkItem]:
    """Worst case for a prefix cache: nothing is shared."""
    rng = random.Random(seed)
    for t in _poisson_times(rng, num_requests, rate=30.0):
        yield WorkItem(t * time_scale, _tokens(rng, rng.randint(32, 512), vocab_size), rng.randint(16, 128))


WORKLOADS: dict[str, Callable[..., Iterator[WorkItem]]] = {
    "prefill_heavy": prefill_heavy,
    "decode_heavy": decode_heavy,
    "agent_tree": agent_tree,
    "multi_turn_chat": multi_turn_chat,
    "no_sharing": no_sharing,
}
