"""`jaxserve bench sim --replicas N`: N simulated replicas behind a router, on a conversation trace.

Each replica is the real Scheduler and KV manager (the prefix cache included) on its own modelled
clock (bench/sim.py's cost model); a discrete-event loop delivers each conversation turn to the
replica the router picks, and the next turn arrives when the previous answer is done (plus think
time), its prompt the whole history with the answer in it. Routers:
- `round_robin`;
- `least_load`: fewest running + waiting requests;
- `cache_aware`: SMG's rule: per worker an approximate prefix tree of what it was sent (here: the
  block-aligned prefixes of the request's tokens); the worker with the longest match gets the
  request when the match covers >= `cache_threshold` of it (SMG default 0.3), unless that worker's
  load exceeds the mean by `balance_abs` requests and `balance_rel` times (SMG: 64, 1.5); otherwise
  the least-loaded worker (ties: the smallest tree). Then the request's prefixes join its tree.
Reports, per policy: prefix-hit tokens, hit ratio (hits / queried prompt tokens, vLLM's unit) per
replica and overall, TTFT mean / p99 (modelled), so N and the policy can be chosen before buying chips.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import numpy as np

from bench.sim import CostModel
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_config import SchedulerConfig

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass
class Conv:
    turns: list[list[int]]  # turn 0: system + user; then user tokens per turn
    answer_len: int
    history: list[int] = field(default_factory=list)


def conversation_trace(num: int, turns: int, system_tokens: int, user_tokens: int, answer_len: int,
                       shared_system: bool = False, seed: int = 0, vocab: int = 32000) -> list[Conv]:
    """Token-level twin of bench/conversations.py's traces (distinct or one shared system prompt)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(system_tokens)]
    out = []
    for _ in range(num):
        system = shared if shared_system else [rng.randrange(vocab) for _ in range(system_tokens)]
        users = [[rng.randrange(vocab) for _ in range(user_tokens)] for _ in range(turns)]
        out.append(Conv([system + users[0], *users[1:]], answer_len))
    return out


class SimReplica:
    def __init__(self, cfg: SchedulerConfig, cost: CostModel, rng: random.Random) -> None:
        self.sched = Scheduler(cfg)
        self.cost, self.rng = cost, rng
        self.t = 0.0  # when this replica is next free
        self.tree: set[bytes] = set()  # the router's approximate view of what this worker saw
        self.ttft: list[float] = []
        self._first: set[str] = set()  # requests that have their first token

    @property
    def load(self) -> int:
        return self.sched.num_running + self.sched.num_waiting

    def step(self) -> list[Request]:
        """One engine step on the modelled clock; returns requests that finished."""
        out = self.sched.schedule()
        self.t += self.cost.step_time(out.num_prefill_tokens, out.num_decode_tokens)
        sampled = {s.request.request_id: self.rng.randrange(32000) for s in out.scheduled if s.samples}
        self.sched.dispatched(out)
        for s in out.scheduled:
            r = s.request
            if s.samples and r.request_id not in self._first:
                self._first.add(r.request_id)
                self.ttft.append(self.t - r.arrival_time)
        landed = self.sched.update_from_output(out, sampled)
        done = [s.request for s in out.scheduled if s.request.request_id in landed
                and landed[s.request.request_id].finished]
        return done + list(out.finished)


class CacheAwareRouter:
    """SMG's cache_aware decision, on block-aligned token prefixes instead of characters."""

    def __init__(self, block: int, threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5):
        self.block, self.threshold, self.abs, self.rel = block, threshold, balance_abs, balance_rel

    def keys(self, tokens: list[int]) -> list[bytes]:
        return [bytes(str(tokens[: k + self.block]), "ascii") for k in range(0, len(tokens) - self.block + 1,
                                                                                    self.block)]

    def pick(self, replicas: list[SimReplica], tokens: list[int]) -> int:
        keys = self.keys(tokens)
        loads = [r.load for r in replicas]
        mean = sum(loads) / len(loads)

        def matched(r: SimReplica) -> int:
            n = 0
            for k in keys:
                if k not in r.tree:
                    break
                n += 1
            return n

        best = max(range(len(replicas)), key=lambda i: (matched(replicas[i]), -loads[i]))
        share = matched(replicas[best]) * self.block / max(len(tokens), 1)
        spill = loads[best] > mean + self.abs and loads[best] > mean * self.rel
        if share < self.threshold or spill:
            best = min(range(len(replicas)), key=lambda i: (loads[i], len(replicas[i].tree)))
        replicas[best].tree.update(keys)
        return best


def simulate_replicas(convs: list[Conv], n: int, policy: str, *, num_blocks: int = 512, block_size: int = 16,
                      max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 8192,
                      cost: CostModel | None = None, think_s: float = 0.0, concurrency: int | None = None,
                      prefix_cache: str = "radix", seed: int = 0) -> dict:
    """Run every conversation's turns in order (`concurrency` conversations at a time; `think_s` is
    the mean of an exponential pause between an answer and the next turn)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
    cost = cost or CostModel()
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          prefix_cache=prefix_cache)
    rng = random.Random(seed)
    replicas = [SimReplica(cfg, cost, rng) for _ in range(n)]
    router, rr = CacheAwareRouter(block_size), itertools.count()
    convs = [Conv(list(c.turns), c.answer_len) for c in convs]
    arrivals: list[tuple[float, int, int]] = []  # (time, conversation, turn)
    limit = concurrency or len(convs)
    for c in range(min(limit, len(convs))):
        heapq.heappush(arrivals, (0.0, c, 0))
    started = min(limit, len(convs))
    owner: dict[str, tuple[int, int]] = {}
    landed = [[] for _ in convs]
    ids = itertools.count()
    while arrivals or any(r.sched.has_unfinished_requests() for r in replicas):
        busy = [r for r in replicas if r.sched.has_unfinished_requests()]
        t_step = min((r.t for r in busy), default=float("inf"))
        if arrivals and arrivals[0][0] <= t_step:
            t, c, turn = heapq.heappop(arrivals)
            conv = convs[c]
            conv.history = conv.history + conv.turns[turn]
            prompt = list(conv.history)
            if policy == "round_robin":
                i = next(rr) % n
            elif policy == "least_load":
                i = min(range(n), key=lambda k: (replicas[k].load, k))
            else:
                i = router.pick(replicas, prompt)
            rep = replicas[i]
            if not rep.sched.has_unfinished_requests():
                rep.t = max(rep.t, t)
            req = Request(f"c{c}t{turn}r{next(ids)}", prompt, conv.answer_len, arrival_time=t)
            owner[req.request_id] = (c, turn)
            landed[c].append(i)
            rep.sched.add_request(req)
            continue
        rep = min(busy, key=lambda r: r.t)
        for req in rep.step():
            c, turn = owner.pop(req.request_id)
            conv = convs[c]
            conv.history = list(req.token_ids[: req.num_prompt_tokens + conv.answer_len])
            think = rng.expovariate(1 / think_s) if think_s else 0.0  # a user's reading/typing time
            if turn + 1 < len(conv.turns):
                heapq.heappush(arrivals, (rep.t + think, c, turn + 1))
            elif started < len(convs):
                heapq.heappush(arrivals, (rep.t + think, started, 0))
                started += 1
    per = []
    for r in replicas:
        st = r.sched.stats()
        per.append({"hit_tokens": st["prefix_cache_hits"], "query_tokens": st["prefix_cache_queries"],
                    "hit_ratio": st["prefix_cache_hits"] / max(st["prefix_cache_queries"], 1),
                    "requests": len(r.ttft), "ttft_mean_s": float(np.mean(r.ttft)) if r.ttft else 0.0})
    hits, queries = sum(p["hit_tokens"] for p in per), sum(p["query_tokens"] for p in per)
    ttft = [x for r in replicas for x in r.ttft]
    return {"policy": policy, "replicas": n, "hit_tokens": hits, "query_tokens": queries,
            "hit_ratio": hits / max(queries, 1), "ttft_mean_s": float(np.mean(ttft)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "per_replica": per, "landed": landed,
            "makespan_s": max(r.t for r in replicas)}


def table(rows: list[dict]) -> str:
    head = ("replicas", "policy", "hit tokens", "hit ratio", "per-replica hit ratio", "TTFT mean s", "p99 s")
    cells = [head] + [(str(r["replicas"]), r["policy"], str(r["hit_tokens"]), f"{r['hit_ratio']:.1%}",
                       " ".join(f"{p['hit_ratio']:.0%}" for p in r["per_replica"]), f"{r['ttft_mean_s']:.3f}",
                       f"{r['ttft_p99_s']:.3f}") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
